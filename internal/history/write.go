package history

// Writing a flush's history, inside the store's transaction: samples into
// buckets, boots, firmware runs, presence.

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"slices"
	"strconv"
	"strings"
	"time"
)

const (
	// MaxBoots bounds the boots kept per device, the newest.
	MaxBoots = 1000
	// MaxRuns bounds the firmware runs kept per device, the newest.
	MaxRuns = 100
	// MaxPresence bounds the presence intervals kept per device, the
	// newest, as of each retention pass.
	MaxPresence = 2000
	// presenceSettle: a presence change less than this after the
	// device's current interval began changes that interval instead of
	// opening another, so that a device that flaps costs a row a minute
	// at most.
	presenceSettle = 60
)

// Queryer is what a read runs on: the store's reader, its writer or a
// transaction.
type Queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// writeStmts are the statements that write a device's boots and runs.
var writeStmts = [...]string{
	// boot: a boot unless it resends one (Boot.Resends: the same reason,
	// uptime_s and boot_count, so a boot time as far off as the arrivals);
	// without an md5 of its own it is charged to the one the device ran.
	`INSERT INTO boots (device_id, number, at, reason, crash, uptime_s, boot_count, fw_md5, fw_version)
		SELECT id, (SELECT coalesce(max(number), 0) + 1 FROM boots WHERE device_id = ?1), ?2, ?3, ?4, ?5, ?6,
			COALESCE(?7, current_md5), CASE WHEN ?7 IS NULL THEN current_version ELSE ?8 END
		FROM devices WHERE id = ?1 AND NOT EXISTS (SELECT 1 FROM boots b
			WHERE b.device_id = ?1 AND b.reason = ?3 AND b.uptime_s IS ?5 AND b.boot_count IS ?6
			AND b.at > ?2 - ?9 AND b.at < ?2 + ?9)
		RETURNING COALESCE(fw_md5, '')`,
	// bootHour: the boot counted in the hours of its team and firmware.
	`INSERT INTO fleet_hours (team_id, md5, hour, boots, crashes) VALUES (?1, ?2, ?3 - ?3 % 3600, 1, ?4)
		ON CONFLICT (team_id, md5, hour) DO UPDATE SET boots = boots + 1, crashes = crashes + excluded.crashes`,
	// bootCap: keeps the newest MaxBoots.
	`DELETE FROM boots WHERE device_id = ?1 AND id <= (SELECT id FROM boots WHERE device_id = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)`,
	// runEnd, runStart: the device reports another md5.
	`UPDATE firmware_runs SET to_at = ?2 WHERE device_id = ?1 AND to_at IS NULL`,
	`INSERT INTO firmware_runs (device_id, md5, version, from_at) VALUES (?1, ?2, ?3, ?4)`,
	// runCap: keeps the newest MaxRuns.
	`DELETE FROM firmware_runs WHERE device_id = ?1 AND id <= (SELECT id FROM firmware_runs WHERE device_id = ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2)`,
}

const (
	stmtBoot = iota
	stmtBootHour
	stmtBootCap
	stmtRunEnd
	stmtRunStart
	stmtRunCap
)

// Flush writes the history of one flush's reports in the caller's
// transaction, each statement prepared once: Begin, Add for each
// device's report, Finish, and Done once the transaction has ended.
type Flush struct {
	tx     *sql.Tx
	stmts  [len(writeStmts)]*sql.Stmt // prepared when first used (stmt)
	engine *Engine                    // nil: no samples kept
	taken  int                        // the closed buckets Finish wrote
}

// Begin begins a flush on tx. With engine nil no samples are kept (boots
// and firmware runs are written all the same: a rollout's health gate
// needs them). Close it when the flush is done.
func Begin(tx *sql.Tx, engine *Engine) *Flush { return &Flush{tx: tx, engine: engine} }

// stmt is writeStmts[i], prepared on the flush's transaction when first
// used: most flushes record no boot and no firmware run, and preparing
// them all for each cost more than the telemetry's own statements.
func (f *Flush) stmt(ctx context.Context, i int) (*sql.Stmt, error) {
	if f.stmts[i] == nil {
		s, err := f.tx.PrepareContext(ctx, writeStmts[i])
		if err != nil {
			return nil, err
		}
		f.stmts[i] = s
	}
	return f.stmts[i], nil
}

