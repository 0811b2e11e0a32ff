package main

// Roles and the audit log: every write goes through write, admin or own,
// which check the caller's role and give the handler the write's audit
// entry. The handler hands it to the store write it describes (auditOf,
// or takeAudit for a command), which inserts it in its own transaction:
// no write commits without its entry, and an entry that cannot be
// inserted undoes its write. Once the handler has answered, the team's
// open streams hear of it (audited).

import (
	"context"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/csv"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
)

// errForbidden is a write the caller's role does not allow.
var errForbidden = errors.New("role does not allow this")

// write lets members with the role user or admin through to h, and
// records the write as action; a viewer gets errForbidden.
func (s *server) write(action string, h apiHandler) apiHandler {
	return s.audited(model.RoleUser, action, h)
}

// admin lets only admins through to h, and records the write as action.
func (s *server) admin(action string, h apiHandler) apiHandler {
	return s.audited(model.RoleAdmin, action, h)
}

// own lets any member through to h, for a write to what is theirs alone
// (their tokens: a viewer too must be able to revoke a token that
// leaked), and records the write as action.
func (s *server) own(action string, h apiHandler) apiHandler {
	return s.audited(model.RoleViewer, action, h)
}

type auditKey struct{}

// auditRecord is a write's audit entry while its handler runs. The
// handler hands it to the store write that commits it in its own
// transaction (auditOf, takeAudit), or, for a write the store does not
// make, commits it alone (commitAudit); withDevice names the device
// first (noteAuditDevice).
type auditRecord struct {
	s     *server
	entry *model.AuditEntry
	done  bool // taken: handed to a write, or committed alone
	told  bool // the team's streams have heard of it
}

func (s *server) audited(need model.Role, action string, h apiHandler) apiHandler {
	return func(w http.ResponseWriter, r *http.Request) error {
		u := authFrom(r.Context()).user
		if !u.Role.May(need) {
			return errForbidden
		}
		rec := &auditRecord{s: s, entry: &model.AuditEntry{Action: action, TeamID: u.TeamID,
			Actor: &model.ActorRef{ID: u.ID, Name: u.Name}, Detail: json.RawMessage(`{}`)}}
		if err := h(w, r.WithContext(context.WithValue(r.Context(), auditKey{}, rec))); err != nil {
			return err // its entry, if the write committed, was told then (auditCommitted)
		}
		rec.tell()
		return nil
	}
}

// tell tells the team's streams of the entry once it is committed (its
// id set), once.
func (rec *auditRecord) tell() {
	if rec.entry.ID != 0 && !rec.told {
		rec.told = true
		rec.s.events.audited(rec.entry)
	}
}

// auditCommitted tells the team's streams of the request's entry now,
// for a handler whose write has committed and that goes on (to read
// what it answers with, to wait): the wrapper, which tells it once the
// handler has answered, would not if that failed, nor in the order of
// the events the handler waits for.
func auditCommitted(ctx context.Context) {
	if rec, ok := ctx.Value(auditKey{}).(*auditRecord); ok {
		rec.tell()
	}
}

// noteAuditDevice names the device in the request's audit entry; nothing
// for a request that is not a write.
func noteAuditDevice(ctx context.Context, deviceUID string) {
	if rec, ok := ctx.Value(auditKey{}).(*auditRecord); ok {
		rec.entry.DeviceUID = &deviceUID
	}
}

// auditOf hands the request's audit entry to a store write, which
// inserts it in its own transaction (store.Audit), its detail made by
// detail (nil: {}) from what the write returns: the member it invited,
// the name it replaced. nil for a request that is not a write.
func auditOf[T any](ctx context.Context, detail func(T) map[string]any) store.Audit[T] {
	rec, ok := ctx.Value(auditKey{}).(*auditRecord)
	if !ok {
		return nil
	}
	return func(v T) *model.AuditEntry {
		var d map[string]any
		if detail != nil {
			d = detail(v)
		}
		if !rec.take(d) {
			return nil
		}
		return rec.entry
	}
}

// takeAudit hands the request's audit entry, with detail, to a command's
// record, which commits it in its own transaction: the command's id is
// drawn before, as its device is told it. nil for a request that is not
// a write.
func takeAudit(ctx context.Context, detail map[string]any) *model.AuditEntry {
	rec, ok := ctx.Value(auditKey{}).(*auditRecord)
	if !ok || !rec.take(detail) {
		return nil
	}
	return rec.entry
}

