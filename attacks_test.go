package main

// Measurements of issue 28's attacks on real sockets on loopback: how long
// a new client (and, for logins, a known one) waits for its answer while
// each attack runs. Each attack loop is bounded (a count, and the end of
// the benchmark). Run with
//
//	go test -run '^$' -bench Attack -benchtime 10x .
//
// docs/security.md has the figures.

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// answerTimes collects the answer times of one kind of client and reports
// them as benchmark metrics: the mean and the slowest, in ms, and how
// many got no answer or one other than want.
type answerTimes struct {
	name   string
	want   int
	took   []time.Duration
	missed int
}

func (a *answerTimes) add(got answer, took time.Duration) {
	a.took = append(a.took, took)
	if got.status != a.want {
		a.missed++
	}
}

func (a *answerTimes) report(b *testing.B) {
	var sum time.Duration
	for _, d := range a.took {
		sum += d
	}
	b.ReportMetric(float64(sum.Milliseconds())/float64(max(len(a.took), 1)), a.name+"-mean-ms")
	b.ReportMetric(float64(slices.Max(a.took).Milliseconds()), a.name+"-max-ms")
	b.ReportMetric(float64(a.missed), a.name+"-refused")
}

// BenchmarkSlowBodyAttack (finding 2): every one of -max-conns 20 slots
// held by a login whose body comes a byte every 2 s, all from 127.0.0.1,
// each connection opened again at once when the server closes it. An
// operation is a new client's GET /healthz on a new connection from
// 127.0.0.2; "refused" counts those with no answer within 5 s.
func BenchmarkSlowBodyAttack(b *testing.B) {
	const maxConns = 20
	env := newTestEnv(b, nil)
	hook, waitActive := activeFrom(1)
	addr := startServerWith(b, env, requestReadTimeout, newConnLimits(maxConns), hook)
	stop := make(chan struct{})
	var attackers sync.WaitGroup
	var reopened atomic.Int64
	for range maxConns {
		attackers.Go(func() {
			for range 1000 {
				c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}}).Dial("tcp", addr)
				if err != nil {
					return
				}
				if !holdSlowBody(c, stop) {
					return
				}
				reopened.Add(1)
			}
		})
	}
	waitActive(b, maxConns)
	reopened.Store(0)
	newcomer := answerTimes{name: "new", want: 200}
	b.ResetTimer()
	for range b.N {
		took, err := healthzFrom(addr, 2)
		got := answer{status: 200}
		if err != nil {
			got.status = 0
		}
		newcomer.add(got, took)
	}
	b.StopTimer()
	close(stop)
	attackers.Wait()
	newcomer.report(b)
	b.ReportMetric(float64(reopened.Load()), "attack-reopened")
}

// holdSlowBody sends slowLogin on c and then a byte every 2 s until the
// server closes c (true) or stop closes (false).
func holdSlowBody(c net.Conn, stop <-chan struct{}) bool {
	defer c.Close()
	io.WriteString(c, slowLogin)
	closed := make(chan struct{})
	go func() {
		io.Copy(io.Discard, c)
		close(closed)
	}()
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
			c.Write([]byte(" "))
		case <-closed:
			return true
		case <-stop:
			return false
		}
	}
}

