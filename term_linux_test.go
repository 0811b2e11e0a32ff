//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// openPTY opens a pseudo-terminal: the terminal side is what the program
// reads as stdin, the controller side is the keyboard and screen.
func openPTY(t *testing.T) (controller, terminal *os.File) {
	t.Helper()
	controller, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	t.Cleanup(func() { controller.Close() })
	var unlock int32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, controller.Fd(), syscall.TIOCSPTLCK, uintptr(unsafe.Pointer(&unlock))); errno != 0 {
		t.Fatalf("unlock pty: %v", errno)
	}
	var n uint32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, controller.Fd(), syscall.TIOCGPTN, uintptr(unsafe.Pointer(&n))); errno != 0 {
		t.Fatalf("pty number: %v", errno)
	}
	terminal, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("open pty terminal side: %v", err)
	}
	t.Cleanup(func() { terminal.Close() })
	return controller, terminal
}

// echoing reports whether the terminal echoes what is typed.
func echoing(t *testing.T, f *os.File) bool {
	t.Helper()
	tio, err := termios(f)
	must(t, err)
	return tio.Lflag&syscall.ECHO != 0
}

// ttySession runs 'user add' with a terminal as stdin, as a person at a
// keyboard would.
type ttySession struct {
	controller, terminal *os.File
	screen               *syncBuffer // what the terminal showed (its echo)
	stderr               *syncBuffer
	done                 chan error
	cancel               context.CancelFunc
}

func startTTYUserAdd(t *testing.T, dir string) *ttySession {
	t.Helper()
	controller, terminal := openPTY(t)
	if !echoing(t, terminal) {
		t.Fatal("a fresh pty does not echo; the test cannot tell echo off from on")
	}
	s := &ttySession{controller: controller, terminal: terminal, screen: &syncBuffer{}, stderr: &syncBuffer{}, done: make(chan error, 1)}
	go io.Copy(s.screen, controller)
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	t.Cleanup(cancel)
	go func() {
		s.done <- run(ctx, []string{"user", "add", "-data", dir, "-email", "tty@example.com", "-name", "TTY"},
			func(string) string { return "" }, terminal, io.Discard, s.stderr)
	}()
	return s
}

// answer waits for the prompt, checks that echo is off, and types line.
func (s *ttySession) answer(t *testing.T, prompt, line string) {
	t.Helper()
	eventually(t, 10*time.Second, "the prompt "+prompt, func() bool { return strings.HasSuffix(s.stderr.String(), prompt) })
	if echoing(t, s.terminal) {
		t.Errorf("at %q the terminal echoes: the password would show", prompt)
	}
	if _, err := s.controller.Write([]byte(line + "\r")); err != nil {
		t.Fatal(err)
	}
}

func (s *ttySession) wait(t *testing.T) error {
	t.Helper()
	return receive(t, s.done, 60*time.Second, "return of user add")
}

// TestUserAddPromptsOnTerminal: on a terminal, user add asks twice for
// the password without echoing it, and restores the terminal after.
func TestUserAddPromptsOnTerminal(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := startTTYUserAdd(t, dir)
	s.answer(t, "Password: ", "typed secret")
	s.answer(t, "Repeat password: ", "typed secret")
	if err := s.wait(t); err != nil {
		t.Fatalf("user add on a terminal: %v\n%s", err, s.stderr)
	}
	if !echoing(t, s.terminal) {
		t.Error("after user add the terminal does not echo: its settings were not restored")
	}
	time.Sleep(100 * time.Millisecond) // let the screen copy catch up
	if strings.Contains(s.screen.String(), "typed secret") {
		t.Errorf("the terminal showed the password: %q", s.screen)
	}
	u, err := storeAt(t, dir).UserByEmail(context.Background(), "tty@example.com")
	if err != nil || !checkPassword(u.PasswordHash, "typed secret") {
		t.Errorf("user from the terminal: got %v, %v; want the typed password", u, err)
	}
}

// TestUserAddTerminalMismatch: two different answers are refused, and
// Ctrl-C (a cancelled context) leaves the terminal echoing again.
func TestUserAddTerminalMismatch(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	s := startTTYUserAdd(t, dir)
	s.answer(t, "Password: ", "one")
	s.answer(t, "Repeat password: ", "two")
	if err := s.wait(t); !errors.As(err, new(usageError)) || !strings.Contains(err.Error(), "do not match") {
		t.Errorf("different answers: got %v, want a usage error saying they do not match", err)
	}
	if !echoing(t, s.terminal) {
		t.Error("after a refused password the terminal does not echo")
	}

	s = startTTYUserAdd(t, dir)
	eventually(t, 10*time.Second, "the prompt", func() bool { return strings.HasSuffix(s.stderr.String(), "Password: ") })
	s.cancel()
	if err := s.wait(t); !errors.Is(err, context.Canceled) {
		t.Errorf("interrupted at the prompt: got %v, want context.Canceled", err)
	}
	if !echoing(t, s.terminal) {
		t.Error("after an interrupted prompt the terminal does not echo")
	}
	wantDB(t, storeAt(t, dir), "0", `SELECT count(*) FROM users`) // refused and interrupted adds left no user
}
