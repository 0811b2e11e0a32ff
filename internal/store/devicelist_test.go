package store

import (
	"context"
	"strings"
	"testing"

	"devicehub/internal/model"
)

// TestDeviceListPlans: each page and count walks one index from its
// cursor, the filter's, without sorting: the millionth device's page
// costs what the first does. So does a rollout's current batch.
func TestDeviceListPlans(t *testing.T) {
	t.Parallel()
	st := testStore(t)
	plan := func(query string, args ...any) string {
		t.Helper()
		var steps []string
		rows, err := st.reader.QueryContext(context.Background(), "EXPLAIN QUERY PLAN "+query, args...)
		must(t, err)
		defer rows.Close()
		for rows.Next() {
			var id, parent, unused int
			var step string
			must(t, rows.Scan(&id, &parent, &unused, &step))
			steps = append(steps, step)
		}
		must(t, rows.Err())
		return strings.Join(steps, "; ")
	}
	tests := []struct {
		filter      DeviceFilter
		page, count string // the index each walks
	}{
		{DeviceFilter{}, "devices_team (team_id=? AND rowid>?)", "devices_team (team_id=?)"},
		{DeviceFilter{Statuses: []model.DeviceStatus{"online"}}, "devices_team_status (team_id=? AND status=? AND rowid>?)", "devices_team_status (team_id=? AND status=?)"},
		{DeviceFilter{Statuses: []model.DeviceStatus{"online", "offline"}}, "devices_team (team_id=? AND rowid>?)", "devices_team_status (team_id=? AND status=?)"},
		{DeviceFilter{Platform: "esp32"}, "devices_team_platform (team_id=? AND platform_id=? AND rowid>?)", "devices_team_platform (team_id=? AND platform_id=?)"},
		{DeviceFilter{Board: "d1"}, "devices_team_board (team_id=? AND board_id=? AND rowid>?)", "devices_team_board (team_id=? AND board_id=?)"},
		{DeviceFilter{Q: "kitchen"}, "devices_team (team_id=? AND rowid>?)", "devices_team (team_id=?)"},
	}
	for _, tt := range tests {
		tt.filter.After, tt.filter.Limit = 1, 100
		pageQuery, pageArgs := deviceListQuery(1, tt.filter)
		countQuery, countArgs := deviceCountQuery(1, tt.filter)
		page, count := plan(pageQuery, pageArgs...), plan(countQuery, countArgs...)
		if !strings.Contains(page, "SEARCH d USING INDEX "+tt.page) || strings.Contains(page, "TEMP B-TREE") {
			t.Errorf("%+v: page plan %q, want a walk along %s", tt.filter, page, tt.page)
		}
		if !strings.Contains(count, "SEARCH d USING COVERING INDEX "+tt.count) && !strings.Contains(count, "SEARCH d USING INDEX "+tt.count) {
			t.Errorf("%+v: count plan %q, want %s", tt.filter, count, tt.count)
		}
	}
	if got := plan(rolloutBatchStart, 1); strings.Count(got, "COVERING INDEX rollout_devices_state (rollout_id=? AND state=?)") != 3 {
		t.Errorf("a rollout's current batch: plan %q, want three seeks in rollout_devices_state", got)
	}
}
