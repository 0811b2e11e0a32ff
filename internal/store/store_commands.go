package store

// The store's command records (commands.go) and the OTA progress of
// downloads (ota.go).

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sync"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
)

// KeepCommands is how many of a device's newest commands are kept.
const KeepCommands = 200

// notifier wakes every waiter at once: wait returns a channel that the
// next broadcast closes.
type notifier struct {
	mu sync.Mutex
	ch chan struct{} // nil until someone waits
}

func (n *notifier) wait() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ch == nil {
		n.ch = make(chan struct{})
	}
	return n.ch
}

func (n *notifier) broadcast() {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ch != nil {
		close(n.ch)
		n.ch = nil
	}
}

// CommandInsert is a command record, its audit entry, or both, waiting
// for the next group commit.
type CommandInsert struct {
	C        *model.Command // nil: an audit entry alone
	Device   *DeviceRef     // c's device
	Deadline string         // when c times out, unless it has ended
	audit    *model.AuditEntry
	Done     chan error
}

// InsertCommand stores a new command record of the device, to time out
// at deadline, with the request's audit entry (nil: a rollout's command,
// which has none), and returns once both are committed: one commit, so that a
// command request waits for one fsync, not two. Concurrent inserts share
// one transaction, and so one fsync: that is what lets thousands of
// commands a second through. After Close it returns errStoreClosed.
func (s *Store) InsertCommand(c *model.Command, d *DeviceRef, deadline string, audit *model.AuditEntry) error {
	return s.groupCommit(CommandInsert{C: c, Device: d, Deadline: deadline, audit: audit, Done: make(chan error, 1)})
}

// AddAudit stores an audit entry alone, for a write the store does not
// make in one transaction with it (a broker login's), as InsertCommand
// stores a command, in the same group commits.
func (s *Store) AddAudit(e *model.AuditEntry) error {
	return s.groupCommit(CommandInsert{audit: e, Done: make(chan error, 1)})
}

func (s *Store) groupCommit(ci CommandInsert) error {
	select {
	case s.inserts <- ci:
		return <-ci.Done
	case <-s.closing:
		return errStoreClosed
	}
}

// maxInsertBatch bounds a group commit: a burst shares a few fsyncs, and
// a transaction stays short.
const maxInsertBatch = 1000

// insertLoop commits queued command records in batches until Close.
func (s *Store) insertLoop() {
	defer close(s.insertDone)
	w, prepErr := s.PrepareCommandWriter()
	defer w.Close()
	for {
		var batch []CommandInsert
		select {
		case ci := <-s.inserts:
			batch = append(batch, ci)
		case <-s.closing:
			return
		}
	collect:
		for len(batch) < maxInsertBatch {
			select {
			case ci := <-s.inserts:
				batch = append(batch, ci)
			default:
				break collect
			}
		}
		s.CommitInserts(w, prepErr, batch)
	}
}

// CommitInserts commits a batch in one transaction. When that fails, each
// record is tried alone, so that one bad record (its device removed a
// moment before) fails only its own request.
func (s *Store) CommitInserts(w *commandWriter, prepErr error, batch []CommandInsert) {
	err := prepErr
	if err == nil {
		err = s.inTx(context.Background(), func(tx *sql.Tx) error {
			teams, err := w.write(tx, batch)
			if err != nil {
				return err
			}
			audit := tx.Stmt(w.audit)
			for _, ci := range batch {
				if ci.audit != nil {
					if err := scanEntryID(audit.QueryRow(auditArgs(ci.audit)...), ci.audit); err != nil {
						return err
					}
				}
			}
			return s.keepTeamData(context.Background(), tx, teams...)
		})
	}
	if err != nil && prepErr == nil && len(batch) > 1 {
		for _, ci := range batch {
			s.CommitInserts(w, nil, []CommandInsert{ci})
		}
		return
	}
	for _, ci := range batch {
		ci.Done <- err
	}
}

// commandWriter holds insertLoop's statements, parsed once: parsing them
// for each command took a fifth of the CPU at a few thousand a second.
type commandWriter struct {
	insert, trim, audit *sql.Stmt
}

