package store

// The store's administration: what the CLI's user, device, token and
// backup commands need (admin.go, backup.go).

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"fmt"
)

// ErrUserHasDevices refuses to delete the last member of a team that
// still owns devices.
var ErrUserHasDevices = errors.New("the user owns devices")

// ListedUser is a user as 'user list' shows them.
type ListedUser struct {
	model.User
	Team            string // the team's name
	CreatedAt       string
	Devices, Tokens int // how many their team and they have
}

// ListUsers returns every user, oldest first, with their team's name
// and number of devices, and how many tokens they have.
func (s *Store) ListUsers(ctx context.Context) ([]*ListedUser, error) {
	return queryAll(ctx, s.reader, func(row scanner) (*ListedUser, error) {
		u := &ListedUser{}
		return u, row.Scan(&u.ID, &u.Email, &u.Name, &u.Role, &u.Team, &u.CreatedAt, &u.LastLoginAt, &u.Devices, &u.Tokens)
	}, `SELECT u.id, u.email, u.name, u.role, t.name, u.created_at, u.last_login_at,
		(SELECT count(*) FROM devices WHERE team_id = u.team_id), (SELECT count(*) FROM tokens WHERE user_id = u.id)
		FROM users u JOIN teams t ON t.id = u.team_id ORDER BY u.id`)
}

// DeleteUser deletes the user with that email with their tokens. The
// last member of a team takes the team with them, its library and, when
// withDevices is set, its devices, and the firmware files no other row
// needs; the others leave the team's devices to it (devices is then 0).
// ErrUserHasDevices when the last member's team owns devices and
// withDevices is not set; ErrNeedsAdmin when the user is the last admin
// of a team with other members; ErrUserNotFound when there is no such user.
func (s *Store) DeleteUser(ctx context.Context, email string, withDevices bool) (devices int, files int, err error) {
	files, err = s.deleteWithFiles(ctx, func(tx *sql.Tx) ([]string, error) {
		var id, teamID int64
		var members, otherAdmins int
		var r model.Role
		err := tx.QueryRowContext(ctx, `SELECT id, team_id, role, (SELECT count(*) FROM users m WHERE m.team_id = users.team_id),
			(SELECT count(*) FROM users m WHERE m.team_id = users.team_id AND m.role = `+sqlString(model.RoleAdmin)+` AND m.id != users.id)
			FROM users WHERE email = ?`, NormalizeEmail(email)).Scan(&id, &teamID, &r, &members, &otherAdmins)
		if err != nil {
			return nil, notFound(err, ErrUserNotFound)
		}
		if members > 1 && r == model.RoleAdmin && otherAdmins == 0 {
			return nil, ErrNeedsAdmin
		}
		if members > 1 {
			_, err = tx.ExecContext(ctx, `DELETE FROM users WHERE id = ?`, id)
			return nil, err
		}
		if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM devices WHERE team_id = ?`, teamID).Scan(&devices); err != nil {
			return nil, err
		}
		if devices > 0 && !withDevices {
			return nil, ErrUserHasDevices
		}
		sums, err := queryAll(ctx, tx, scanString, `SELECT f.sha256 FROM firmwares f
			JOIN devices d ON d.id = f.device_id WHERE d.team_id = ?1
			UNION SELECT sha256 FROM library_firmwares WHERE team_id = ?1`, teamID)
		if err != nil {
			return nil, err
		}
		// Tokens go by ON DELETE CASCADE; devices with their firmware
		// rows and buttons, the library, rollouts and the audit log go
		// with the team.
		if _, err = tx.ExecContext(ctx, `DELETE FROM users WHERE id = ?`, id); err != nil {
			return nil, err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM teams WHERE id = ?`, teamID)
		return sums, err
	})
	return devices, files, err
}

// ListDevices returns the devices of the team of the user with email ownerEmail, or
// every device when it is empty, oldest first. ErrUserNotFound when
// there is no such user.
func (s *Store) ListDevices(ctx context.Context, ownerEmail string) ([]*model.DeviceSummary, error) {
	if ownerEmail != "" {
		if _, err := s.UserByEmail(ctx, ownerEmail); err != nil {
			return nil, err
		}
	}
	return queryAll(ctx, s.reader, func(row scanner) (*model.DeviceSummary, error) {
		d := &model.DeviceSummary{}
		dest, done := scanTargets(d)
		err := row.Scan(append(dest, &d.TeamName)...)
		done()
		return d, err
	}, `SELECT `+summaryColumns+`, t.name`+summaryFrom+` JOIN teams t ON t.id = d.team_id
		WHERE ?1 = '' OR d.team_id = (SELECT team_id FROM users WHERE email = ?1) ORDER BY d.id`, NormalizeEmail(ownerEmail))
}

