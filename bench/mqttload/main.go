// Command mqttload drives the MQTT side of the load run.
//
//	mqttload -broker tcp://127.0.0.1:1883 -mode telemetry -uids uids.txt -reports 20 -api http://127.0.0.1:8080 -token T
//	mqttload -broker tcp://127.0.0.1:1883 -mode count -idle 3s
//	mqttload -broker tcp://127.0.0.1:1883 -mode online -uids uids.txt
//	mqttload -broker tcp://127.0.0.1:1883 -mode capture
//
// telemetry: every uid publishes -reports telemetry messages at QoS 1, each
// a device's report as docs/devices.md describes it (rssi, heap_free,
// uptime_s and two metrics: four series of history), the last one with a
// marker; then the API is polled until every device shows its last report;
// prints messages/s from first publish to all applied.
// count: counts commands (devices/+/cmd, and devices/+/cmd/{id}) until none
// came for -idle.
// online: publishes a retained "online" status for every uid, and returns
// when the broker holds them all.
// capture: prints the payload of the next command.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"
)

func main() {
	broker := flag.String("broker", "tcp://127.0.0.1:1883", "broker URL")
	mode := flag.String("mode", "telemetry", "telemetry, count, online or capture")
	uidsFile := flag.String("uids", "", "file with one device uid per line")
	reports := flag.Int("reports", 20, "reports per device")
	clients := flag.Int("clients", 8, "publishing connections")
	api := flag.String("api", "http://127.0.0.1:8080", "devicehub base URL")
	token := flag.String("token", "", "API token")
	idle := flag.Duration("idle", 3*time.Second, "count: stop after this long without a message")
	flag.Parse()
	switch *mode {
	case "telemetry":
		telemetry(*broker, *uidsFile, *reports, *clients, *api, *token)
	case "count":
		count(*broker, *idle)
	case "online":
		online(*broker, *uidsFile)
	case "capture":
		capture(*broker)
	default:
		log.Fatalf("unknown mode %q", *mode)
	}
}

// commandTopics matches a command whether its topic is P/{uid}/cmd or
// P/{uid}/cmd/{id}: in MQTT, "a/#" also matches "a".
const commandTopics = "devices/+/cmd/#"

func connect(broker, id string) mqtt.Client {
	c := mqtt.NewClient(mqtt.NewClientOptions().AddBroker(broker).SetClientID(id).SetCleanSession(true).SetMaxResumePubInFlight(1000))
	if t := c.Connect(); !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		log.Fatalf("connect: %v", t.Error())
	}
	return c
}

func telemetry(broker, uidsFile string, reports, clients int, api, token string) {
	data, err := os.ReadFile(uidsFile)
	if err != nil {
		log.Fatal(err)
	}
	uids := strings.Fields(string(data))
	conns := make([]mqtt.Client, clients)
	for i := range conns {
		conns[i] = connect(broker, fmt.Sprintf("load-%d", i))
	}
	start := time.Now()
	var wg sync.WaitGroup
	for ci, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var pending []mqtt.Token
			for r := 1; r <= reports; r++ {
				for i := ci; i < len(uids); i += clients {
					pending = append(pending, c.Publish("devices/"+uids[i]+"/telemetry", 1, false, report(i, r)))
				}
			}
			for _, t := range pending {
				if t.Wait(); t.Error() != nil {
					log.Fatal(t.Error())
				}
			}
		}()
	}
	wg.Wait()
	published := time.Since(start)
	// Every device's last report is rssi = -reports.
	left := map[string]bool{}
	for _, u := range uids {
		left[u] = true
	}
	for len(left) > 0 {
		for u := range left {
			var d struct {
				Data struct {
					LastRSSI *float64 `json:"last_rssi"`
				} `json:"data"`
			}
			req, _ := http.NewRequest("GET", api+"/v1/user/devices/"+u, nil)
			req.Header.Set("Authorization", "Bearer "+token)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				log.Fatal(err)
			}
			json.NewDecoder(resp.Body).Decode(&d)
			resp.Body.Close()
			if d.Data.LastRSSI != nil && *d.Data.LastRSSI == float64(-reports) {
				delete(left, u)
			}
		}
		if len(left) > 0 {
			time.Sleep(20 * time.Millisecond)
		}
		if time.Since(start) > time.Minute {
			log.Fatalf("%d devices never showed their last report", len(left))
		}
	}
	applied := time.Since(start)
	n := len(uids) * reports
	fmt.Printf("telemetry: %d messages from %d devices; published in %v (%.0f msg/s); all last reports visible after %v (%.0f msg/s applied)\n",
		n, len(uids), published.Round(time.Millisecond), float64(n)/published.Seconds(), applied.Round(time.Millisecond), float64(n)/applied.Seconds())
}

// report is device i's r-th telemetry, as docs/devices.md describes a
// device's report: rssi, heap_free, uptime_s and two metrics (four
// series kept as history), with its address and firmware version. Its
// rssi is -r, which the API shows once it is applied.
func report(i, r int) string {
	return fmt.Sprintf(`{"local_ip":"10.0.%d.%d","fw_version":"load","rssi":%d,"heap_free":%d,"uptime_s":%d,`+
		`"metrics":{"temp_c":%.1f,"battery_v":%.2f}}`, i/250, i%250, -r, 180000-16*r-i%1000, 10*r+i%10, 20+float64(i%50)/10, 3.7-float64(r%10)/100)
}

func count(broker string, idle time.Duration) {
	c := connect(broker, "load-counter")
	var n atomic.Int64
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	t := c.Subscribe(commandTopics, 1, func(_ mqtt.Client, _ mqtt.Message) {
		n.Add(1)
		last.Store(time.Now().UnixNano())
	})
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		log.Fatalf("subscribe: %v", t.Error())
	}
	fmt.Fprintln(os.Stderr, "counting")
	for time.Since(time.Unix(0, last.Load())) < idle || n.Load() == 0 {
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Println(n.Load())
}

func online(broker, uidsFile string) {
	data, err := os.ReadFile(uidsFile)
	if err != nil {
		log.Fatal(err)
	}
	c := connect(broker, "load-online")
	uids := strings.Fields(string(data))
	// QoS 0 but the last, which is QoS 1: the broker handles one
	// client's messages in order, so its PUBACK means every one is stored.
	// (One PUBACK wait per message made a million take minutes.)
	for i, u := range uids {
		qos := byte(0)
		if i == len(uids)-1 {
			qos = 1
		}
		if t := c.Publish("devices/"+u+"/status", qos, true, "online"); qos == 1 && t.Wait() && t.Error() != nil {
			log.Fatal(t.Error())
		}
	}
	c.Disconnect(100)
}

func capture(broker string) {
	c := connect(broker, "load-capture")
	got := make(chan []byte, 1)
	t := c.Subscribe(commandTopics, 1, func(_ mqtt.Client, m mqtt.Message) {
		select {
		case got <- m.Payload():
		default:
		}
	})
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		log.Fatalf("subscribe: %v", t.Error())
	}
	fmt.Fprintln(os.Stderr, "capturing")
	select {
	case p := <-got:
		fmt.Println(string(p))
	case <-time.After(30 * time.Second):
		log.Fatal("no command within 30s")
	}
}