func (s *Store) PrepareCommandWriter() (*commandWriter, error) {
	ctx := context.Background()
	w := &commandWriter{}
	var err error
	w.insert, err = s.writer.PrepareContext(ctx, `INSERT INTO commands
		(id, device_id, kind, button_id, payload, state, created_at, updated_at, deadline, sent_by, team_id)
		VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, (SELECT team_id FROM devices WHERE id = ?2)) RETURNING team_id`)
	if err != nil {
		return w, fmt.Errorf("prepare command insert: %w", err)
	}
	w.trim, err = s.writer.PrepareContext(ctx, `DELETE FROM commands WHERE device_id = ?1 AND seq <=
		(SELECT seq FROM commands WHERE device_id = ?1 ORDER BY seq DESC LIMIT 1 OFFSET ?2)
		AND NOT `+keptForRollout)
	if err != nil {
		return w, fmt.Errorf("prepare command trim: %w", err)
	}
	if w.audit, err = s.writer.PrepareContext(ctx, auditInsertSQL); err != nil {
		return w, fmt.Errorf("prepare audit insert: %w", err)
	}
	return w, nil
}

func (w *commandWriter) Close() {
	for _, st := range []*sql.Stmt{w.insert, w.trim, w.audit} {
		if st != nil {
			st.Close()
		}
	}
}

// write inserts a batch's commands in tx, then deletes
// each of their devices' commands past the newest KeepCommands. It
// returns the teams whose commands it inserted.
func (w *commandWriter) write(tx *sql.Tx, batch []CommandInsert) ([]int64, error) {
	ctx := context.Background()
	insert, trim := tx.StmtContext(ctx, w.insert), tx.StmtContext(ctx, w.trim)
	devices, teams := map[int64]bool{}, map[int64]bool{}
	for _, ci := range batch {
		c := ci.C
		if c == nil {
			continue
		}
		var sentBy *int64
		if c.SentBy != nil {
			sentBy = &c.SentBy.ID
		}
		var teamID int64
		err := insert.QueryRowContext(ctx, c.ID, ci.Device.id, c.Kind, c.ButtonID, string(c.Payload), c.State,
			c.CreatedAt, c.UpdatedAt, ci.Deadline, sentBy).Scan(&teamID)
		if err != nil {
			return nil, fmt.Errorf("insert command: %w", err)
		}
		devices[ci.Device.id], teams[teamID] = true, true
	}
	for id := range devices {
		if _, err := trim.ExecContext(ctx, id, KeepCommands); err != nil {
			return nil, err
		}
	}
	return slices.Collect(maps.Keys(teams)), nil
}

// DeleteCommand removes the device's command that was never published,
// and its audit entry (nil: none).
func (s *Store) DeleteCommand(ctx context.Context, d *DeviceRef, id string, audit *model.AuditEntry) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `DELETE FROM commands WHERE device_id = ? AND id = ?`, d.id, id); err != nil || audit == nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `DELETE FROM audit WHERE team_id = ? AND number = ?`, audit.TeamID, audit.ID)
		return err
	})
}

const commandColumns = `id, kind, button_id, payload, state, progress, result, error, created_at, updated_at, finished_at,
	sent_by, (SELECT name FROM users WHERE users.id = commands.sent_by)`

func scanCommand(row scanner) (*model.Command, error) {
	c := &model.Command{}
	var payload string
	var result, senderName *string
	var sender *int64
	err := row.Scan(&c.ID, &c.Kind, &c.ButtonID, &payload, &c.State, &c.Progress, &result, &c.Error,
		&c.CreatedAt, &c.UpdatedAt, &c.FinishedAt, &sender, &senderName)
	if err != nil {
		return nil, notFound(err, ErrCommandNotFound)
	}
	if sender != nil && senderName != nil {
		c.SentBy = &model.ActorRef{ID: *sender, Name: *senderName}
	}
	c.Payload = json.RawMessage(payload)
	if result != nil {
		c.Result = json.RawMessage(*result)
	}
	return c, nil
}

