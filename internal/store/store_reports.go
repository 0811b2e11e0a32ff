package store

// The store's side of what devices say: reports (status, telemetry, OTA
// progress) and command results, written a batch at a time.

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"devicehub/internal/history"
	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
)

// Applied is what ApplyDeviceMessages did.
type Applied struct {
	Unknown  int                // reports that named no known device
	Rejected int                // results that matched no unfinished command of their device
	Results  int                // results written
	Devices  []DeviceChange     // the devices the reports changed, as they left them
	Commands []string           // the commands a result or a reported md5 changed
	Resend   []mqttlink.Command // unanswered ota commands of devices that reported a new boot
	Unkept   int                // samples left out: their device has maxSeries series
	Failed   []error            // reports and results that failed to write, each undone alone, naming its device
}

// DeviceChange is a device as a report left it, for the event stream.
type DeviceChange struct {
	DeviceID, TeamID int64
	model.DeviceStatusEvent
	StatusChanged, FirmwareChanged bool
	// FirstStatus: the device was pending, never heard from before.
	FirstStatus bool
	Boots       []BootEvent // the boots the report told of, recorded
}

// ApplyDeviceMessages writes what devices said since the last call in one
// transaction: the command results in the order they came, then the
// merged reports (an updater's progress comes before the md5 it reports
// once it has rebooted). Waiters are woken after a result, and after a
// reported md5, which may end an OTA.
//
// A device's report is its own: each result, each report and each chunk
// of statuses is written in a savepoint (alone), so that one the database
// refuses is undone and named in a.failed, and the rest of the batch,
// every other device's and team's, is written. Only an error of the
// transaction itself fails the batch.
func (s *Store) ApplyDeviceMessages(ctx context.Context, reports map[string]*mqttlink.Report, results []mqttlink.Result) (Applied, error) {
	now := s.Timestamp()
	var a Applied
	var hist *history.Flush // its Done needs to know whether the transaction committed
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var teams []int64             // whose JSON the results grew
		rejected := map[string]bool{} // devices with a result counted as rejected
		for _, r := range results {
			var teamID int64
			failed, err := alone(ctx, tx, func() (err error) {
				teamID, err = applyCommandResult(ctx, tx, r, now)
				return err
			})
			switch {
			case err != nil:
				return err
			case failed != nil:
				a.Failed = append(a.Failed, fmt.Errorf("result %s of device %s: %w", r.ID, r.UID, failed))
			case teamID == 0:
				a.Rejected++
				rejected[r.UID] = true
			default:
				a.Results++
				a.Commands = append(a.Commands, r.ID)
				teams = append(teams, teamID)
			}
		}
		if err := s.keepTeamData(ctx, tx, teams...); err != nil {
			return err
		}
		if len(reports) == 0 {
			return nil
		}
		stmts := newReportStmts(tx, s.keptHistory())
		defer stmts.close()
		hist = stmts.history
		var statuses []statusReport
		for uid, r := range reports {
			if r.LocalIP == nil && r.PublicIP == nil && r.RSSI == nil && r.FWMD5 == nil && r.FWVersion == nil &&
				len(r.History) == 0 && len(r.Boots) == 0 {
				counted := r.Status == nil && rejected[uid]
				statuses = append(statuses, statusReport{uid, r.Status, r.Seen.UTC().Format(TimeFormat), r.Live, counted})
				continue
			}
			var c *DeviceChange
			var ended []string
			var resend []mqttlink.Command
			var unkept int
			failed, err := alone(ctx, tx, func() (err error) {
				if c, ended, unkept, err = stmts.apply(ctx, uid, r); err != nil || c == nil || len(c.Boots) == 0 {
					return err
				}
				resend, err = stmts.unanswered(ctx, uid, r)
				return err
			})
			switch {
			case err != nil:
				return err
			case failed != nil:
				a.Failed = append(a.Failed, fmt.Errorf("report of device %s: %w", uid, failed))
			case c == nil:
				a.Unknown++
			default:
				a.Unkept += unkept
				a.Devices = append(a.Devices, *c)
				a.Commands = append(a.Commands, ended...)
				a.Resend = append(a.Resend, resend...)
			}
		}
		if err := applyStatuses(ctx, tx, statuses, &a); err != nil {
			return err
		}
		if s.limits.HistoryDays == 0 {
			return nil
		}
		unkept, failed, err := hist.Finish(ctx, s.Now())
		a.Unkept += unkept
		a.Failed = append(a.Failed, failed...)
		if err != nil {
			return err
		}
		return history.RecordPresence(ctx, tx, s.Now(), historyChanges(a.Devices))
	})
	if hist != nil {
		hist.Done(err == nil)
	}
	if err == nil && len(results)+len(a.Commands) > 0 {
		s.commandEnds.broadcast()
	}
	return a, err
}

