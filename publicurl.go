package main

// The URLs devicehub gives devices: its own (-public-url), for firmware
// downloads, and the broker's (-public-mqtt-url), with their logins.

import (
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"

	"devicehub/internal/wire"
)

// publicBrokerURL is the broker's URL given to devices: -public-mqtt-url,
// or else the host of publicURL (the effective -public-url) with the
// scheme and port of -mqtt, which names the broker as devicehub reaches
// it, often on localhost.
func (cfg *config) publicBrokerURL(publicURL string) (string, error) {
	if cfg.publicMQTTURL != "" {
		return cfg.publicMQTTURL, nil
	}
	pub, err := url.Parse(publicURL)
	if err != nil || pub.Hostname() == "" {
		return "", fmt.Errorf("public MQTT URL: no host in the public URL %q; set -public-mqtt-url", publicURL)
	}
	broker, err := url.Parse(cfg.mqttURL)
	if err != nil || broker.Scheme == "" {
		return "", fmt.Errorf("public MQTT URL: -mqtt %q is not a URL", cfg.mqttURL)
	}
	host := pub.Hostname()
	if broker.Port() != "" {
		host = net.JoinHostPort(host, broker.Port())
	} else if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return (&url.URL{Scheme: broker.Scheme, Host: host}).String(), nil
}

// advertisedAddr is host:port for the default public URL: the listen
// address, or, when listening on all interfaces, the first of ifaceAddrs
// that is IPv4 and neither loopback nor link-local, since devices rarely
// resolve host names. ok is false when there is none and 127.0.0.1, which
// devices cannot reach, stands in.
func advertisedAddr(listen *net.TCPAddr, ifaceAddrs []net.Addr) (addr string, ok bool) {
	host, ok := listen.IP.String(), true
	if listen.IP == nil || listen.IP.IsUnspecified() { // nil: an -addr like ":8080", as the CLI reads it
		host, ok = "127.0.0.1", false
		if ip, found := firstLANIPv4(ifaceAddrs); found {
			host, ok = ip.String(), true
		}
	}
	return net.JoinHostPort(host, strconv.Itoa(listen.Port)), ok
}

// firstLANIPv4 is the first IPv4 address in addrs that is neither loopback
// nor link-local (169.254/16, which an interface without DHCP gets).
func firstLANIPv4(addrs []net.Addr) (net.IP, bool) {
	for _, a := range addrs {
		var ip net.IP
		switch a := a.(type) {
		case *net.IPNet:
			ip = a.IP
		case *net.IPAddr:
			ip = a.IP
		}
		if ip4 := ip.To4(); ip4 != nil && !ip4.IsLoopback() && !ip4.IsLinkLocalUnicast() {
			return ip4, true
		}
	}
	return nil, false
}

// defaultPublicURL is the public URL when -public-url is unset, from the
// listen address and this machine's interface addresses
// (net.InterfaceAddrs). It warns when only 127.0.0.1 is left.
func defaultPublicURL(listen *net.TCPAddr, interfaceAddrs func() ([]net.Addr, error), logger *slog.Logger) string {
	ifaceAddrs, err := interfaceAddrs()
	if err != nil {
		logger.Warn("list interface addresses for the default public URL", "err", err)
	}
	addr, ok := advertisedAddr(listen, ifaceAddrs)
	if !ok {
		logger.Warn("no IPv4 address other than loopback or link-local: the default public URL is http://"+addr+
			", which devices cannot reach; set -public-url", "public_url", "http://"+addr)
	}
	return "http://" + addr
}

// brokerPort is the port in a broker URL, recorded as the new devices'
// meta.mqtt_port; 1883 (8883 for TLS) when the URL names none.
func brokerPort(broker string) int {
	u, err := url.Parse(broker)
	if err == nil {
		if p, err := strconv.Atoi(u.Port()); err == nil {
			return p
		}
		if wire.IsTLSURL(broker) {
			return 8883
		}
	}
	return 1883
}
