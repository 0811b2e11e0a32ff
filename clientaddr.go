package main

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
)

// The client address: the peer, or the address a trusted proxy names in
// X-Forwarded-For, and the key the login throttle counts it under.

// clientIP is the address the login throttle counts a request under: the
// peer's, unless the peer is a trusted proxy (-trusted-proxies). Then it
// is the right-most X-Forwarded-For address that is not a trusted proxy:
// each proxy appends the address it saw, so everything to the left of that
// was sent by the client and may be made up. If that address does not
// parse, it is the last trusted hop; if every hop is trusted, the first.
func (s *server) clientIP(r *http.Request) string {
	peer := peerIP(r)
	client, err := netip.ParseAddr(peer)
	if err != nil || !s.trusted(client) {
		return peer
	}
	hops := forwardedFor(r)
	for i := len(hops) - 1; i >= 0; i-- {
		hop, ok := parseHop(hops[i])
		if !ok {
			break
		}
		client = hop
		if !s.trusted(hop) {
			break
		}
	}
	return client.String()
}

// throttleAddr is what the login limits count a client address as: the
// address itself, or for IPv6 its /64, which one host usually has whole
// and could otherwise step through to get fresh limits.
func throttleAddr(addr string) string {
	a, err := netip.ParseAddr(addr)
	if err != nil || a.Is4() {
		return addr
	}
	p, _ := a.Prefix(64)
	return p.String()
}

// trusted reports whether addr is one of the trusted proxies.
func (s *server) trusted(addr netip.Addr) bool {
	for _, p := range s.trustedProxies {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// peerIP is the address the request's connection comes from.
func peerIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	if addr, ok := parseHop(host); ok {
		return addr.String()
	}
	return host
}

// forwardedFor lists the X-Forwarded-For addresses of every such header
// line, in order.
func forwardedFor(r *http.Request) []string {
	var hops []string
	for _, line := range r.Header.Values("X-Forwarded-For") {
		for _, hop := range strings.Split(line, ",") {
			if hop = strings.TrimSpace(hop); hop != "" {
				hops = append(hops, hop)
			}
		}
	}
	return hops
}

// parseHop parses an address as proxies write it: an IP, perhaps with a
// port, an IPv6 zone or as IPv4 mapped into IPv6, all of which it drops.
func parseHop(s string) (netip.Addr, bool) {
	addr, err := netip.ParseAddr(s)
	if err != nil {
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return netip.Addr{}, false
		}
		addr = ap.Addr()
	}
	return addr.Unmap().WithZone(""), true
}

// parseTrustedProxies parses -trusted-proxies: comma-separated CIDRs or
// single addresses; "" is none.
func parseTrustedProxies(s string) ([]netip.Prefix, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var list []netip.Prefix
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		p, err := netip.ParsePrefix(item)
		if err != nil {
			addr, aerr := netip.ParseAddr(item)
			if aerr != nil {
				return nil, fmt.Errorf("trusted proxy %q is not a CIDR or an IP address", item)
			}
			p = netip.PrefixFrom(addr, addr.BitLen())
		}
		list = append(list, p.Masked())
	}
	return list, nil
}
