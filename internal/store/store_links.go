package store

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"fmt"
	"time"
)

// The store's side of the links an admin makes for a member (links.go):
// invites, the only way a new member sets a first password, and
// password-reset links; and the one way a password changes
// (changePassword), which a redeemed link and 'devicehub user passwd'
// (SetPassword) share.

var (
	ErrInviteInvalid = errors.New("invite invalid or expired")
	ErrResetInvalid  = errors.New("reset link invalid or expired")
	ErrResetNotFound = errors.New("no pending reset link")
	ErrMemberJoined  = errors.New("the member has joined")
)

// InviteMember invites a member to the team, with a link whose secret
// hashes to SecretHash, valid until expires: the member has no account
// until the link is used (RedeemInvite), and claims no email meanwhile.
// An email the team has invited before gets the new link, name and role
// under the same id. The member's id is drawn from the users' sequence,
// so that it becomes their user's id. A QuotaError when the team has as
// many members as -max-members allows, pending invites included.
func (s *Store) InviteMember(ctx context.Context, teamID, invitedBy int64, name, email string, r model.Role, secretHash []byte, expires time.Time,
	audit Audit[*model.Member]) (*model.Member, error) {
	email = NormalizeEmail(email)
	var m *model.Member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if max := s.limits.Members; max > 0 {
			var n int
			err := tx.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM users WHERE team_id = ?1) +
				(SELECT count(*) FROM invites WHERE team_id = ?1 AND expires_at > ?2 AND email != ?3)`,
				teamID, s.Timestamp(), email).Scan(&n)
			if err != nil {
				return err
			}
			if n >= max {
				return &QuotaError{Quota: QuotaMembers, Limit: max}
			}
		}
		var id int64
		err := tx.QueryRowContext(ctx, `SELECT id FROM invites WHERE team_id = ? AND email = ?`, teamID, email).Scan(&id)
		if errors.Is(err, sql.ErrNoRows) {
			// AUTOINCREMENT takes the next id past this one, so no user
			// gets it meanwhile (https://sqlite.org/autoinc.html).
			err = tx.QueryRowContext(ctx, `UPDATE sqlite_sequence SET seq = seq + 1 WHERE name = 'users' RETURNING seq`).Scan(&id)
		}
		if err != nil {
			return fmt.Errorf("member id: %w", err)
		}
		m, err = scanMember(tx.QueryRowContext(ctx, `INSERT INTO invites
			(id, team_id, name, email, role, secret_hash, expires_at, created_at, invited_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
			ON CONFLICT (id) DO UPDATE SET name = excluded.name, role = excluded.role, secret_hash = excluded.secret_hash,
				expires_at = excluded.expires_at, invited_by = excluded.invited_by
			RETURNING `+inviteColumns, id, teamID, name, email, r, secretHash, expires.UTC().Format(TimeFormat), s.Timestamp(), invitedBy))
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, m)
	})
	return m, err
}

// ReinviteMember gives the team's pending member id a new link, valid
// until expires; the old one stops working. ErrMemberJoined for a member
// who has an account, ErrMemberNotFound for none.
func (s *Store) ReinviteMember(ctx context.Context, teamID, id, invitedBy int64, secretHash []byte, expires time.Time,
	audit Audit[*model.Member]) (*model.Member, error) {
	var m *model.Member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		m, err = scanMember(tx.QueryRowContext(ctx, `UPDATE invites SET secret_hash = ?3, expires_at = ?4, invited_by = ?5
			WHERE id = ?1 AND team_id = ?2 RETURNING `+inviteColumns, id, teamID, secretHash, expires.UTC().Format(TimeFormat), invitedBy))
		if err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, m)
	})
	if errors.Is(err, ErrMemberNotFound) {
		if _, userErr := s.member(ctx, teamID, id); userErr == nil {
			return nil, ErrMemberJoined
		}
	}
	return m, err
}

// member returns the team's member id who has an account.
func (s *Store) member(ctx context.Context, teamID, id int64) (*model.Member, error) {
	return s.memberIn(ctx, s.reader, teamID, id)
}

func (s *Store) memberIn(ctx context.Context, q queryer, teamID, id int64) (*model.Member, error) {
	return scanMember(q.QueryRowContext(ctx, `SELECT `+memberColumns("?3")+` FROM users WHERE id = ?1 AND team_id = ?2`,
		id, teamID, s.Timestamp()))
}

// LinkInfo is what a link's landing page shows before it asks for a
// password: the team, who made the link (nil when unknown), and the member.
type LinkInfo struct {
	Team      string          `json:"team"`
	InvitedBy *model.ActorRef `json:"invited_by"`
	Name      string          `json:"name"`
	Email     string          `json:"email"`
}

// InviteInfo describes the unexpired invite with that secret;
// ErrInviteInvalid for none. An invite whose email has an account is
// described all the same: only its redeem tells (RedeemInvite), after a
// password, throttled as a login is, so that an admin cannot learn
// whether an email has an account anywhere.
func (s *Store) InviteInfo(ctx context.Context, secretHash []byte) (*LinkInfo, error) {
	li := &LinkInfo{}
	var byID sql.NullInt64
	var byName sql.NullString
	err := s.reader.QueryRowContext(ctx, `SELECT t.name, u.id, u.name, i.name, i.email FROM invites i
		JOIN teams t ON t.id = i.team_id LEFT JOIN users u ON u.id = i.invited_by
		WHERE i.secret_hash = ? AND i.expires_at > ?`,
		secretHash, s.Timestamp()).Scan(&li.Team, &byID, &byName, &li.Name, &li.Email)
	if byID.Valid {
		li.InvitedBy = &model.ActorRef{ID: byID.Int64, Name: byName.String}
	}
	return li, notFound(err, ErrInviteInvalid)
}

// RedeemInvite makes the invited member's account, under their member
// id, with that password as its first (changePassword), deletes the
// invite, so that it works once, and returns the user as made.
// ErrInviteInvalid when no unexpired invite has that secret, or when its
// email has an account by now.
func (s *Store) RedeemInvite(ctx context.Context, secretHash []byte, passwordHash string) (*UserRow, error) {
	var u *UserRow
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		err := tx.QueryRowContext(ctx, `INSERT INTO users (id, team_id, name, email, role, password_hash, created_at)
			SELECT id, team_id, name, email, role, '', created_at FROM invites WHERE secret_hash = ?1 AND expires_at > ?2
			RETURNING id`, secretHash, s.Timestamp()).Scan(&id)
		if isUniqueErr(err) {
			return ErrInviteInvalid
		}
		if err != nil {
			return notFound(err, ErrInviteInvalid)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM invites WHERE id = ?`, id); err != nil {
			return err
		}
		if _, err := changePassword(ctx, tx, id, passwordHash); err != nil {
			return err
		}
		u, err = userIn(ctx, tx, id)
		return err
	})
	return u, err
}

