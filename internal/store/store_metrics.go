package store

import (
	"context"
	"devicehub/internal/model"
)

// FleetCounts are the gauges /metrics (metrics.go) reads from the
// database on each scrape.
type FleetCounts struct {
	Devices  map[model.DeviceStatus]int64 // by status
	Commands map[[2]string]int64          // by kind and state
	Rollouts map[model.RolloutState]int64 // by state
}

// FleetCounts counts devices, command records and rollouts, in one read.
func (s *Store) FleetCounts(ctx context.Context) (FleetCounts, error) {
	c := FleetCounts{map[model.DeviceStatus]int64{}, map[[2]string]int64{}, map[model.RolloutState]int64{}}
	_, err := queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
		var table, a, b string
		var n int64
		err := row.Scan(&table, &a, &b, &n)
		switch table {
		case "devices":
			c.Devices[model.DeviceStatus(a)] = n
		case "commands":
			c.Commands[[2]string{a, b}] = n
		case "rollouts":
			c.Rollouts[model.RolloutState(a)] = n
		}
		return struct{}{}, err
	}, `SELECT 'devices', status, '', count(*) FROM devices GROUP BY status
		UNION ALL SELECT 'commands', kind, state, count(*) FROM commands GROUP BY kind, state
		UNION ALL SELECT 'rollouts', state, '', count(*) FROM rollouts GROUP BY state`)
	return c, err
}
