package store

import (
	"context"
	"devicehub/internal/mqttlink"
	"fmt"
	"testing"
	"time"
)

// BenchmarkRestartStatuses: the statuses of a restart, each device's
// first since its import, in flushes of 10,000, with history kept and
// without: ns/op is per status.
func BenchmarkRestartStatuses(b *testing.B) {
	const devices, flush = 100_000, 10_000
	for _, days := range []int{0, 30} {
		b.Run(fmt.Sprintf("history-days=%d", days), func(b *testing.B) {
			ctx := context.Background()
			online := "online"
			for range b.N {
				b.StopTimer()
				st, err := Open(ctx, b.TempDir(), time.Now, Quotas{HistoryDays: days})
				if err != nil {
					b.Fatal(err)
				}
				id, err := st.CreateUser(ctx, "bench", "bench@example.com", "user", "x", "")
				if err != nil {
					b.Fatal(err)
				}
				u, _ := st.userByID(ctx, id)
				_, err = st.ImportDevices(ctx, u.TeamID, 1883, func(add func(NewDevice) error) error {
					for i := range devices {
						if err := add(NewDevice{UID: fmt.Sprintf("esp32_s%d", i), Platform: "esp32", Board: "devkitc"}); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				for from := 0; from < devices; from += flush {
					reports := map[string]*mqttlink.Report{}
					for i := from; i < from+flush; i++ {
						reports[fmt.Sprintf("esp32_s%d", i)] = &mqttlink.Report{Seen: time.Now(), Status: &online}
					}
					if _, err := st.ApplyDeviceMessages(ctx, reports, nil); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				st.Close()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*devices), "ns/status")
		})
	}
}
