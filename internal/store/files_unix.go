//go:build unix

package store

import (
	"errors"
	"os"
	"syscall"
)

// flockFile takes a flock on f, shared or exclusive; with wait false it
// reports busy instead of waiting.
func flockFile(f *os.File, shared, wait bool) (busy bool, err error) {
	how := syscall.LOCK_EX
	if shared {
		how = syscall.LOCK_SH
	}
	if !wait {
		how |= syscall.LOCK_NB
	}
	err = syscall.Flock(int(f.Fd()), how)
	if errors.Is(err, syscall.EWOULDBLOCK) {
		return true, nil
	}
	return false, err
}
