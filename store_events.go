package main

import "context"

// What the event stream (events.go) reads.

// commandEvent returns the command with that id as it stands, with its
// device's uid and owner, in one read; errCommandNotFound when it is gone.
func (s *store) commandEvent(ctx context.Context, id string) (teamID int64, uid string, c *command, err error) {
	row := s.reader.QueryRowContext(ctx, `SELECT (SELECT team_id FROM devices WHERE id = commands.device_id),
		(SELECT uid FROM devices WHERE id = commands.device_id), `+commandColumns+` FROM commands WHERE id = ?`, id)
	c, err = scanCommand(withLeading{row, []any{&teamID, &uid}})
	return teamID, uid, c, err
}

// withLeading scans the columns before a row's usual ones into dest.
type withLeading struct {
	scanner
	dest []any
}

func (w withLeading) Scan(dest ...any) error { return w.scanner.Scan(append(w.dest, dest...)...) }
