//go:build !race

package main

// raceEnabled: the tests run under the race detector (go test -race).
const raceEnabled = false
