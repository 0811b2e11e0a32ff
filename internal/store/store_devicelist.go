package store

// The store's device list: every device of a team, read as a stream, or
// one page of those that match a filter (devicelist.go).

import (
	"context"
	"devicehub/internal/model"
	"strings"
)

// DeviceFilter selects devices of a team: those in any of statuses, of
// the platform and board keys, whose name or uid holds q (ASCII letters
// in any case); an empty field selects all. after and limit cut a page.
type DeviceFilter struct {
	Statuses           []model.DeviceStatus
	Platform, Board, Q string
	After              int64 // the page starts after the device with this row id
	Limit              int   // 0: no limit
}

// matchingDevices is the FROM and WHERE of the team's devices that match
// f, the page's cut aside, and its arguments. Each condition has an index
// that leads with team_id and ends with id (schema.sql, version 7; renamed in 10), so a
// page is a walk along an index from the cursor, whatever its number.
func matchingDevices(teamID int64, f DeviceFilter) (string, []any) {
	where := []string{"d.team_id = ?"}
	args := []any{teamID}
	if len(f.Statuses) > 0 {
		where = append(where, "d.status IN (?"+strings.Repeat(", ?", len(f.Statuses)-1)+")")
		for _, st := range f.Statuses {
			args = append(args, st)
		}
	}
	if f.Platform != "" {
		where = append(where, "d.platform_id = (SELECT id FROM platforms WHERE team_id = ? AND key = ?)")
		args = append(args, teamID, f.Platform)
	}
	if f.Board != "" {
		where = append(where, "d.board_id = (SELECT id FROM boards WHERE team_id = ? AND key = ?)")
		args = append(args, teamID, f.Board)
	}
	if f.Q != "" {
		like := "%" + likeEscaper.Replace(f.Q) + "%"
		where = append(where, `(d.name LIKE ? ESCAPE '\' OR d.uid LIKE ? ESCAPE '\')`)
		args = append(args, like, like)
	}
	return " WHERE " + strings.Join(where, " AND "), args
}

// likeEscaper makes text match itself in a LIKE pattern with ESCAPE '\'.
var likeEscaper = strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`)

// EachDevice hands fn each of the team's devices that match f, as Device
// summaries in the list's order (oldest first), as they are read: however
// large the fleet, no more than one is held.
func (s *Store) EachDevice(ctx context.Context, teamID int64, f DeviceFilter, fn func(*model.DeviceSummary) error) error {
	query, args := deviceListQuery(teamID, f)
	return queryEach(ctx, s.reader, scanSummary, fn, query, args...)
}

// deviceListQuery is the query of EachDevice.
func deviceListQuery(teamID int64, f DeviceFilter) (string, []any) {
	where, args := matchingDevices(teamID, f)
	query := `SELECT ` + summaryColumns + summaryFrom + where
	if f.After > 0 {
		query += ` AND d.id > ?`
		args = append(args, f.After)
	}
	query += ` ORDER BY d.id`
	if f.Limit > 0 {
		query += ` LIMIT ?`
		args = append(args, f.Limit)
	}
	return query, args
}

// CountDevices returns how many of the team's devices match f, the
// page's cut aside.
func (s *Store) CountDevices(ctx context.Context, teamID int64, f DeviceFilter) (int, error) {
	query, args := deviceCountQuery(teamID, f)
	var n int
	err := s.reader.QueryRowContext(ctx, query, args...).Scan(&n)
	return n, err
}

// deviceCountQuery is the query of CountDevices: a count over one index
// where a filter has one.
func deviceCountQuery(teamID int64, f DeviceFilter) (string, []any) {
	where, args := matchingDevices(teamID, f)
	return `SELECT count(*) FROM devices d` + where, args
}
