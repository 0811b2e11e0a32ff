package main

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"net/http"
	"time"
)

// Links an admin makes for a member, each used once: an invite (the only
// way a new member sets a first password) and a password reset. A link's
// landing page first asks what the link is (…/info), so that a used or
// expired one says so before it asks for a password; then it is
// redeemed, and answers as a login does.

// inviteValidity is how long an invite link works.
const inviteValidity = 7 * 24 * time.Hour

// minPasswordLength is the shortest password a member may set.
const minPasswordLength = 8

// handleMemberInvite serves POST /v1/user/team/members: a member invited,
// and the link that lets them set a password and so make their account.
// The answer is the same whether or not the email has an account, here or
// in another team: such a link answers as invalid when it is used.
func (s *server) handleMemberInvite(w http.ResponseWriter, r *http.Request) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	email := body.str(&e, "email", true, 255)
	name := body.str(&e, "name", true, 255)
	role := readRole(&e, body)
	if email != nil {
		if !validEmail(*email) {
			e.add("email", "must be a valid email address.")
		}
	}
	if err := e.err(); err != nil {
		return err
	}
	secret := store.RandomString(40, store.Alnum)
	u := authFrom(r.Context()).user
	m, err := s.store.InviteMember(r.Context(), u.TeamID, u.ID, *name, *email, role,
		hashSecret(secret), s.store.Now().Add(inviteValidity), auditOf(r.Context(), inviteDetail))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, memberLink{m, s.publicURL + "/#/invite/" + secret, ""})
	return nil
}

// resetValidity is how long a password-reset link works.
const resetValidity = 24 * time.Hour

// handleMemberReinvite serves POST /v1/user/team/members/{id}/invite: a
// new link for a pending member; the old one stops working.
func (s *server) handleMemberReinvite(w http.ResponseWriter, r *http.Request) error {
	id, err := memberID(r)
	if err != nil {
		return err
	}
	u := authFrom(r.Context()).user
	secret := store.RandomString(40, store.Alnum)
	m, err := s.store.ReinviteMember(r.Context(), u.TeamID, id, u.ID, hashSecret(secret), s.store.Now().Add(inviteValidity),
		auditOf(r.Context(), inviteDetail))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, memberLink{m, s.publicURL + "/#/invite/" + secret, ""})
	return nil
}

// handleMemberReset serves POST /v1/user/team/members/{id}/reset: a
// one-time link, valid resetValidity, for the member to set a new
// password.
func (s *server) handleMemberReset(w http.ResponseWriter, r *http.Request) error {
	id, err := memberID(r)
	if err != nil {
		return err
	}
	secret := store.RandomString(40, store.Alnum)
	u := authFrom(r.Context()).user
	m, err := s.store.CreatePasswordReset(r.Context(), u.TeamID, id, u.ID, hashSecret(secret), s.store.Now().Add(resetValidity),
		auditOf(r.Context(), resetDetail))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, memberLink{m, "", s.publicURL + "/#/reset/" + secret})
	return nil
}

// handleMemberResetRevoke serves DELETE /v1/user/team/members/{id}/reset:
// the member's pending reset link stops working.
func (s *server) handleMemberResetRevoke(w http.ResponseWriter, r *http.Request) error {
	id, err := memberID(r)
	if err != nil {
		return err
	}
	err = s.store.RevokePasswordReset(r.Context(), authFrom(r.Context()).user.TeamID, id, auditOf(r.Context(), resetDetail))
	if err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Password reset link revoked.")
	return nil
}

// inviteDetail is the detail of an invite's audit entry: the member
// invited.
func inviteDetail(m *model.Member) map[string]any {
	return map[string]any{"member_id": m.ID, "name": m.Name, "email": m.Email, "role": m.Role}
}

// resetDetail is the detail of a reset link's audit entry, made or
// revoked: the member.
func resetDetail(m *model.Member) map[string]any {
	return map[string]any{"member_id": m.ID, "name": m.Name}
}

