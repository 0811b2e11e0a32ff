package main

import (
	"context"
	"database/sql"
	"errors"
	"time"
)

// The store's side of the links an admin makes for a member (links.go):
// a new invite link for a pending member, and password-reset links.

var (
	errResetInvalid  = errors.New("reset link invalid or expired")
	errResetNotFound = errors.New("no pending reset link")
	errMemberJoined  = errors.New("the member has joined")
)

// reinviteMember gives the team's pending member id a new link, valid
// until expires; the old one stops working. errMemberJoined for a member
// who has an account, errMemberNotFound for none.
func (s *store) reinviteMember(ctx context.Context, teamID, id, invitedBy int64, secretHash []byte, expires time.Time) (*member, error) {
	m, err := scanMember(s.writer.QueryRowContext(ctx, `UPDATE invites SET secret_hash = ?3, expires_at = ?4, invited_by = ?5
		WHERE id = ?1 AND team_id = ?2 RETURNING `+inviteColumns, id, teamID, secretHash, expires.UTC().Format(timeFormat), invitedBy))
	if errors.Is(err, errMemberNotFound) {
		if _, userErr := s.member(ctx, teamID, id); userErr == nil {
			return nil, errMemberJoined
		}
	}
	return m, err
}

// member returns the team's member id who has an account.
func (s *store) member(ctx context.Context, teamID, id int64) (*member, error) {
	return s.memberIn(ctx, s.reader, teamID, id)
}

func (s *store) memberIn(ctx context.Context, q queryer, teamID, id int64) (*member, error) {
	return scanMember(q.QueryRowContext(ctx, `SELECT `+memberColumns("?3")+` FROM users WHERE id = ?1 AND team_id = ?2`,
		id, teamID, s.timestamp()))
}

// linkInfo is what a link's landing page shows before it asks for a
// password: the team, who made the link (nil when unknown), and the member.
type linkInfo struct {
	Team      string    `json:"team"`
	InvitedBy *actorRef `json:"invited_by"`
	Name      string    `json:"name"`
	Email     string    `json:"email"`
}

// inviteInfo describes the unexpired invite with that secret;
// errInviteInvalid for none. An invite whose email has an account is
// described all the same: only its redeem tells (redeemInvite), after a
// password, throttled as a login is, so that an admin cannot learn
// whether an email has an account anywhere.
func (s *store) inviteInfo(ctx context.Context, secretHash []byte) (*linkInfo, error) {
	li := &linkInfo{}
	var byID sql.NullInt64
	var byName sql.NullString
	err := s.reader.QueryRowContext(ctx, `SELECT t.name, u.id, u.name, i.name, i.email FROM invites i
		JOIN teams t ON t.id = i.team_id LEFT JOIN users u ON u.id = i.invited_by
		WHERE i.secret_hash = ? AND i.expires_at > ?`,
		secretHash, s.timestamp()).Scan(&li.Team, &byID, &byName, &li.Name, &li.Email)
	if byID.Valid {
		li.InvitedBy = &actorRef{ID: byID.Int64, Name: byName.String}
	}
	return li, notFound(err, errInviteInvalid)
}

// createPasswordReset makes a reset link for the team's member id, valid
// until expires, in place of any earlier one, recording the admin who
// made it (createdBy: the link ends with their admin role, schema.sql
// version 15). errMemberNotFound when the team has no such member with
// an account.
func (s *store) createPasswordReset(ctx context.Context, teamID, id, createdBy int64, secretHash []byte, expires time.Time) (*member, error) {
	var m *member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO password_resets (user_id, secret_hash, expires_at, created_by)
			SELECT id, ?3, ?4, ?5 FROM users WHERE id = ?1 AND team_id = ?2
			ON CONFLICT (user_id) DO UPDATE SET secret_hash = excluded.secret_hash, expires_at = excluded.expires_at,
				created_by = excluded.created_by`,
			id, teamID, secretHash, expires.UTC().Format(timeFormat), createdBy)
		if err != nil {
			return err
		}
		m, err = s.memberIn(ctx, tx, teamID, id)
		return err
	})
	return m, err
}

// revokePasswordReset ends the pending reset link of the team's member
// id. errMemberNotFound when the team has no such member with an account,
// errResetNotFound when they have no reset link that works.
func (s *store) revokePasswordReset(ctx context.Context, teamID, id int64) (*member, error) {
	var m *member
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if m, err = s.memberIn(ctx, tx, teamID, id); err != nil {
			return err
		}
		if !m.ResetPending {
			return errResetNotFound
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM password_resets WHERE user_id = ?`, id)
		m.ResetPending = false
		return err
	})
	return m, err
}

// resetInfo describes the unexpired reset link with that secret;
// errResetInvalid for none.
func (s *store) resetInfo(ctx context.Context, secretHash []byte) (*linkInfo, error) {
	li := &linkInfo{}
	err := s.reader.QueryRowContext(ctx, `SELECT t.name, u.name, u.email FROM password_resets r
		JOIN users u ON u.id = r.user_id JOIN teams t ON t.id = u.team_id
		WHERE r.secret_hash = ? AND r.expires_at > ?`, secretHash, s.timestamp()).Scan(&li.Team, &li.Name, &li.Email)
	return li, notFound(err, errResetInvalid)
}

// redeemReset changes the password of the member whose unexpired reset
// link has that secret (changePassword, which ends the link, so that it
// works once) and returns them as the change left them; errResetInvalid
// for none.
func (s *store) redeemReset(ctx context.Context, secretHash []byte, passwordHash string) (*userRow, error) {
	var u *userRow
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var id int64
		err := tx.QueryRowContext(ctx, `SELECT user_id FROM password_resets WHERE secret_hash = ? AND expires_at > ?`,
			secretHash, s.timestamp()).Scan(&id)
		if err != nil {
			return notFound(err, errResetInvalid)
		}
		if _, err := changePassword(ctx, tx, id, passwordHash); err != nil {
			return err
		}
		u, err = userIn(ctx, tx, id)
		return err
	})
	return u, err
}
