package mqttlink

import (
	"testing"
	"time"
)

// TestTrackerClose: close waits for what runs, and afterwards nothing
// more runs: a closed connection's handlers log nothing after its Close.
func TestTrackerClose(t *testing.T) {
	var tr tracker
	entered, leave := make(chan struct{}), make(chan struct{})
	tr.goDo(func() { close(entered); <-leave })
	<-entered
	closed := make(chan struct{})
	go func() { tr.close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("close returned while a goroutine of the connection ran")
	case <-time.After(100 * time.Millisecond):
	}
	close(leave)
	<-closed
	ran := false
	tr.do(func() { ran = true })
	tr.goDo(func() { ran = true })
	if ran {
		t.Error("a handler ran after close")
	}
}