// DeviceTeam returns the team of the device with that uid, or
// ErrDeviceNotFound.
func (s *Store) DeviceTeam(ctx context.Context, uid string) (int64, error) {
	var team int64
	err := s.reader.QueryRowContext(ctx, `SELECT team_id FROM devices WHERE uid = ?`, uid).Scan(&team)
	return team, notFound(err, ErrDeviceNotFound)
}

// DeviceUIDsAfter returns up to n device uids after that one, in order:
// a walk over every device, a page at a time.
func (s *Store) DeviceUIDsAfter(ctx context.Context, after string, n int) ([]string, error) {
	return queryAll(ctx, s.reader, scanString, `SELECT uid FROM devices WHERE uid > ? ORDER BY uid LIMIT ?`, after, n)
}

// DeleteDevice deletes the device, its firmware rows and buttons, and the
// firmware files that no other row needs; it returns how many files it
// removed. ErrDeviceNotFound when it is gone already. audit is made of
// its uid.
func (s *Store) DeleteDevice(ctx context.Context, d *DeviceRef, audit Audit[string]) (files int, err error) {
	return s.deleteWithFiles(ctx, func(tx *sql.Tx) ([]string, error) {
		sums, err := queryAll(ctx, tx, scanString, `SELECT DISTINCT sha256 FROM firmwares WHERE device_id = ?`, d.id)
		if err != nil {
			return nil, err
		}
		// Firmware rows and buttons go by ON DELETE CASCADE.
		res, err := tx.ExecContext(ctx, `DELETE FROM devices WHERE id = ? AND team_id = ?`, d.id, d.teamID)
		if err != nil {
			return nil, err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return nil, ErrDeviceNotFound
		}
		return sums, insertAudit(ctx, tx, audit, d.uid)
	})
}

// ListTokens returns the tokens of the user with that email, or every
// token when it is empty, oldest first. ErrUserNotFound when there is no
// such user.
func (s *Store) ListTokens(ctx context.Context, email string) ([]*TokenRow, error) {
	if email == "" {
		return queryAll(ctx, s.reader, scanToken, tokenQuery+`1 ORDER BY t.id`)
	}
	u, err := s.UserByEmail(ctx, email)
	if err != nil {
		return nil, err
	}
	return s.TokensOf(ctx, u.ID)
}

// VacuumInto writes a consistent copy of the database to path, a file
// that must not exist: SQLite copies one read transaction's view, so
// writes that go on meanwhile are either wholly in it or not at all.
func (s *Store) VacuumInto(ctx context.Context, path string) error {
	if _, err := s.writer.ExecContext(ctx, `VACUUM INTO ?`, path); err != nil {
		return fmt.Errorf("copy database: %w", err)
	}
	return nil
}

// SnapshotFirmwareSHA256s checks the database copy at path and returns
// the sha256 of every firmware file its rows need: devices' and the
// library's.
func SnapshotFirmwareSHA256s(ctx context.Context, path string) ([]string, error) {
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		return nil, err
	}
	defer db.Close()
	var check string
	if err := db.QueryRowContext(ctx, `PRAGMA quick_check`).Scan(&check); err != nil {
		return nil, fmt.Errorf("check database copy: %w", err)
	}
	if check != "ok" {
		return nil, fmt.Errorf("check database copy: %s", check)
	}
	return queryAll(ctx, db, scanString, `SELECT sha256 FROM firmwares UNION SELECT sha256 FROM library_firmwares ORDER BY sha256`)
}

// ImportDevices creates, in one transaction, a pending device of the team
// for every call fill makes to add, as CreateDevice does (deviceInserter),
// with MQTTPort; add answers ErrUIDTaken for a uid in use. An error from
// fill rolls back every row. It returns how many devices it created.
func (s *Store) ImportDevices(ctx context.Context, teamID int64, mqttPort int, fill func(add func(NewDevice) error) error) (int, error) {
	n := 0
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		// The uid index of a million devices is tens of MiB: with
		// SQLite's default 2 MiB of cache, inserting random uids rewrites
		// its pages over and over.
		if _, err := tx.ExecContext(ctx, `PRAGMA cache_size = -65536`); err != nil { // KiB
			return err
		}
		ins, err := newDeviceInserter(ctx, tx, teamID, s.Timestamp())
		if err != nil {
			return err
		}
		defer ins.close()
		return fill(func(nd NewDevice) error {
			nd.MQTTPort = mqttPort
			if err := ins.add(nd); err != nil {
				return err
			}
			n++
			return nil
		})
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}
