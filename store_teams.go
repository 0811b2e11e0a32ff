package main

// The store's teams: members, invites and the audit log (teams.go).

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

var (
	errMemberNotFound = errors.New("member not found")
	errInviteInvalid  = errors.New("invite invalid or expired")
	errNeedsAdmin     = errors.New("the team needs an admin")
)

const memberColumns = `id, name, email, role, last_login_at, created_at`

func scanMember(row scanner) (*member, error) {
	m := &member{}
	if err := row.Scan(&m.ID, &m.Name, &m.Email, &m.Role, &m.LastLoginAt, &m.CreatedAt); err != nil {
		return nil, notFound(err, errMemberNotFound)
	}
	return m, nil
}

// team returns the team with its members, oldest first.
func (s *store) team(ctx context.Context, teamID int64) (*team, error) {
	t := &team{ID: teamID}
	if err := s.reader.QueryRowContext(ctx, `SELECT name FROM teams WHERE id = ?`, teamID).Scan(&t.Name); err != nil {
		return nil, err
	}
	var err error
	t.Members, err = queryAll(ctx, s.reader, scanMember,
		`SELECT `+memberColumns+` FROM users WHERE team_id = ? ORDER BY id`, teamID)
	return t, err
}

// renameTeam sets the team's name.
func (s *store) renameTeam(ctx context.Context, teamID int64, name string) error {
	_, err := s.writer.ExecContext(ctx, `UPDATE teams SET name = ? WHERE id = ?`, name, teamID)
	return err
}

// inviteMember adds a member without a password to the team, with an
// invite whose secret hashes to secretHash, valid until expires.
// errEmailTaken when the email has an account.
func (s *store) inviteMember(ctx context.Context, teamID int64, name, email string, r role, secretHash []byte, expires time.Time) (*member, error) {
	var m *member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		id, err := insertUser(ctx, tx, teamID, name, email, r, "", s.timestamp())
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO invites (user_id, secret_hash, expires_at) VALUES (?, ?, ?)`,
			id, secretHash, expires.UTC().Format(timeFormat)); err != nil {
			return fmt.Errorf("insert invite: %w", err)
		}
		m, err = scanMember(tx.QueryRowContext(ctx, `SELECT `+memberColumns+` FROM users WHERE id = ?`, id))
		return err
	})
	return m, err
}

// redeemInvite sets the password of the invite's member and deletes the
// invite, so that it works once. errInviteInvalid when no unexpired
// invite has that secret.
func (s *store) redeemInvite(ctx context.Context, secretHash []byte, passwordHash string) (*user, error) {
	var email string
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		err := tx.QueryRowContext(ctx, `DELETE FROM invites WHERE secret_hash = ? AND expires_at > ? RETURNING
			(SELECT email FROM users WHERE id = user_id)`, secretHash, s.timestamp()).Scan(&email)
		if err != nil {
			return notFound(err, errInviteInvalid)
		}
		_, err = tx.ExecContext(ctx, `UPDATE users SET password_hash = ? WHERE email = ?`, passwordHash, email)
		return err
	})
	if err != nil {
		return nil, err
	}
	return s.userByEmail(ctx, email)
}

// changeMember runs change on the team's member id in a transaction and
// refuses it with errNeedsAdmin when it leaves a team that had an admin
// without one. errMemberNotFound when the team has no such member.
func (s *store) changeMember(ctx context.Context, teamID, id int64, change func(tx *sql.Tx) error) (*member, error) {
	var m *member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		m, err = scanMember(tx.QueryRowContext(ctx, `SELECT `+memberColumns+` FROM users WHERE id = ? AND team_id = ?`, id, teamID))
		if err != nil {
			return err
		}
		admins := `SELECT count(*) FROM users WHERE team_id = ? AND role = ` + sqlString(roleAdmin)
		var before, after int
		if err := tx.QueryRowContext(ctx, admins, teamID).Scan(&before); err != nil {
			return err
		}
		if err := change(tx); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, admins, teamID).Scan(&after); err != nil {
			return err
		}
		if before > 0 && after == 0 {
			return errNeedsAdmin
		}
		return nil
	})
	return m, err
}

// setMemberRole changes a member's role (changeMember's rules).
func (s *store) setMemberRole(ctx context.Context, teamID, id int64, r role) (*member, error) {
	m, err := s.changeMember(ctx, teamID, id, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `UPDATE users SET role = ? WHERE id = ?`, r, id)
		return err
	})
	if m != nil {
		m.Role = r
	}
	return m, err
}

// deleteMember removes a member with their tokens; the team's devices
// stay (changeMember's rules).
func (s *store) deleteMember(ctx context.Context, teamID, id int64) (*member, error) {
	return s.changeMember(ctx, teamID, id, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `DELETE FROM users WHERE id = ?`, id)
		return err
	})
}

const auditInsertSQL = `INSERT INTO audit (team_id, at, actor_id, actor_name, action, device_uid, detail)
	VALUES (?, ?, ?, ?, ?, ?, ?)`

// auditLog returns up to limit of the team's entries, newest first,
// older than the entry before (0: from the newest).
// auditFilter is which of a team's audit entries to read: the newest
// limit older than before (0: from the newest), by actorID, on deviceUID,
// of action (a prefix when it ends in "."); a zero field does not filter.
type auditFilter struct {
	teamID, before, actorID int64
	deviceUID, action       string
	limit                   int
}

func (s *store) auditLog(ctx context.Context, f auditFilter) ([]*auditEntry, error) {
	return queryAll(ctx, s.reader, func(row scanner) (*auditEntry, error) {
		e := &auditEntry{}
		var actorID *int64
		var actorName *string
		var detail string
		if err := row.Scan(&e.ID, &e.At, &actorID, &actorName, &e.Action, &e.DeviceUID, &detail); err != nil {
			return nil, err
		}
		if actorID != nil {
			e.Actor = &actorRef{ID: *actorID, Name: *actorName}
		}
		e.Detail = []byte(detail)
		return e, nil
	}, `SELECT id, at, actor_id, actor_name, action, device_uid, detail FROM audit
		WHERE team_id = ?1 AND (?2 = 0 OR id < ?2) AND (?3 = 0 OR actor_id = ?3) AND (?4 = '' OR device_uid = ?4)
			AND (?5 = '' OR action = ?5 OR (substr(?5, -1) = '.' AND substr(action, 1, length(?5)) = ?5))
		ORDER BY id DESC LIMIT ?6`, f.teamID, f.before, f.actorID, f.deviceUID, f.action, f.limit)
}

// auditPruneStep is how many of the oldest audit entries one step of
// pruneAudit looks at: a step is a transaction of its own, so the writer
// is never held for long (one step of 1,000 took XXX).
const auditPruneStep = 1000

// pruneAudit deletes the audit entries made before cutoff, step by step,
// oldest first, and returns how many it deleted. Ids grow with time, so
// each step looks only at the oldest auditPruneStep entries, and the last
// step is one that found fewer old ones than that.
func (s *store) pruneAudit(ctx context.Context, cutoff time.Time) (int64, error) {
	var deleted int64
	for {
		res, err := s.writer.ExecContext(ctx, `DELETE FROM audit WHERE id IN
			(SELECT id FROM (SELECT id, at FROM audit ORDER BY id LIMIT ?2) WHERE at < ?1)`,
			cutoff.UTC().Format(timeFormat), auditPruneStep)
		if err != nil {
			return deleted, err
		}
		n, err := res.RowsAffected()
		deleted += n
		if err != nil || n < auditPruneStep {
			return deleted, err
		}
	}
}