// Close releases the flush's statements.
func (f *Flush) Close() {
	for _, s := range f.stmts {
		if s != nil {
			s.Close()
		}
	}
}

// Report is what one device's report brings to its history.
type Report struct {
	DeviceID, TeamID int64
	Firmware         string // the md5 the device runs after this report, "" for none
	Seen             time.Time
	// NewFirmware: the device reports an md5 other than the one it ran
	// (MD5, Version), which begins a firmware run.
	NewFirmware  bool
	MD5, Version *string
	Samples      []Sample
	Boots        []Boot
}

// Add writes report r: a new firmware run and its boots (but resends),
// and adds its samples to the device's open bucket. It returns the boots
// it recorded, and how many samples were left out for want of room for
// another series.
func (f *Flush) Add(ctx context.Context, r *Report) (recorded []Boot, unkept int, err error) {
	seen := r.Seen.Unix()
	if r.NewFirmware && r.MD5 != nil {
		if err := f.exec(ctx, stmtRunEnd, r.DeviceID, seen); err != nil {
			return nil, 0, err
		}
		if err := f.exec(ctx, stmtRunStart, r.DeviceID, *r.MD5, r.Version, seen); err != nil {
			return nil, 0, err
		}
		if err := f.exec(ctx, stmtRunCap, r.DeviceID, MaxRuns); err != nil {
			return nil, 0, err
		}
	}
	for _, b := range r.Boots {
		boot, err := f.stmt(ctx, stmtBoot)
		if err != nil {
			return nil, 0, err
		}
		var md5 string
		err = boot.QueryRowContext(ctx, r.DeviceID, b.At().Unix(), b.Reason, b.Crash(), b.UptimeS, b.BootCount,
			b.FWMD5, b.FWVersion, int64(ResendWindow/time.Second)).Scan(&md5)
		if errors.Is(err, sql.ErrNoRows) {
			continue // the same boot, told again
		}
		if err != nil {
			return nil, 0, err
		}
		if err := f.exec(ctx, stmtBootHour, r.TeamID, md5, b.At().Unix(), b.Crash()); err != nil {
			return nil, 0, err
		}
		if err := f.exec(ctx, stmtBootCap, r.DeviceID, MaxBoots); err != nil {
			return nil, 0, err
		}
		recorded = append(recorded, b)
	}
	if f.engine == nil {
		return recorded, 0, nil
	}
	return recorded, f.engine.fold(r), nil
}

func (f *Flush) exec(ctx context.Context, i int, args ...any) error {
	s, err := f.stmt(ctx, i)
	if err == nil {
		_, err = s.ExecContext(ctx, args...)
	}
	return err
}

// Finish writes the buckets that have closed by now (at most
// closePerFlush), each device's alone (Engine.writeClosed): it returns
// the samples left out for want of room for another series in their
// rows, and the writes the database refused.
func (f *Flush) Finish(ctx context.Context, now time.Time) (unkept int, failed []error, err error) {
	if f.engine == nil {
		return 0, nil, nil
	}
	f.taken, unkept, failed, err = f.engine.writeClosed(ctx, f.tx, now)
	return unkept, failed, err
}

// Done tells the flush its transaction ended: committed, the buckets
// Finish wrote leave memory; otherwise they stay, for the next flush.
func (f *Flush) Done(committed bool) {
	if f.engine != nil && committed {
		f.engine.writtenOut(f.taken)
	}
}

// Change is a device's presence as a flush left it.
type Change struct {
	DeviceID int64
	Online   bool
	// First: the device's first status since it was added, so that it
	// has no interval yet: its first opens without a search for another.
	First bool
}

// presenceChunk is how many devices one round of presence statements
// takes: a restart brings a million.
const presenceChunk = 1000