// CommandOf returns the device's command with that id, or ErrCommandNotFound.
func (s *Store) CommandOf(ctx context.Context, d *DeviceRef, id string) (*model.Command, error) {
	return scanCommand(s.reader.QueryRowContext(ctx,
		`SELECT `+commandColumns+` FROM commands WHERE device_id = ? AND id = ?`, d.id, id))
}

// CommandsOf lists up to limit of the device's commands, newest first;
// with before, those older than that command (ErrCommandNotFound when the
// device has no such command).
func (s *Store) CommandsOf(ctx context.Context, d *DeviceRef, limit int, before string) ([]*model.Command, error) {
	maxSeq := int64(math.MaxInt64)
	if before != "" {
		err := s.reader.QueryRowContext(ctx, `SELECT seq FROM commands WHERE device_id = ? AND id = ?`,
			d.id, before).Scan(&maxSeq)
		if err != nil {
			return nil, notFound(err, ErrCommandNotFound)
		}
	}
	return queryAll(ctx, s.reader, scanCommand, `SELECT `+commandColumns+` FROM commands
		WHERE device_id = ? AND seq < ? ORDER BY seq DESC LIMIT ?`, d.id, maxSeq, limit)
}

// ExpireCommands ends every unfinished command whose deadline is not
// after now as timed_out, at now, and returns their ids.
func (s *Store) ExpireCommands(ctx context.Context, now time.Time) ([]string, error) {
	ids, err := queryAll(ctx, s.writer, scanString, `UPDATE commands SET state = `+sqlString(model.CommandTimedOut)+`, updated_at = ?1, finished_at = ?1
		WHERE finished_at IS NULL AND deadline <= ?1 RETURNING id`, now.UTC().Format(TimeFormat))
	if len(ids) > 0 {
		s.commandEnds.broadcast()
	}
	return ids, err
}

// MarkSilentOffline sets every online or reconnecting device that has sent
// nothing since cutoff offline, and returns them as it left them.
// Their presence (with history kept) turns offline then.
func (s *Store) MarkSilentOffline(ctx context.Context, cutoff time.Time) ([]DeviceChange, error) {
	var changed []DeviceChange
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		changed, err = queryAll(ctx, tx, func(row scanner) (DeviceChange, error) {
			c := DeviceChange{StatusChanged: true}
			return c, row.Scan(&c.DeviceID, &c.TeamID, &c.UID, &c.Status, &c.LastSeenAt, &c.LastRSSI)
		}, `UPDATE devices SET status = `+sqlString(model.StatusOffline)+`
			WHERE status IN `+SQLIn(model.StatusOnline, model.StatusReconnecting)+` AND COALESCE(last_seen_at, '') < ?
			RETURNING id, team_id, uid, status, last_seen_at, last_rssi`, cutoff.UTC().Format(TimeFormat))
		if err != nil || s.limits.HistoryDays == 0 {
			return err
		}
		return history.RecordPresence(ctx, tx, s.Now(), historyChanges(changed))
	})
	return changed, err
}

// newestOTA returns the device's newest ota command, or nil when it has
// none.
func newestOTA(ctx context.Context, q queryer, deviceID int64) (*model.Command, error) {
	c, err := scanCommand(q.QueryRowContext(ctx, `SELECT `+commandColumns+` FROM commands
		WHERE device_id = ? AND kind = `+sqlString(model.KindOTA)+` ORDER BY seq DESC LIMIT 1`, deviceID))
	if errors.Is(err, ErrCommandNotFound) {
		return nil, nil
	}
	return c, err
}

// unfinishedOTAID returns the id of the newest unfinished ota command for
// that md5 of the device with that uid; "" when there is none (a link
// fetched again after its command ended, or by hand).
func (s *Store) UnfinishedOTAID(ctx context.Context, uid, md5sum string) (string, error) {
	var id string
	err := s.reader.QueryRowContext(ctx, `SELECT c.id FROM commands c JOIN devices d ON d.id = c.device_id
		WHERE d.uid = ? AND c.kind = `+sqlString(model.KindOTA)+` AND c.finished_at IS NULL AND json_extract(c.payload, '$.md5') = ?
		ORDER BY c.seq DESC LIMIT 1`, uid, md5sum).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return id, err
}

