package main

// Teams: the team and its members (invites, reinvites and password
// resets are links.go's).

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"net/http"
	"slices"
	"strconv"
)

// handleTeamGet serves GET /v1/user/team.
func (s *server) handleTeamGet(w http.ResponseWriter, r *http.Request) error {
	t, err := s.store.Team(r.Context(), authFrom(r.Context()).user.TeamID)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, dataBody{t})
	return nil
}

// handleTeamUpdate serves PATCH /v1/user/team: its name.
func (s *server) handleTeamUpdate(w http.ResponseWriter, r *http.Request) error {
	name, err := decodeField(w, r, "name")
	if err != nil {
		return err
	}
	teamID := authFrom(r.Context()).user.TeamID
	err = s.store.RenameTeam(r.Context(), teamID, name, auditOf(r.Context(), func(previous string) map[string]any {
		detail := map[string]any{"name": name}
		if previous != name { // the entry says what the name was
			detail["previous_name"] = previous
		}
		return detail
	}))
	if err != nil {
		return err
	}
	auditCommitted(r.Context())
	return s.handleTeamGet(w, r)
}

// readRole reads an optional role field (user when absent).
func readRole(e *fieldErrors, body jsonBody) model.Role {
	r := body.str(e, "role", false, 20)
	if r == nil {
		return model.RoleUser
	}
	if !slices.Contains(model.Roles, model.Role(*r)) {
		e.add("role", "must be one of: %s.", model.JoinStates(model.Roles))
	}
	return model.Role(*r)
}

// memberID reads the {id} of a member route; an id that is no number is
// no member.
func memberID(r *http.Request) (int64, error) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil {
		return 0, store.ErrMemberNotFound
	}
	return id, nil
}

// handleMemberUpdate serves PATCH /v1/user/team/members/{id}: the role.
func (s *server) handleMemberUpdate(w http.ResponseWriter, r *http.Request) error {
	id, err := memberID(r)
	if err != nil {
		return err
	}
	body, err := decodeJSON(w, r)
	if err != nil {
		return err
	}
	var e fieldErrors
	if !body.has("role") {
		e.add("role", "is required.")
	}
	role := readRole(&e, body)
	if err := e.err(); err != nil {
		return err
	}
	m, err := s.store.SetMemberRole(r.Context(), authFrom(r.Context()).user.TeamID, id, role,
		auditOf(r.Context(), func(m *model.Member) map[string]any {
			return map[string]any{"member_id": m.ID, "name": m.Name, "role": m.Role}
		}))
	if err != nil {
		return err
	}
	// The member's open pages redraw what their role allows.
	s.events.publish(authFrom(r.Context()).user.TeamID, "member.updated", memberUpdated{m.ID, m.Name, m.Role})
	writeJSON(w, http.StatusOK, dataBody{m})
	return nil
}

// handleMemberDelete serves DELETE /v1/user/team/members/{id}: the user
// with their tokens and known clients goes, the team's devices stay.
func (s *server) handleMemberDelete(w http.ResponseWriter, r *http.Request) error {
	id, err := memberID(r)
	if err != nil {
		return err
	}
	m, err := s.store.DeleteMember(r.Context(), authFrom(r.Context()).user.TeamID, id,
		auditOf(r.Context(), func(m *model.Member) map[string]any {
			detail := map[string]any{"member_id": m.ID, "name": m.Name, "email": m.Email}
			if m.Pending { // an invite revoked, not a member removed
				detail["pending"] = true
			}
			return detail
		}))
	if err != nil {
		return err
	}
	if !m.Pending { // an invite's email may be another team's user's
		s.limiter.forget(m.Email) // the store forgot their known clients with them
	}
	writeMessage(w, http.StatusOK, "Member removed.")
	return nil
}
