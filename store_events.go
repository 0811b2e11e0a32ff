package main

import "context"

// What the event stream (events.go) reads.

// commandEvent returns the command with that id as it stands, with its
// device's uid and owner; errCommandNotFound when it is gone.
func (s *store) commandEvent(ctx context.Context, id string) (owner int64, uid string, c *command, err error) {
	var deviceID int64
	err = s.reader.QueryRowContext(ctx, `SELECT d.owner_id, d.uid, d.id FROM commands c
		JOIN devices d ON d.id = c.device_id WHERE c.id = ?`, id).Scan(&owner, &uid, &deviceID)
	if err != nil {
		return 0, "", nil, notFound(err, errCommandNotFound)
	}
	c, err = s.commandOf(ctx, deviceID, id)
	return owner, uid, c, err
}