// memberLink is the answer that hands an admin a member's link.
type memberLink struct {
	Data      *model.Member `json:"data"`
	InviteURL string        `json:"invite_url,omitempty"`
	ResetURL  string        `json:"reset_url,omitempty"`
}

// handleInviteInfo serves POST /v1/auth/invite/info {"invite"}: the team,
// who invited and the member, or the invalid invite's 422.
func (s *server) handleInviteInfo(w http.ResponseWriter, r *http.Request) error {
	return s.answerLinkInfo(w, r, "invite", s.store.InviteInfo)
}

// handleResetInfo serves POST /v1/auth/reset/info {"reset"}.
func (s *server) handleResetInfo(w http.ResponseWriter, r *http.Request) error {
	return s.answerLinkInfo(w, r, "reset", s.store.ResetInfo)
}

// answerLinkInfo answers what the link with the secret in field is. Each
// lookup is counted by the login throttle as a redeem is
// (reserveInvite), a link not found as a wrong password: so the secrets
// of links cannot be guessed any faster here than by redeeming them.
func (s *server) answerLinkInfo(w http.ResponseWriter, r *http.Request, field string,
	info func(ctx context.Context, secretHash []byte) (*store.LinkInfo, error)) error {
	secret, err := decodeField(w, r, field)
	if err != nil {
		return err
	}
	attempt, wait := s.limiter.reserveInvite(s.clientIP(r), s.store.Now())
	if attempt == nil {
		return tooManyAttempts(wait)
	}
	outcome := checkFailed
	defer func() { s.limiter.finish(attempt, outcome, s.store.Now()) }()
	li, err := info(r.Context(), hashSecret(secret))
	if err != nil {
		return err
	}
	outcome = checkPassed
	writeJSON(w, http.StatusOK, dataBody{li})
	return nil
}

// handleInvite serves POST /v1/auth/invite: the invite's secret sets the
// member's password, and makes their account.
func (s *server) handleInvite(w http.ResponseWriter, r *http.Request) error {
	return s.redeemLink(w, r, "invite", s.store.RedeemInvite)
}

// handleReset serves POST /v1/auth/reset: the reset link's secret sets the
// member's password and ends their other sessions and known clients.
func (s *server) handleReset(w http.ResponseWriter, r *http.Request) error {
	return s.redeemLink(w, r, "reset", s.store.RedeemReset)
}

// redeemLink reads {field, password, token_name}, redeems the link with
// the password's hash, and answers as a login does. Throttled as a login
// is, counted under the client's address. The login throttle forgets
// where the user logged in before, as the store did (changePassword), and
// the team's open pages hear that the member's link is pending no more
// (member.updated).
func (s *server) redeemLink(w http.ResponseWriter, r *http.Request, field string,
	redeem func(ctx context.Context, secretHash []byte, passwordHash string) (*store.UserRow, error)) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	secret := body.str(&e, field, true, 255)
	password := body.password(&e, "password", 1024)
	tokenName := body.str(&e, "token_name", true, 255)
	if password != nil && len([]rune(*password)) < minPasswordLength {
		e.add("password", "must be at least %d characters.", minPasswordLength)
	}
	if err := e.err(); err != nil {
		return err
	}
	check, err := s.admitCheck(s.limiter.reserveInvite(s.clientIP(r), s.store.Now()))
	if err != nil {
		return err
	}
	outcome := checkFailed
	defer func() { check.end(outcome) }()
	var hash string
	var hashErr error
	if check.place.do(r.Context(), func() { hash, hashErr = hashPassword(*password, s.iterations) }) != nil {
		return nil // the client went away while waiting
	}
	if hashErr != nil {
		return hashErr
	}
	u, err := redeem(r.Context(), hashSecret(*secret), hash)
	if err != nil {
		return err
	}
	s.limiter.forget(u.Email)
	s.events.publish(u.TeamID, "member.updated", memberUpdated{u.ID, u.Name, u.Role})
	outcome = checkPassed
	return s.answerLogin(w, r, u, *tokenName)
}
