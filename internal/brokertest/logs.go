package brokertest

import (
	"bytes"
	"log/slog"
	"regexp"
	"sync"
	"testing"
)

// LogBuffer is a buffer that a logger writes to while the test reads it.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *LogBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *LogBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Take returns what was written since the last Take.
func (b *LogBuffer) Take() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.b.String()
	b.b.Reset()
	return s
}

// CaptureLogs returns a logger, at debug level, that writes into a buffer
// the test may read; the buffer is shown in the test's output if the test
// fails. It is the one way tests capture logs.
func CaptureLogs(tb testing.TB) (*slog.Logger, *LogBuffer) {
	logs := &LogBuffer{}
	tb.Cleanup(func() {
		if s := logs.String(); tb.Failed() && s != "" {
			tb.Logf("captured log:\n%s", s)
		}
	})
	return slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})), logs
}

// LogLines returns the lines of log that match re.
func LogLines(log *LogBuffer, re string) []string {
	return regexp.MustCompile(`(?m)^.*`+re+`.*$`).FindAllString(log.String(), -1)
}
