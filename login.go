package main

// Login and logout, and who the token is: the handlers. The throttle is in
// login_throttle.go, the pool of password checks in hashpool.go, the
// client address in clientaddr.go.

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"errors"
	"net/http"
)

// handleLogin serves POST /v1/auth/login: email, password and token_name
// in, a new personal access token out. A malformed request is refused
// before it can use up an attempt; a well-formed one reserves its attempt
// before any hashing, so that concurrent guesses are counted as they start.
func (s *server) handleLogin(w http.ResponseWriter, r *http.Request) error {
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	email := body.str(&e, "email", true, 255)
	password := body.password(&e, "password", 1024)
	tokenName := body.str(&e, "token_name", true, 255)
	if err := e.err(); err != nil {
		return err
	}
	ctx := r.Context()
	check, err := s.admitCheck(s.limiter.reserve(store.NormalizeEmail(*email), s.clientIP(r), s.store.Now()))
	if err != nil {
		return err
	}
	outcome := checkNotRun
	defer func() { check.end(outcome) }()
	u, err := s.store.UserByEmail(ctx, *email)
	if err != nil && !errors.Is(err, store.ErrUserNotFound) {
		return err
	}
	hash := s.dummyHash() // the same work as a real check: no user enumeration by timing
	if u != nil {
		hash = u.PasswordHash
	}
	match, err := check.place.check(ctx, hash, *password)
	if err != nil { // the client went away while waiting
		return nil
	}
	if s.passwordChecked != nil {
		s.passwordChecked()
	}
	if u == nil || !match {
		outcome = checkFailed
		return errWrongPassword
	}
	if err := s.answerLogin(w, r, u, *tokenName); err != nil {
		if errors.Is(err, errWrongPassword) {
			outcome = checkFailed
		}
		return err
	}
	outcome = checkPassed
	if err := s.store.RememberClient(ctx, u.ID, check.attempt.addr); err != nil {
		s.log.Warn("remember a known client", "err", err)
	}
	return nil
}

// errWrongPassword is the answer to a login with a wrong email or
// password, or whose password changed while it was checked.
var errWrongPassword = &fieldErrors{fields: []string{"email"},
	msgs: map[string][]string{"email": {"The provided credentials are incorrect."}}}

// answerLogin issues a login token for u and answers with it: only while
// the password the login verified, of u.passwordVersion, is still u's;
// else errWrongPassword, the token not stored.
func (s *server) answerLogin(w http.ResponseWriter, r *http.Request, u *store.UserRow, tokenName string) error {
	_, tok, err := issueToken(r.Context(), s.store, u.ID, tokenName, &u.PasswordVersion, nil)
	if errors.Is(err, store.ErrPasswordChanged) {
		return errWrongPassword
	}
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, struct {
		TokenType string            `json:"token_type"`
		Token     string            `json:"token"`
		User      model.UserSummary `json:"user"`
	}{"Bearer", tok, model.UserSummary{ID: u.ID, Name: u.Name, Email: u.Email, Role: u.Role}})
	return nil
}

// handleMe serves GET /v1/auth/me.
func (s *server) handleMe(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, dataBody{authFrom(r.Context()).user})
	return nil
}

// handleLogout serves POST /v1/auth/logout: it deletes the presented token only.
func (s *server) handleLogout(w http.ResponseWriter, r *http.Request) error {
	a := authFrom(r.Context())
	// A token revoked meanwhile is logged out all the same.
	if err := s.store.DeleteUserToken(r.Context(), a.user.ID, a.tokenID, nil); err != nil && !errors.Is(err, store.ErrTokenNotFound) {
		return err
	}
	writeMessage(w, http.StatusOK, "Logged out.")
	return nil
}