// SetOTAProgress makes ota commands running with the progress of their
// downloads (by command id), in one transaction; a command that has ended
// meanwhile keeps its end. It returns the commands it changed.
func (s *Store) SetOTAProgress(ctx context.Context, progress map[string]int64) ([]string, error) {
	var changed []string
	now := s.Timestamp()
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		update, err := tx.PrepareContext(ctx, `UPDATE commands SET state = `+sqlString(model.CommandRunning)+`, progress = ?1, updated_at = ?2
			WHERE id = ?3 AND finished_at IS NULL`)
		if err != nil {
			return err
		}
		defer update.Close()
		for id, p := range progress {
			res, err := update.ExecContext(ctx, p, now, id)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n > 0 {
				changed = append(changed, id)
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(changed) > 0 {
		s.commandEnds.broadcast()
	}
	return changed, nil
}

// teamDataSlack is how far under -max-team-data-mib keepTeamData takes a
// team, as a part of the limit (1/64: 1 MiB of the default 64), so that a
// team at its limit is trimmed once per MiB of new commands, not for each
// batch. A trim costs what it deletes, about 17 µs a command: 1 MiB of
// the smallest commands (180 bytes) holds the writer for about 100 ms.
const teamDataSlack = 64

// keepTeamData deletes, in tx, the oldest finished commands of each team
// whose JSON (its buttons' payloads, its commands' payloads and results)
// is past -max-team-data-mib, down to teamDataSlack under it: a team's
// history makes room, and a new command is never refused for it. A team
// under its limit costs one row read.
func (s *Store) keepTeamData(ctx context.Context, tx *sql.Tx, teamIDs ...int64) error {
	max := int64(s.limits.TeamDataMiB) << 20
	if max == 0 {
		return nil
	}
	for _, id := range slices.Compact(slices.Sorted(slices.Values(teamIDs))) { // a batch names a team once per result
		var used int64
		err := tx.QueryRowContext(ctx, `SELECT button_bytes + command_bytes FROM teams WHERE id = ?`, id).Scan(&used)
		if errors.Is(err, sql.ErrNoRows) || err == nil && used <= max {
			continue
		}
		if err != nil {
			return err
		}
		if err := trimTeamCommands(ctx, tx, id, used-max+max/teamDataSlack); err != nil {
			return fmt.Errorf("trim the team's commands: %w", err)
		}
	}
	return nil
}

// keptForRollout is true of a command that a rollout's running device
// waits on: without it the rollout would take the command for one never
// sent, and send another. The writer's trim keeps them too.
var keptForRollout = `EXISTS (SELECT 1 FROM rollout_devices rd WHERE rd.device_id = commands.device_id
	AND rd.command_id = commands.id AND rd.state = ` + sqlString(model.RdRunning) + `)`

// trimTeamCommands deletes the team's oldest finished commands, but those
// a rollout waits on, until need bytes are freed. It reads them oldest
// first along commands_team_finished and stops there, so that it costs
// what it deletes, not the team's whole history.
func trimTeamCommands(ctx context.Context, tx *sql.Tx, teamID, need int64) error {
	rows, err := tx.QueryContext(ctx, `SELECT seq, octet_length(payload) + coalesce(octet_length(result), 0) FROM commands
		WHERE team_id = ? AND finished_at IS NOT NULL AND NOT `+keptForRollout+` ORDER BY seq`, teamID)
	if err != nil {
		return err
	}
	var last int64
	for need > 0 && rows.Next() {
		var size int64
		if err := rows.Scan(&last, &size); err != nil {
			rows.Close()
			return err
		}
		need -= size
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, `DELETE FROM commands WHERE team_id = ? AND finished_at IS NOT NULL AND seq <= ?
		AND NOT `+keptForRollout, teamID, last)
	return err
}
