package main

// The store's device list: every device of a team, read as a stream, or
// one page of those that match a filter (devicelist.go).

import (
	"context"
	"strings"
)

// deviceFilter selects devices of a team: those in any of statuses, of
// the platform and board keys, whose name or uid holds q (ASCII letters
// in any case); an empty field selects all. after and limit cut a page.
type deviceFilter struct {
	statuses           []deviceStatus
	platform, board, q string
	after              int64 // the page starts after the device with this row id
	limit              int   // 0: no limit
}

// matchingDevices is the FROM and WHERE of the team's devices that match
// f, the page's cut aside, and its arguments. Each condition has an index
// that leads with team_id and ends with id (schema.sql, version 7; renamed in 10), so a
// page is a walk along an index from the cursor, whatever its number.
func matchingDevices(teamID int64, f deviceFilter) (string, []any) {
	where := []string{"d.team_id = ?"}
	args := []any{teamID}
	if len(f.statuses) > 0 {
		where = append(where, "d.status IN (?"+strings.Repeat(", ?", len(f.statuses)-1)+")")
		for _, st := range f.statuses {
			args = append(args, st)
		}
	}
	if f.platform != "" {
		where = append(where, "d.platform_id = (SELECT id FROM platforms WHERE team_id = ? AND key = ?)")
		args = append(args, teamID, f.platform)
	}
	if f.board != "" {
		where = append(where, "d.board_id = (SELECT id FROM boards WHERE team_id = ? AND key = ?)")
		args = append(args, teamID, f.board)
	}
	if f.q != "" {
		like := "%" + likeEscaper.Replace(f.q) + "%"
		where = append(where, `(d.name LIKE ? ESCAPE '\' OR d.uid LIKE ? ESCAPE '\')`)
		args = append(args, like, like)
	}
	return " WHERE " + strings.Join(where, " AND "), args
}

// likeEscaper makes text match itself in a LIKE pattern with ESCAPE '\'.
var likeEscaper = strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`)

// eachDevice hands fn each of the team's devices that match f, as Device
// summaries in the list's order (oldest first), as they are read: however
// large the fleet, no more than one is held.
func (s *store) eachDevice(ctx context.Context, teamID int64, f deviceFilter, fn func(*deviceSummary) error) error {
	query, args := deviceListQuery(teamID, f)
	return queryEach(ctx, s.reader, scanSummary, fn, query, args...)
}

// deviceListQuery is the query of eachDevice.
func deviceListQuery(teamID int64, f deviceFilter) (string, []any) {
	where, args := matchingDevices(teamID, f)
	query := `SELECT ` + summaryColumns + summaryFrom + where
	if f.after > 0 {
		query += ` AND d.id > ?`
		args = append(args, f.after)
	}
	query += ` ORDER BY d.id`
	if f.limit > 0 {
		query += ` LIMIT ?`
		args = append(args, f.limit)
	}
	return query, args
}

// countDevices returns how many of the team's devices match f, the
// page's cut aside.
func (s *store) countDevices(ctx context.Context, teamID int64, f deviceFilter) (int, error) {
	query, args := deviceCountQuery(teamID, f)
	var n int
	err := s.reader.QueryRowContext(ctx, query, args...).Scan(&n)
	return n, err
}

// deviceCountQuery is the query of countDevices: a count over one index
// where a filter has one.
func deviceCountQuery(teamID int64, f deviceFilter) (string, []any) {
	where, args := matchingDevices(teamID, f)
	return `SELECT count(*) FROM devices d` + where, args
}
