package store

// The store's teams: members and the audit log (teams.go, audit.go).

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"fmt"
	"time"
)

var (
	ErrMemberNotFound = errors.New("member not found")
	ErrNeedsAdmin     = errors.New("the team needs an admin")
)

// memberColumns are a Member's columns in users, with the parameter
// that holds the time now (a reset link is pending until it expires);
// inviteColumns the same in invites, for a member who has not used their
// link yet.
func memberColumns(nowParam string) string {
	return `id, name, email, role, last_login_at, created_at, 0,
		EXISTS (SELECT 1 FROM password_resets r WHERE r.user_id = users.id AND r.expires_at > ` + nowParam + `)`
}

const inviteColumns = `id, name, email, role, NULL, created_at, 1, 0`

func scanMember(row scanner) (*model.Member, error) {
	m := &model.Member{}
	if err := row.Scan(&m.ID, &m.Name, &m.Email, &m.Role, &m.LastLoginAt, &m.CreatedAt, &m.Pending, &m.ResetPending); err != nil {
		return nil, notFound(err, ErrMemberNotFound)
	}
	return m, nil
}

// Team returns the team with its members, oldest first: its users, and
// those invited whose link has not expired.
func (s *Store) Team(ctx context.Context, teamID int64) (*model.Team, error) {
	t := &model.Team{ID: teamID}
	if err := s.reader.QueryRowContext(ctx, `SELECT name FROM teams WHERE id = ?`, teamID).Scan(&t.Name); err != nil {
		return nil, err
	}
	var err error
	t.Members, err = queryAll(ctx, s.reader, scanMember, `SELECT `+memberColumns("?2")+` FROM users WHERE team_id = ?1
		UNION ALL SELECT `+inviteColumns+` FROM invites WHERE team_id = ?1 AND expires_at > ?2 ORDER BY id`,
		teamID, s.Timestamp())
	return t, err
}

// RenameTeam sets the team's name; audit is made of the name it had
// before.
func (s *Store) RenameTeam(ctx context.Context, teamID int64, name string, audit Audit[string]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		var previous string
		if err := tx.QueryRowContext(ctx, `SELECT name FROM teams WHERE id = ?`, teamID).Scan(&previous); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `UPDATE teams SET name = ? WHERE id = ?`, name, teamID); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, previous)
	})
}

// changeMember changes the team's member id in a transaction: a user by
// the statement userSQL, or else a member invited by inviteSQL, each
// taking ?1 the id, ?2 the team, ?3 the time now and args after them,
// and returning the
// member's columns. It refuses a change with ErrNeedsAdmin when it leaves a team
// that had an admin without one: only users count, as a member invited
// cannot log in until they set a password. ErrMemberNotFound when the
// team has no such member. audit is made of the member as the change
// left them.
func (s *Store) changeMember(ctx context.Context, teamID, id int64, audit Audit[*model.Member], userSQL, inviteSQL string, args ...any) (*model.Member, error) {
	args = append([]any{id, teamID, s.Timestamp()}, args...)
	var m *model.Member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		admins := `SELECT count(*) FROM users WHERE team_id = ? AND role = ` + sqlString(model.RoleAdmin)
		var before, after int
		if err := tx.QueryRowContext(ctx, admins, teamID).Scan(&before); err != nil {
			return err
		}
		var err error
		m, err = scanMember(tx.QueryRowContext(ctx, userSQL, args...))
		if errors.Is(err, ErrMemberNotFound) {
			m, err = scanMember(tx.QueryRowContext(ctx, inviteSQL, args...))
		}
		if err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, admins, teamID).Scan(&after); err != nil {
			return err
		}
		if before > 0 && after == 0 {
			return ErrNeedsAdmin
		}
		return insertAudit(ctx, tx, audit, m)
	})
	return m, err
}

// SetMemberRole changes a member's role (changeMember's rules).
func (s *Store) SetMemberRole(ctx context.Context, teamID, id int64, r model.Role, audit Audit[*model.Member]) (*model.Member, error) {
	m, err := s.changeMember(ctx, teamID, id, audit,
		`UPDATE users SET role = ?4 WHERE id = ?1 AND team_id = ?2 RETURNING `+memberColumns("?3"),
		`UPDATE invites SET role = ?4 WHERE id = ?1 AND team_id = ?2 RETURNING `+inviteColumns, r)
	if m != nil {
		m.Role = r
	}
	return m, err
}

// DeleteMember removes a member with their tokens, or a member invited
// with their link; the team's devices stay (changeMember's rules).
func (s *Store) DeleteMember(ctx context.Context, teamID, id int64, audit Audit[*model.Member]) (*model.Member, error) {
	return s.changeMember(ctx, teamID, id, audit,
		`DELETE FROM users WHERE id = ?1 AND team_id = ?2 RETURNING `+memberColumns("?3"),
		`DELETE FROM invites WHERE id = ?1 AND team_id = ?2 RETURNING `+inviteColumns)
}

// Audit makes a write's audit entry from what the write returns (the
// member it invited, the name it replaced, the rollout it made), in the
// write's own transaction, where the write inserts it (insertAudit): the
// write commits with its entry or not at all, and an entry that cannot be
// inserted undoes its write. nil: a write no one audits (the command
// line's, a test's); an Audit that returns nil makes none. It runs
// inside the write's transaction, on the store's one writer: it must not
// call the store.
type Audit[T any] func(T) *model.AuditEntry

