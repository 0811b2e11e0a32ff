package store

import (
	"context"
	"devicehub/internal/model"
)

// What the event stream (events.go) reads.

// commandEvent returns what command.state tells of the command with that
// id as it stands (its id, kind and state, not its payload or result),
// with its device's uid and team, in one read; ErrCommandNotFound when it
// is gone.
func (s *Store) CommandEvent(ctx context.Context, id string) (teamID int64, uid string, c *model.Command, err error) {
	c = &model.Command{}
	err = s.reader.QueryRowContext(ctx, `SELECT d.team_id, d.uid, c.id, c.kind, c.state
		FROM commands c JOIN devices d ON d.id = c.device_id WHERE c.id = ?`, id).
		Scan(&teamID, &uid, &c.ID, &c.Kind, &c.State)
	return teamID, uid, c, notFound(err, ErrCommandNotFound)
}
