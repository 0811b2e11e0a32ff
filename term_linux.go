//go:build linux

package main

import (
	"os"
	"syscall"
	"unsafe"
)

// termios reads the terminal settings of f; it fails when f is no terminal.
func termios(f *os.File) (*syscall.Termios, error) {
	var t syscall.Termios
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TCGETS, uintptr(unsafe.Pointer(&t))); errno != 0 {
		return nil, errno
	}
	return &t, nil
}

func setTermios(f *os.File, t *syscall.Termios) error {
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, f.Fd(), syscall.TCSETS, uintptr(unsafe.Pointer(t))); errno != 0 {
		return errno
	}
	return nil
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := termios(f)
	return err == nil
}

// echoOff stops the terminal f from echoing what is typed, line by line
// (Enter ends the line, Ctrl-C still interrupts), and returns the
// function that restores its settings.
func echoOff(f *os.File) (restore func(), err error) {
	old, err := termios(f)
	if err != nil {
		return nil, err
	}
	t := *old
	t.Lflag &^= syscall.ECHO
	t.Lflag |= syscall.ICANON | syscall.ISIG
	t.Iflag |= syscall.ICRNL
	if err := setTermios(f, &t); err != nil {
		return nil, err
	}
	return func() { setTermios(f, old) }, nil
}