// presenceStmts record a chunk of changes r(d, o) (device id, online) at
// :now, in order: a change soon after the current interval began changes
// its status (presenceSettle); else the current interval ends and another
// begins. The updates name presence_device: left to itself the planner
// may walk every open interval and the chunk for each, which made a
// restart's statuses quadratic (TestPresencePlan).
var presenceStmts = []string{
	`UPDATE presence INDEXED BY presence_device SET online = r.o FROM r
		WHERE presence.device_id = r.d AND presence.to_at IS NULL AND presence.online IS NOT r.o
		AND presence.from_at > :now - ` + strconv.Itoa(presenceSettle),
	`UPDATE presence INDEXED BY presence_device SET to_at = :now FROM r
		WHERE presence.device_id = r.d AND presence.to_at IS NULL AND presence.online IS NOT r.o`,
	`INSERT INTO presence (device_id, online, from_at)
		SELECT r.d, r.o, :now FROM r
		WHERE NOT EXISTS (SELECT 1 FROM presence p WHERE p.device_id = r.d AND p.to_at IS NULL)`,
}

// firstPresenceStmts record a chunk of devices' first changes: each
// opens the device's first interval.
var firstPresenceStmts = []string{
	`INSERT INTO presence (device_id, online, from_at) SELECT r.d, r.o, :now FROM r`,
}

// offlineStmt counts the offline intervals that began in the chunk in
// their hour's fleet_hours; it runs only for a chunk with an offline
// change.
const offlineStmt = `INSERT INTO fleet_hours (team_id, md5, hour, offline)
	SELECT d.team_id, COALESCE(d.current_md5, ''), :now - :now % 3600, count(*) FROM r JOIN devices d ON d.id = r.d
	JOIN presence p ON p.device_id = r.d AND p.to_at IS NULL AND p.from_at = :now AND NOT p.online
	WHERE true GROUP BY d.team_id, d.current_md5
	ON CONFLICT (team_id, md5, hour) DO UPDATE SET offline = offline + excluded.offline`

// RecordPresence writes the presence changes of a flush, at now, a chunk
// of devices at a time, in the order of their ids: a restart's first
// statuses, a million of them, each insert an interval and nothing more.
func RecordPresence(ctx context.Context, tx *sql.Tx, now time.Time, changes []Change) error {
	var first, known []Change
	for _, c := range changes {
		if c.First {
			first = append(first, c)
		} else {
			known = append(known, c)
		}
	}
	if err := recordChunks(ctx, tx, now, first, firstPresenceStmts); err != nil {
		return err
	}
	return recordChunks(ctx, tx, now, known, presenceStmts)
}

// recordChunks runs stmts, then offlineStmt where needed, on each chunk
// of changes. Each statement is prepared once for the chunks of a size:
// a chunk's VALUES took longer to parse than to run.
func recordChunks(ctx context.Context, tx *sql.Tx, now time.Time, changes []Change, stmts []string) error {
	slices.SortFunc(changes, func(a, b Change) int { return cmp.Compare(a.DeviceID, b.DeviceID) })
	type key struct{ rows, stmt int } // a chunk's size, a statement's place in run
	prepared := map[key]*sql.Stmt{}
	defer func() {
		for _, s := range prepared {
			s.Close()
		}
	}()
	for len(changes) > 0 {
		chunk := changes[:min(len(changes), presenceChunk)]
		changes = changes[len(chunk):]
		args := make([]any, 0, 2*len(chunk)+1)
		offline := false
		for _, c := range chunk {
			args = append(args, c.DeviceID, c.Online)
			offline = offline || !c.Online
		}
		args = append(args, sql.Named("now", now.Unix()))
		run := stmts
		if offline {
			run = append(slices.Clip(stmts), offlineStmt)
		}
		for i, q := range run {
			k := key{len(chunk), i}
			stmt := prepared[k]
			if stmt == nil {
				values := `WITH r(d, o) AS (VALUES (?, ?)` + strings.Repeat(`, (?, ?)`, len(chunk)-1) + `) `
				var err error
				if stmt, err = tx.PrepareContext(ctx, values+q); err != nil {
					return err
				}
				prepared[k] = stmt
			}
			if _, err := stmt.ExecContext(ctx, args...); err != nil {
				return err
			}
		}
	}
	return nil
}
