package main

import "context"

// fleetCounts are the gauges /metrics (metrics.go) reads from the
// database on each scrape.
type fleetCounts struct {
	devices  map[deviceStatus]int64 // by status
	commands map[[2]string]int64    // by kind and state
	rollouts map[rolloutState]int64 // by state
}

// fleetCounts counts devices, command records and rollouts, in one read.
func (s *store) fleetCounts(ctx context.Context) (fleetCounts, error) {
	c := fleetCounts{map[deviceStatus]int64{}, map[[2]string]int64{}, map[rolloutState]int64{}}
	_, err := queryAll(ctx, s.reader, func(row scanner) (struct{}, error) {
		var table, a, b string
		var n int64
		err := row.Scan(&table, &a, &b, &n)
		switch table {
		case "devices":
			c.devices[deviceStatus(a)] = n
		case "commands":
			c.commands[[2]string{a, b}] = n
		case "rollouts":
			c.rollouts[rolloutState(a)] = n
		}
		return struct{}{}, err
	}, `SELECT 'devices', status, '', count(*) FROM devices GROUP BY status
		UNION ALL SELECT 'commands', kind, state, count(*) FROM commands GROUP BY kind, state
		UNION ALL SELECT 'rollouts', state, '', count(*) FROM rollouts GROUP BY state`)
	return c, err
}
