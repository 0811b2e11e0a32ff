// Command mqttload drives the MQTT side of the load run.
//
//	mqttload -broker tcp://127.0.0.1:1883 -mode telemetry -uids uids.txt -reports 20 -api http://127.0.0.1:8080 -token T
//	mqttload -broker tcp://127.0.0.1:1883 -mode telemetry -uids uids.txt -reports 60 -clients 1 -bare
//	mqttload -broker tcp://127.0.0.1:1883 -mode count -idle 3s
//	mqttload -broker tcp://127.0.0.1:1883 -mode online -uids uids.txt
//	mqttload -broker tcp://127.0.0.1:1883 -mode capture
//
// telemetry: every uid publishes -reports telemetry messages at QoS 1, each
// a device's report as docs/devices.md describes it (rssi, heap_free,
// uptime_s and two metrics: four series of history), the last one with a
// marker; then the API is polled until every device shows its last report, or -stale-after has passed since the last publish
// (the devices that have not are stale); prints messages/s from first
// publish to all applied. With -bare a subscriber of its own
// (devices/+/telemetry, QoS 1) stands for devicehub: messages/s from first
// publish to the last message it received, and how many it did. -round
// shifts the reports' rssi (-r - 100*round), so that a run's last report
// differs from the run's before on the same devices. -rate spreads the
// messages evenly (10,000 devices every 10 s: -rate 1000).
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
	idle := flag.Duration("idle", 3*time.Second, "count: stop after this long without a message; telemetry -bare: stop waiting")
	bare := flag.Bool("bare", false, "telemetry: count the messages with a subscriber of its own instead of devicehub's API")
	round := flag.Int("round", 0, "telemetry: the run's number, which shifts rssi")
	staleAfter := flag.Duration("stale-after", 30*time.Second, "telemetry: stop polling the API this long after the last publish")
	rate := flag.Float64("rate", 0, "telemetry: messages per second over all connections (0: as fast as the broker takes them)")
	flag.Parse()
	switch *mode {
	case "telemetry":
		burst := burst{broker: *broker, reports: *reports, clients: *clients, round: *round, rate: *rate}
		burst.uids = readUIDs(*uidsFile)
		if *bare {
			burst.bare(*idle)
		} else {
			burst.applied(*api, *token, *staleAfter)
		}
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

func readUIDs(file string) []string {
	data, err := os.ReadFile(file)
	if err != nil {
		log.Fatal(err)
	}
	return strings.Fields(string(data))
}

// burst is a telemetry run: every uid sends reports over clients
// connections.
type burst struct {
	broker                  string
	uids                    []string
	reports, clients, round int
	rate                    float64 // messages per second, 0 for no limit
}

// send publishes the burst at QoS 1 and returns when the broker has
// acknowledged every message.
func (b burst) send() {
	conns := make([]mqtt.Client, b.clients)
	for i := range conns {
		conns[i] = connect(b.broker, fmt.Sprintf("load-%d", i))
	}
	start := time.Now()
	var wg sync.WaitGroup
	for ci, c := range conns {
		wg.Go(func() {
			var pending []mqtt.Token
			for r := 1; r <= b.reports; r++ {
				for i := ci; i < len(b.uids); i += b.clients {
					b.pace(start, len(pending)*b.clients)
					pending = append(pending, c.Publish("devices/"+b.uids[i]+"/telemetry", 1, false, report(i, r, b.round)))
				}
			}
			for _, t := range pending {
				if t.Wait(); t.Error() != nil {
					log.Fatal(t.Error())
				}
			}
		})
	}
	wg.Wait()
}

// pace waits, with a rate, until the sent-th message is due.
func (b burst) pace(start time.Time, sent int) {
	if b.rate > 0 {
		time.Sleep(time.Until(start.Add(time.Duration(float64(sent) / b.rate * float64(time.Second)))))
	}
}

func (b burst) total() int { return len(b.uids) * b.reports }

// applied sends the burst and polls devicehub's device list until every
// device shows its last report, or staleAfter has passed since the burst
// was sent.
func (b burst) applied(api, token string, staleAfter time.Duration) {
	start := time.Now()
	b.send()
	published := time.Since(start)
	last := float64(-b.reports - 100*b.round) // every device's last rssi
	left := map[string]bool{}
	for _, u := range b.uids {
		left[u] = true
	}
	for len(left) > 0 && time.Since(start) < published+staleAfter {
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
			if d.Data.LastRSSI != nil && *d.Data.LastRSSI == last {
				delete(left, u)
			}
		}
		if len(left) > 0 {
			time.Sleep(20 * time.Millisecond)
		}
	}
	applied := time.Since(start)
	n := b.total()
	fmt.Printf("telemetry: %d messages from %d devices; published in %v (%.0f msg/s); all last reports visible after %v (%.0f msg/s applied); %d devices stale\n",
		n, len(b.uids), published.Round(time.Millisecond), float64(n)/published.Seconds(), applied.Round(time.Millisecond), float64(n)/applied.Seconds(), len(left))
}

// bare sends the burst to a subscriber of its own, and waits until it
// has received every message or none came for idle; the devices whose
// last report it did not receive are stale.
func (b burst) bare(idle time.Duration) {
	sub := connect(b.broker, "load-bare")
	var got, lastAt, fresh atomic.Int64
	marker := fmt.Sprintf(`"rssi":%d,`, -b.reports-100*b.round)
	t := sub.Subscribe("devices/+/telemetry", 1, func(_ mqtt.Client, m mqtt.Message) {
		got.Add(1)
		if strings.Contains(string(m.Payload()), marker) {
			fresh.Add(1)
		}
		lastAt.Store(time.Now().UnixNano())
	})
	if !t.WaitTimeout(5*time.Second) || t.Error() != nil {
		log.Fatalf("subscribe: %v", t.Error())
	}
	start := time.Now()
	b.send()
	n := b.total()
	for got.Load() < int64(n) && time.Since(time.Unix(0, max(lastAt.Load(), start.UnixNano()))) < idle {
		time.Sleep(10 * time.Millisecond)
	}
	took := time.Unix(0, lastAt.Load()).Sub(start)
	fmt.Printf("bare subscriber: %d of %d messages received in %v (%.0f msg/s); %d devices stale\n",
		got.Load(), n, took.Round(time.Millisecond), float64(got.Load())/took.Seconds(), len(b.uids)-int(fresh.Load()))
}

// report is device i's r-th telemetry, as docs/devices.md describes a
// device's report: rssi, heap_free, uptime_s and two metrics (four
// series kept as history), with its address and firmware version. Its
// rssi is -r - 100*round, which the API shows once it is applied.
func report(i, r, round int) string {
	return fmt.Sprintf(`{"local_ip":"10.0.%d.%d","fw_version":"load","rssi":%d,"heap_free":%d,"uptime_s":%d,`+
		`"metrics":{"temp_c":%.1f,"battery_v":%.2f}}`, i/250, i%250, -r-100*round, 180000-16*r-i%1000, 10*r+i%10, 20+float64(i%50)/10, 3.7-float64(r%10)/100)
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
	c := connect(broker, "load-online")
	uids := readUIDs(uidsFile)
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