// alone runs write in a savepoint of tx: when write fails, what it wrote
// is undone, the transaction goes on, and write's error is returned as
// failed. err is the transaction's own error, after which it cannot go
// on: the savepoint could not be made, or SQLite rolled the whole
// transaction back (a full disk, an I/O error), so that there is no
// savepoint to return to.
func alone(ctx context.Context, tx *sql.Tx, write func() error) (failed, err error) {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT alone`); err != nil {
		return nil, err
	}
	if failed = write(); failed != nil {
		if _, err := tx.ExecContext(ctx, `ROLLBACK TO alone`); err != nil {
			return nil, fmt.Errorf("%w (and then: %w)", failed, err)
		}
	}
	_, err = tx.ExecContext(ctx, `RELEASE alone`)
	return failed, err
}

// statusReport is a report with no telemetry: a status, or only a sign
// of life (a result). A restart's retained replay is a million of them.
// counted: its only message is a result counted as rejected, so that an
// unknown device does not count it again.
type statusReport struct {
	uid     string
	status  *string
	seen    string
	live    bool
	counted bool
}

// statusChunk is how many status reports one pair of statements writes.
const statusChunk = 1000

// applyStatuses applies status reports as reportStmts.apply would, a
// chunk at a time: two statements for a thousand devices instead of two
// for each, which is what lets a restart apply a million statuses in
// seconds. The reports are bound as parameters of a VALUES list: read
// from a JSON array, each field cost a parse of its element. A retained
// status that changes nothing (a restart's usual case) writes nothing.
// It adds the devices it changed to a, and counts unknown uids.
func applyStatuses(ctx context.Context, tx *sql.Tx, reports []statusReport, a *Applied) error {
	for len(reports) > 0 {
		chunk := reports[:min(len(reports), statusChunk)]
		reports = reports[len(chunk):]
		if err := applyStatusChunk(ctx, tx, chunk, a); err != nil {
			return err
		}
	}
	return nil
}

// applyStatusChunk writes a chunk of status reports alone. A chunk that
// fails is written again a report at a time, each alone, so that only a
// report the database refuses is left out (named in a.failed).
func applyStatusChunk(ctx context.Context, tx *sql.Tx, chunk []statusReport, a *Applied) error {
	devices, unknown := len(a.Devices), a.Unknown
	failed, err := alone(ctx, tx, func() error { return writeStatuses(ctx, tx, chunk, a) })
	if err != nil || failed == nil {
		return err
	}
	a.Devices, a.Unknown = a.Devices[:devices], unknown
	if len(chunk) == 1 {
		a.Failed = append(a.Failed, fmt.Errorf("status of device %s: %w", chunk[0].uid, failed))
		return nil
	}
	for i := range chunk {
		if err := applyStatusChunk(ctx, tx, chunk[i:i+1], a); err != nil {
			return err
		}
	}
	return nil
}

// writeStatuses writes a chunk of status reports in two statements.
func writeStatuses(ctx context.Context, tx *sql.Tx, chunk []statusReport, a *Applied) error {
	uids := make([]any, len(chunk))
	rows := make([]any, 0, 4*len(chunk))
	for i, r := range chunk {
		uids[i] = r.uid
		rows = append(rows, r.uid, r.status, r.seen, r.live)
	}
	before := map[string]DeviceChange{} // owner and status before, by uid
	_, err := queryAll(ctx, tx, func(row scanner) (struct{}, error) {
		var c DeviceChange
		err := row.Scan(&c.UID, &c.DeviceID, &c.TeamID, &c.Status)
		c.FirstStatus = c.Status == model.StatusPending
		before[c.UID] = c
		return struct{}{}, err
	}, `SELECT uid, id, team_id, status FROM devices WHERE uid IN (?`+strings.Repeat(`, ?`, len(chunk)-1)+`)`, uids...)
	if err != nil {
		return err
	}
	if len(before) < len(chunk) { // a restart's chunk has none unknown: no need to look
		for _, r := range chunk {
			if _, known := before[r.uid]; !known && !r.counted {
				a.Unknown++
			}
		}
	}
	_, err = queryAll(ctx, tx, func(row scanner) (struct{}, error) {
		var n DeviceChange
		err := row.Scan(&n.UID, &n.Status, &n.LastSeenAt, &n.LastRSSI)
		c := before[n.UID]
		c.StatusChanged = n.Status != c.Status
		c.DeviceStatusEvent = n.DeviceStatusEvent
		a.Devices = append(a.Devices, c)
		return struct{}{}, err
	}, `WITH r(u, s, t, l) AS (VALUES (?, ?, ?, ?)`+strings.Repeat(`, (?, ?, ?, ?)`, len(chunk)-1)+`)
		UPDATE devices SET status = COALESCE(r.s, status), first_seen_at = COALESCE(first_seen_at, r.t),
		last_seen_at = CASE WHEN r.l THEN r.t ELSE COALESCE(last_seen_at, r.t) END
		FROM r WHERE devices.uid = r.u
		AND (r.l OR status IS NOT COALESCE(r.s, status) OR first_seen_at IS NULL OR last_seen_at IS NULL)
		RETURNING uid, status, last_seen_at, last_rssi`, rows...)
	return err
}

// reportStmts are the statements that apply a report, each prepared
// once per batch when first used (prepared): parsing them for each report
// cost more than running them, and most batches end no ota command.
type reportStmts struct {
	tx                              *sql.Tx
	before, update, otaEnd, otaSent *sql.Stmt
	history                         *history.Flush
}

// beforeQuery reads a device as a report finds it; updateQuery applies
// the report; otaEndQuery ends a device's unfinished ota commands for an
// md5 as succeeded; otaSentQuery lists those sent and still unanswered.
var (
	beforeQuery = `SELECT id, team_id, status, COALESCE(current_md5, ''), EXISTS (SELECT 1 FROM commands c
		WHERE c.device_id = devices.id AND c.kind = ` + sqlString(model.KindOTA) + ` AND c.finished_at IS NULL) FROM devices WHERE uid = ?`
	updateQuery = `UPDATE devices SET
		status = COALESCE(?1, status),
		first_seen_at = COALESCE(first_seen_at, ?2),
		last_seen_at = CASE WHEN ?3 THEN ?2 ELSE COALESCE(last_seen_at, ?2) END,
		local_ip = COALESCE(?4, local_ip),
		public_ip = COALESCE(?5, public_ip),
		last_rssi = COALESCE(?6, last_rssi),
		last_ota_at = CASE WHEN ?7 IS NOT NULL AND (
			(?7 IS NOT current_md5 AND ?7 = (SELECT md5 FROM firmwares WHERE id = target_firmware_id))
			OR (?10 AND EXISTS (SELECT 1 FROM commands c WHERE c.device_id = devices.id AND c.kind = ` + sqlString(model.KindOTA) + `
				AND c.finished_at IS NULL AND json_extract(c.payload, '$.md5') = ?7
				AND (c.state = ` + sqlString(model.CommandRunning) + ` OR ?7 IS NOT current_md5))))
			THEN ?2 ELSE last_ota_at END,
		current_md5 = COALESCE(?7, current_md5),
		current_version = CASE WHEN ?7 IS NOT NULL THEN ?8 ELSE COALESCE(?8, current_version) END
		WHERE uid = ?9 RETURNING status, last_seen_at, last_rssi, COALESCE(current_md5, '')`
	otaEndQuery = `UPDATE commands SET state = ` + sqlString(model.CommandSucceeded) + `, updated_at = ?1, finished_at = ?1
		WHERE finished_at IS NULL AND kind = ` + sqlString(model.KindOTA) + ` AND json_extract(payload, '$.md5') = ?2
		AND device_id = (SELECT id FROM devices WHERE uid = ?3) RETURNING id`
	otaSentQuery = `SELECT id, payload FROM commands WHERE finished_at IS NULL AND kind = ` + sqlString(model.KindOTA) + `
		AND state = ` + sqlString(model.CommandSent) + ` AND created_at <= ?1
		AND device_id = (SELECT id FROM devices WHERE uid = ?2) ORDER BY seq`
)

// newReportStmts begins a batch's statements on tx; with engine nil no
// samples are kept (-history-days 0).
func newReportStmts(tx *sql.Tx, engine *history.Engine) *reportStmts {
	return &reportStmts{tx: tx, history: history.Begin(tx, engine)}
}

// prepared is *stmt, prepared from query on the batch's transaction the
// first time it is asked for.
func (st *reportStmts) prepared(ctx context.Context, stmt **sql.Stmt, query string) (*sql.Stmt, error) {
	if *stmt == nil {
		s, err := st.tx.PrepareContext(ctx, query)
		if err != nil {
			return nil, err
		}
		*stmt = s
	}
	return *stmt, nil
}

func (st *reportStmts) close() {
	for _, s := range []*sql.Stmt{st.before, st.update, st.otaEnd, st.otaSent} {
		if s != nil {
			s.Close()
		}
	}
	if st.history != nil {
		st.history.Close()
	}
}

// apply applies one merged report and returns the device as it left it
// (nil when no device has that uid) and the ota commands it ended. A
// retained replay (not live) fills the seen times only where they are
// empty. A reported md5 ends the device's unfinished ota commands for that
// md5 as succeeded. last_ota_at is set when the report ends
// such a command after a flash: its image was downloaded (running), or the
// md5 differs from the one the device ran; so also when the target was
// changed since the command was sent. It is set too, as before commands
// existed, when the reported md5 changes to the target's. The report's
// history is written too (addHistory), which returns the samples left out.
func (st *reportStmts) apply(ctx context.Context, uid string, r *mqttlink.Report) (*DeviceChange, []string, int, error) {
	c := &DeviceChange{}
	var oldStatus model.DeviceStatus
	var oldMD5, newMD5 string
	var otaOpen bool // the device has an unfinished ota command: only then is one ended
	before, err := st.prepared(ctx, &st.before, beforeQuery)
	if err != nil {
		return nil, nil, 0, err
	}
	err = before.QueryRowContext(ctx, uid).Scan(&c.DeviceID, &c.TeamID, &oldStatus, &oldMD5, &otaOpen)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil, 0, nil
	}
	if err != nil {
		return nil, nil, 0, err
	}
	seen := r.Seen.UTC().Format(TimeFormat)
	update, err := st.prepared(ctx, &st.update, updateQuery)
	if err != nil {
		return nil, nil, 0, err
	}
	err = update.QueryRowContext(ctx, r.Status, seen, r.Live, r.LocalIP, r.PublicIP, r.RSSI, r.FWMD5, r.FWVersion, uid, otaOpen).
		Scan(&c.Status, &c.LastSeenAt, &c.LastRSSI, &newMD5)
	if err != nil {
		return nil, nil, 0, err
	}
	c.UID, c.StatusChanged, c.FirmwareChanged = uid, c.Status != oldStatus, newMD5 != oldMD5
	c.FirstStatus = oldStatus == model.StatusPending
	var ended []string
	if otaOpen {
		if ended, err = st.endOTAs(ctx, seen, r.FWMD5, uid); err != nil {
			return nil, nil, 0, err
		}
	}
	// The history last: its samples join the device's bucket in memory
	// once its statements are written, so that nothing a refused report
	// brought stays there when its savepoint is undone (alone).
	unkept, err := st.addHistory(ctx, newMD5, r, c)
	return c, ended, unkept, err
}

// endOTAs ends the device's unfinished ota commands for md5, the one it
// reports (nil: none), as succeeded, and returns them.
func (st *reportStmts) endOTAs(ctx context.Context, seen string, md5 *string, uid string) ([]string, error) {
	if md5 == nil {
		return nil, nil
	}
	otaEnd, err := st.prepared(ctx, &st.otaEnd, otaEndQuery)
	if err != nil {
		return nil, err
	}
	rows, err := otaEnd.QueryContext(ctx, seen, *md5, uid)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ended []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		ended = append(ended, id)
	}
	return ended, rows.Err()
}

// addHistory hands report r of device c, which runs md5 ("" for none)
// after it, to its history, and adds the boots it recorded to c; it
// returns how many samples were left out for want of room for another
// series.
func (st *reportStmts) addHistory(ctx context.Context, md5 string, r *mqttlink.Report, c *DeviceChange) (int, error) {
	boots, unkept, err := st.history.Add(ctx, &history.Report{DeviceID: c.DeviceID, TeamID: c.TeamID, Firmware: md5, Seen: r.Seen,
		NewFirmware: c.FirmwareChanged, MD5: r.FWMD5, Version: r.FWVersion, Samples: r.History, Boots: r.Boots})
	for _, b := range boots {
		c.Boots = append(c.Boots, BootEvent{c.UID, b.Reason, b.Crash(), b.At().UTC().Format(time.RFC3339)})
	}
	return unkept, err
}

// unanswered are device uid's ota commands still sent (neither answered
// nor downloaded), sent before report r: the report tells of a new boot
// (apply has ended the commands for the md5 it runs), so each may have been
// published while the device was resetting, to a clean session that no
// longer existed, and lost. They are sent again, with the same ids.
func (st *reportStmts) unanswered(ctx context.Context, uid string, r *mqttlink.Report) ([]mqttlink.Command, error) {
	otaSent, err := st.prepared(ctx, &st.otaSent, otaSentQuery)
	if err != nil {
		return nil, err
	}
	rows, err := otaSent.QueryContext(ctx, r.Seen.UTC().Format(TimeFormat), uid)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var sent []mqttlink.Command
	for rows.Next() {
		c := mqttlink.Command{UID: uid}
		if err := rows.Scan(&c.ID, &c.Payload); err != nil {
			return nil, err
		}
		sent = append(sent, c)
	}
	return sent, rows.Err()
}

// applyCommandResult applies one result to its command if the command is
// unfinished and belongs to the device that sent it; it returns the
// device's team, or 0 when no command changed.
func applyCommandResult(ctx context.Context, tx *sql.Tx, r mqttlink.Result, now string) (int64, error) {
	var result *string
	if r.Value != nil {
		v := string(r.Value)
		result = &v
	}
	var teamID int64
	err := tx.QueryRowContext(ctx, `UPDATE commands SET
		state = CASE WHEN ?1 IS NULL THEN `+sqlString(model.CommandRunning)+` WHEN ?1 THEN `+sqlString(model.CommandSucceeded)+` ELSE `+sqlString(model.CommandFailed)+` END,
		progress = COALESCE(?2, progress), result = ?3, error = ?4, updated_at = ?5,
		finished_at = CASE WHEN ?1 IS NULL THEN NULL ELSE ?5 END
		WHERE id = ?6 AND finished_at IS NULL AND device_id = (SELECT id FROM devices WHERE uid = ?7)
		RETURNING (SELECT team_id FROM devices WHERE id = device_id)`,
		r.OK, r.Progress, result, r.Error, now, r.ID, r.UID).Scan(&teamID)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	return teamID, err
}
