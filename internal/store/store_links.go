package store

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"time"
)

// The store's side of the links an admin makes for a member (links.go):
// a new invite link for a pending member, and password-reset links.

var (
	ErrResetInvalid  = errors.New("reset link invalid or expired")
	ErrResetNotFound = errors.New("no pending reset link")
	ErrMemberJoined  = errors.New("the member has joined")
)

// ReinviteMember gives the team's pending member id a new link, valid
// until expires; the old one stops working. ErrMemberJoined for a member
// who has an account, ErrMemberNotFound for none.
func (s *Store) ReinviteMember(ctx context.Context, teamID, id, invitedBy int64, secretHash []byte, expires time.Time) (*model.Member, error) {
	m, err := scanMember(s.writer.QueryRowContext(ctx, `UPDATE invites SET secret_hash = ?3, expires_at = ?4, invited_by = ?5
		WHERE id = ?1 AND team_id = ?2 RETURNING `+inviteColumns, id, teamID, secretHash, expires.UTC().Format(TimeFormat), invitedBy))
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

// CreatePasswordReset makes a reset link for the team's member id, valid
// until expires, in place of any earlier one, recording the admin who
// made it (CreatedBy: the link ends with their admin role, schema.sql
// version 15). ErrMemberNotFound when the team has no such member with
// an account.
func (s *Store) CreatePasswordReset(ctx context.Context, teamID, id, createdBy int64, secretHash []byte, expires time.Time) (*model.Member, error) {
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
		m, err = s.memberIn(ctx, tx, teamID, id)
		return err
	})
	return m, err
}

// RevokePasswordReset ends the pending reset link of the team's member
// id. ErrMemberNotFound when the team has no such member with an account,
// ErrResetNotFound when they have no reset link that works.
func (s *Store) RevokePasswordReset(ctx context.Context, teamID, id int64) (*model.Member, error) {
	var m *model.Member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if m, err = s.memberIn(ctx, tx, teamID, id); err != nil {
			return err
		}
		if !m.ResetPending {
			return ErrResetNotFound
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM password_resets WHERE user_id = ?`, id)
		m.ResetPending = false
		return err
	})
	return m, err
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