// CreatePasswordReset makes a reset link for the team's member id, valid
// until expires, in place of any earlier one, recording the admin who
// made it (CreatedBy: the link ends with their admin role, schema.sql
// version 15). ErrMemberNotFound when the team has no such member with
// an account.
func (s *Store) CreatePasswordReset(ctx context.Context, teamID, id, createdBy int64, secretHash []byte, expires time.Time,
	audit Audit[*model.Member]) (*model.Member, error) {
	var m *model.Member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO password_resets (user_id, secret_hash, expires_at, created_by)
			SELECT id, ?3, ?4, ?5 FROM users WHERE id = ?1 AND team_id = ?2
			ON CONFLICT (user_id) DO UPDATE SET secret_hash = excluded.secret_hash, expires_at = excluded.expires_at,
				created_by = excluded.created_by`,
			id, teamID, secretHash, expires.UTC().Format(TimeFormat), createdBy)
		if err != nil {
			return err
		}
		if m, err = s.memberIn(ctx, tx, teamID, id); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, m)
	})
	return m, err
}

// RevokePasswordReset ends the pending reset link of the team's member
// id. ErrMemberNotFound when the team has no such member with an account,
// ErrResetNotFound when they have no reset link that works.
func (s *Store) RevokePasswordReset(ctx context.Context, teamID, id int64, audit Audit[*model.Member]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		m, err := s.memberIn(ctx, tx, teamID, id)
		if err != nil {
			return err
		}
		if !m.ResetPending {
			return ErrResetNotFound
		}
		if _, err = tx.ExecContext(ctx, `DELETE FROM password_resets WHERE user_id = ?`, id); err != nil {
			return err
		}
		m.ResetPending = false
		return insertAudit(ctx, tx, audit, m)
	})
}

// ResetInfo describes the unexpired reset link with that secret;
// ErrResetInvalid for none.
func (s *Store) ResetInfo(ctx context.Context, secretHash []byte) (*LinkInfo, error) {
	li := &LinkInfo{}
	err := s.reader.QueryRowContext(ctx, `SELECT t.name, u.name, u.email FROM password_resets r
		JOIN users u ON u.id = r.user_id JOIN teams t ON t.id = u.team_id
		WHERE r.secret_hash = ? AND r.expires_at > ?`, secretHash, s.Timestamp()).Scan(&li.Team, &li.Name, &li.Email)
	return li, notFound(err, ErrResetInvalid)
}

// RedeemReset changes the password of the member whose unexpired reset
// link has that secret (changePassword, which ends the link, so that it
// works once) and returns them as the change left them; ErrResetInvalid
// for none.
func (s *Store) RedeemReset(ctx context.Context, secretHash []byte, passwordHash string) (*UserRow, error) {
	var u *UserRow
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		err := tx.QueryRowContext(ctx, `SELECT user_id FROM password_resets WHERE secret_hash = ? AND expires_at > ?`,
			secretHash, s.Timestamp()).Scan(&id)
		if err != nil {
			return notFound(err, ErrResetInvalid)
		}
		if _, err := changePassword(ctx, tx, id, passwordHash); err != nil {
			return err
		}
		u, err = userIn(ctx, tx, id)
		return err
	})
	return u, err
}

// SetPassword changes the password of the user with that email
// (changePassword) and returns how many tokens it ended; ErrUserNotFound
// when there is no such user.
func (s *Store) SetPassword(ctx context.Context, email, passwordHash string) (revoked int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var userID int64
		err := tx.QueryRowContext(ctx, `SELECT id FROM users WHERE email = ?`, NormalizeEmail(email)).Scan(&userID)
		if err != nil {
			return notFound(err, ErrUserNotFound)
		}
		revoked, err = changePassword(ctx, tx, userID, passwordHash)
		return err
	})
	return revoked, err
}

// changePassword is the one way a user's password changes (a reset, an
// invite's first password, 'devicehub user passwd'): in tx, it sets the
// hash and ends what the old password opened, so that whoever knew it is
// locked out: the user's tokens, their known clients (the login
// throttle's; the caller forgets them in memory too) and their reset
// link. It bumps the user's password version, which a login that checked
// the old password finds changed when it stores its token (CreateToken).
// It returns how many tokens it ended; ErrUserNotFound for no such user.
func changePassword(ctx context.Context, tx *sql.Tx, userID int64, passwordHash string) (revoked int64, err error) {
	res, err := tx.ExecContext(ctx, `UPDATE users SET password_hash = ?, password_version = password_version + 1 WHERE id = ?`,
		passwordHash, userID)
	if err != nil {
		return 0, err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return 0, ErrUserNotFound
	}
	for _, q := range []string{`DELETE FROM known_clients WHERE user_id = ?`, `DELETE FROM password_resets WHERE user_id = ?`} {
		if _, err := tx.ExecContext(ctx, q, userID); err != nil {
			return 0, err
		}
	}
	res, err = tx.ExecContext(ctx, `DELETE FROM tokens WHERE user_id = ?`, userID)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// PruneInvites deletes the invites and reset links that expired before now.
func (s *Store) PruneInvites(ctx context.Context) error {
	now := s.Timestamp()
	if _, err := s.writer.ExecContext(ctx, `DELETE FROM invites WHERE expires_at <= ?`, now); err != nil {
		return err
	}
	_, err := s.writer.ExecContext(ctx, `DELETE FROM password_resets WHERE expires_at <= ?`, now)
	return err
}
