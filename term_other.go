//go:build !linux

package main

import (
	"errors"
	"os"
)

// isTerminal reports false where the terminal is not supported: the
// password is then read from stdin's first line, as from a pipe.
func isTerminal(*os.File) bool { return false }

func echoOff(*os.File) (func(), error) {
	return nil, errors.New("terminal input is not supported on this system")
}