// insertAudit inserts, in tx, the entry audit makes of v (insertEntry):
// the last statement of an audited write, after every check that may
// refuse it. Nothing when audit is nil or makes no entry.
func insertAudit[T any](ctx context.Context, tx *sql.Tx, audit Audit[T], v T) error {
	if audit == nil {
		return nil
	}
	if e := audit(v); e != nil {
		return insertEntry(ctx, tx, e)
	}
	return nil
}

// auditInsertSQL adds an entry numbered after the team's newest: the
// number is the entry's id in the API, which tells a team nothing of
// other teams' writes (docs/security.md).
const auditInsertSQL = `INSERT INTO audit (team_id, number, at, actor_id, actor_name, action, device_uid, detail)
	VALUES (?1, (SELECT coalesce(max(number), 0) + 1 FROM audit WHERE team_id = ?1), ?2, ?3, ?4, ?5, ?6, ?7)
	RETURNING number`

// insertEntry inserts e in tx and sets its id (auditInsertSQL). Every
// audit entry goes in here, in the transaction of the write it describes,
// but a command's, whose group commit runs the same statement prepared
// (commandWriter).
func insertEntry(ctx context.Context, tx *sql.Tx, e *model.AuditEntry) error {
	return scanEntryID(tx.QueryRowContext(ctx, auditInsertSQL, auditArgs(e)...), e)
}

// auditArgs are auditInsertSQL's arguments for e.
func auditArgs(e *model.AuditEntry) []any {
	var actorID *int64
	var actorName *string
	if e.Actor != nil {
		actorID, actorName = &e.Actor.ID, &e.Actor.Name
	}
	return []any{e.TeamID, e.At, actorID, actorName, e.Action, e.DeviceUID, string(e.Detail)}
}

// scanEntryID sets e's id from the insert's row.
func scanEntryID(row *sql.Row, e *model.AuditEntry) error {
	if err := row.Scan(&e.ID); err != nil {
		return fmt.Errorf("insert audit entry: %w", err)
	}
	return nil
}

// AuditFilter is which of a team's audit entries to read: the newest
// limit older than before (0: from the newest), by ActorID, by or about
// MemberID (its actor, or the member its detail names), on DeviceUID, of
// action (a prefix when it ends in "."); a zero field does not filter.
type AuditFilter struct {
	TeamID, Before, ActorID, MemberID int64
	DeviceUID, Action                 string
	Limit                             int
}

// AuditLog returns the team's entries that f picks, newest first.
func (s *Store) AuditLog(ctx context.Context, f AuditFilter) ([]*model.AuditEntry, error) {
	return queryAll(ctx, s.reader, func(row scanner) (*model.AuditEntry, error) {
		e := &model.AuditEntry{}
		var actorID *int64
		var actorName *string
		var detail string
		if err := row.Scan(&e.ID, &e.At, &actorID, &actorName, &e.Action, &e.DeviceUID, &detail); err != nil {
			return nil, err
		}
		if actorID != nil {
			e.Actor = &model.ActorRef{ID: *actorID, Name: *actorName}
		}
		e.Detail = []byte(detail)
		return e, nil
	}, `SELECT number, at, actor_id, actor_name, action, device_uid, detail FROM audit
		WHERE team_id = ?1 AND (?2 = 0 OR number < ?2) AND (?3 = 0 OR actor_id = ?3) AND (?4 = '' OR device_uid = ?4)
			AND (?5 = '' OR action = ?5 OR (substr(?5, -1) = '.' AND substr(action, 1, length(?5)) = ?5))
			AND (?7 = 0 OR actor_id = ?7 OR (action LIKE 'member.%' AND detail ->> '$.member_id' = ?7))
		ORDER BY number DESC LIMIT ?6`, f.TeamID, f.Before, f.ActorID, f.DeviceUID, f.Action, f.Limit, f.MemberID)
}

// AuditPruneStep is how many of the oldest audit entries one step of
// PruneAudit looks at: a step is a transaction of its own, so the writer
// is never held for long (a step of 1,000 takes about 3 ms: 200,000 old
// entries went in 0.6 s; with none old, a pass looks at 1,000 rows, 0.5 ms).
const AuditPruneStep = 1000

// PruneAudit deletes the audit entries made before cutoff, step by step,
// oldest first, and returns how many it deleted. Ids grow with time, so
// each step looks only at the oldest AuditPruneStep entries, and the last
// step is one that found fewer old ones than that.
func (s *Store) PruneAudit(ctx context.Context, cutoff time.Time) (int64, error) {
	var deleted int64
	for {
		res, err := s.writer.ExecContext(ctx, `DELETE FROM audit WHERE id IN
			(SELECT id FROM (SELECT id, at FROM audit ORDER BY id LIMIT ?2) WHERE at < ?1)`,
			cutoff.UTC().Format(TimeFormat), AuditPruneStep)
		if err != nil {
			return deleted, err
		}
		n, err := res.RowsAffected()
		deleted += n
		if err != nil || n < AuditPruneStep {
			return deleted, err
		}
	}
}