// BenchmarkLoginAttack (finding 1): accounts of the attacker's own log in
// correctly in loops from many addresses of one block, one login at a time
// per account and address, again at once after each answer, and after a
// 429 once its Retry-After is over (sending sooner would only spend the
// address's budget). The clients' addresses come in X-Forwarded-For from
// a trusted proxy on 127.0.0.1; every password check costs what
// production's does, and the service's clock follows real time. An
// operation is a login of a known client (alice, from her home address)
// and then one of a new client (bob, from a new address of another block
// each time). check-ms is one password check alone on this machine, just
// before: the yardstick of the answer times.
func BenchmarkLoginAttack(b *testing.B) {
	addrs := func(n int, format string) []string {
		list := make([]string, n)
		for i := range list {
			list[i] = fmt.Sprintf(format, i+1)
		}
		return list
	}
	attacks := []struct {
		name     string
		accounts int
		addrs    []string
	}{
		{"3 accounts, 15 addresses of one /24", 3, addrs(15, "192.0.2.%d")},
		{"1 account, 16 /64s of one /56", 1, addrs(16, "2001:db8:0:1%02x::1")},
	}
	for _, at := range attacks {
		b.Run(at.name, func(b *testing.B) {
			env := newTestEnv(b, nil)
			env.srv.trustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
			env.srv.iterations = passwordIterations
			users := []testUser{env.alice, env.bob}
			for i := range at.accounts {
				users = append(users, env.addUser("Attacker", fmt.Sprintf("attacker-%d@example.com", i), "attacker-password"))
			}
			for _, u := range users {
				hash, err := hashPassword(u.password, passwordIterations)
				must(b, err)
				mustExec(b, env.st, `UPDATE users SET password_hash = ? WHERE id = ?`, hash, u.id)
			}
			yardstick, err := hashPassword("x", passwordIterations)
			must(b, err)
			check := time.Now()
			checkPassword(yardstick, "x")
			checkTook := time.Since(check)
			addr := startServer(b, env, requestReadTimeout, 1024)
			const home = "203.0.113.5"
			hc := &http.Client{Timeout: time.Minute}
			if resp, _ := loginAs(hc, addr, home, env.alice); resp.status != 200 {
				b.Fatalf("alice's first login: %d", resp.status)
			}
			stop := make(chan struct{})
			var attackers sync.WaitGroup
			attackers.Go(func() { followRealTime(env.clock, stop) })
			var passed, refused atomic.Int64
			for _, u := range users[2:] {
				for _, ip := range at.addrs {
					attackers.Go(func() {
						hc := &http.Client{Timeout: time.Minute}
						for range 10_000 {
							select {
							case <-stop:
								return
							default:
							}
							resp, _ := loginAs(hc, addr, ip, u)
							switch resp.status {
							case 200:
								passed.Add(1)
							case 429:
								refused.Add(1)
								select {
								case <-stop:
									return
								case <-time.After(resp.retryAfter):
								}
							default:
								return
							}
						}
					})
				}
			}
			time.Sleep(time.Second) // the attack's first checks are queued and running
			known := answerTimes{name: "known", want: 200}
			fresh := answerTimes{name: "new", want: 200}
			b.ResetTimer()
			for i := range b.N {
				known.add(loginAs(hc, addr, home, env.alice))
				fresh.add(loginAs(hc, addr, fmt.Sprintf("198.51.100.%d", i%250+1), env.bob))
			}
			b.StopTimer()
			close(stop)
			attackers.Wait()
			known.report(b)
			fresh.report(b)
			b.ReportMetric(float64(passed.Load()), "attack-passed")
			b.ReportMetric(float64(refused.Load()), "attack-429")
			b.ReportMetric(float64(checkTook.Milliseconds()), "check-ms")
		})
	}
}

// answer is an HTTP answer's status (0: none) and Retry-After.
type answer struct {
	status     int
	retryAfter time.Duration
}

// loginAs logs u in through the server at addr as a client at the address
// ip behind the trusted proxy; it returns the answer and how long it took.
func loginAs(hc *http.Client, addr, ip string, u testUser) (answer, time.Duration) {
	body := apiJSON(map[string]string{"email": u.email, "password": u.password, "token_name": "t"})
	req, _ := http.NewRequest("POST", "http://"+addr+"/v1/auth/login", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Forwarded-For", ip)
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		return answer{}, time.Since(start)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	seconds, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	return answer{resp.StatusCode, time.Duration(seconds) * time.Second}, time.Since(start)
}

// followRealTime moves clock on with real time until stop closes.
func followRealTime(clock *fakeClock, stop <-chan struct{}) {
	start, base := time.Now(), clock.now()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			clock.set(base.Add(time.Since(start)))
		}
	}
}