// commitAudit commits the request's audit entry alone, with detail
// (unless nil), for a write the store does not make in one transaction
// with it (a broker login's). A failure to record is logged: the write
// stands. Nothing for a request that is not a write.
func commitAudit(ctx context.Context, detail map[string]any) {
	rec, ok := ctx.Value(auditKey{}).(*auditRecord)
	if !ok || !rec.take(detail) {
		return
	}
	if err := rec.s.store.AddAudit(rec.entry); err != nil {
		rec.s.log.Error("write audit entry", "action", rec.entry.Action, "err", err)
		return
	}
	rec.tell()
}

// take completes the entry with detail and stamps it for its commit,
// once: false when it was taken before.
func (rec *auditRecord) take(detail map[string]any) bool {
	if rec.done {
		return false
	}
	rec.done = true
	if detail != nil {
		rec.entry.Detail, _ = json.Marshal(detail)
	}
	rec.entry.At = rec.s.store.Timestamp()
	return true
}

// handleAuditLog serves GET /v1/user/team/audit: newest first, ?limit=
// 1–100 (25), ?before=<id> for the entries older than that one, filtered
// by ?actor=<member id> (who made it), ?member=<member id> (made by that
// member or about them), ?device=<uid> and ?action=<name, or a prefix
// ending in ".">; ?format=csv answers the same entries as CSV.
func (s *server) handleAuditLog(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	var e fieldErrors
	f := store.AuditFilter{TeamID: authFrom(r.Context()).user.TeamID, Limit: historyLimit(&e, q)}
	f.Before = positiveID(&e, q, "before", "must be the id of an audit entry.")
	f.ActorID = positiveID(&e, q, "actor", "must be the id of a member.")
	f.MemberID = positiveID(&e, q, "member", "must be the id of a member.")
	f.DeviceUID = q.Get("device")
	if f.Action = q.Get("action"); f.Action != "" && !auditActionPattern.MatchString(f.Action) {
		e.add("action", `must be an action, such as member.update, or a prefix of one ending in ".", such as member.`)
	}
	csv := q.Get("format") == "csv"
	if q.Has("format") && !csv {
		e.add("format", "must be csv.")
	}
	if err := e.err(); err != nil {
		return err
	}
	list, err := s.store.AuditLog(r.Context(), f)
	if err != nil {
		return err
	}
	if csv {
		return writeAuditCSV(w, list)
	}
	writeJSON(w, http.StatusOK, dataBody{list})
	return nil
}

// auditActionPattern is an action (member.update) or a prefix of actions
// (member.).
var auditActionPattern = regexp.MustCompile(`^[a-z_]+\.([a-z_]+)?$`)

// positiveID reads the query parameter name as an id (0 when absent),
// noting msg as its field error when it is not one.
func positiveID(e *fieldErrors, q url.Values, name, msg string) int64 {
	if !q.Has(name) {
		return 0
	}
	n, err := strconv.ParseInt(q.Get(name), 10, 64)
	if err != nil || n < 1 {
		e.add(name, "%s", msg)
	}
	return n
}

// writeAuditCSV answers the entries as CSV with a header line. A cell that
// a spreadsheet would take for a formula (=, +, -, @ first) gets a
// leading apostrophe: names and details are members' text (OWASP's CSV
// injection advice).
func writeAuditCSV(w http.ResponseWriter, list []*model.AuditEntry) error {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	w.Header().Set("Content-Disposition", `attachment; filename="audit.csv"`)
	w.WriteHeader(http.StatusOK)
	cw := csv.NewWriter(w)
	cw.Write([]string{"id", "at", "actor_id", "actor_name", "action", "device_uid", "detail"})
	for _, e := range list {
		actorID, actorName, device := "", "", ""
		if e.Actor != nil {
			actorID, actorName = strconv.FormatInt(e.Actor.ID, 10), e.Actor.Name
		}
		if e.DeviceUID != nil {
			device = *e.DeviceUID
		}
		row := []string{strconv.FormatInt(e.ID, 10), e.At, actorID, actorName, e.Action, device, string(e.Detail)}
		for i, cell := range row {
			if cell != "" && strings.ContainsRune("=+-@\t\r", rune(cell[0])) {
				row[i] = "'" + cell
			}
		}
		cw.Write(row)
	}
	cw.Flush() // an error here is a client gone: the answer had begun, nothing more to say
	return nil
}
