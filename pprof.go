//go:build pprof

package main

// Built only with -tags pprof, as bench/load.sh does with PROFILE=1: the
// service then serves net/http/pprof on $DEVICEHUB_PPROF_ADDR, so that
// the load run can take CPU and allocation profiles of the running
// binary. A normal build has none of it.

import (
	"net/http"
	_ "net/http/pprof"
	"os"
)

func init() {
	if addr := os.Getenv("DEVICEHUB_PPROF_ADDR"); addr != "" {
		go http.ListenAndServe(addr, nil)
	}
}
