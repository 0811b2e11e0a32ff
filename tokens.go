package main

// The token endpoints: a user lists, creates and deletes
// their personal access tokens, as the dashboard's API settings page does.

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"net/http"
	"strconv"
)

// handleTokenList serves GET /v1/user/tokens: the user's tokens, oldest
// first; current marks the one making the request.
func (s *server) handleTokenList(w http.ResponseWriter, r *http.Request) error {
	a := authFrom(r.Context())
	rows, err := s.store.TokensOf(r.Context(), a.user.ID)
	if err != nil {
		return err
	}
	list := make([]model.TokenInfo, len(rows))
	for i, t := range rows {
		list[i] = t.TokenInfo
		list[i].Current = t.ID == a.tokenID
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// handleTokenCreate serves POST /v1/user/tokens: {"name"} in, the new
// token with its secret out (201). At the token limit it is refused.
func (s *server) handleTokenCreate(w http.ResponseWriter, r *http.Request) error {
	name, err := decodeField(w, r, "name")
	if err != nil {
		return err
	}
	ctx := r.Context()
	userID := authFrom(ctx).user.ID
	id, tok, err := issueToken(ctx, s.store, userID, name, nil, auditOf(ctx, func(id int64) map[string]any {
		return map[string]any{"token_id": id, "name": name}
	}))
	if err != nil {
		return err
	}
	auditCommitted(ctx)
	t, err := s.store.UserToken(ctx, userID, id)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, dataBody{newToken{t.TokenInfo, tok}})
	return nil
}

// handleTokenDelete serves DELETE /v1/user/tokens/{id}. Another user's
// token answers as an unknown one: 404.
func (s *server) handleTokenDelete(w http.ResponseWriter, r *http.Request) error {
	ref := r.PathValue("id")
	id, err := strconv.ParseInt(ref, 10, 64)
	if err != nil || id <= 0 || strconv.FormatInt(id, 10) != ref {
		return store.ErrTokenNotFound
	}
	err = s.store.DeleteUserToken(r.Context(), authFrom(r.Context()).user.ID, id, auditOf(r.Context(), func(id int64) map[string]any {
		return map[string]any{"token_id": id}
	}))
	if err != nil {
		return err
	}
	writeMessage(w, http.StatusOK, "Token deleted.")
	return nil
}
