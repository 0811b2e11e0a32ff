package main

import "testing"

// TestPublicBrokerURL: devices get -public-mqtt-url, or the public
// URL's host with -mqtt's scheme and port.
func TestPublicBrokerURL(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, public, mqtt, publicURL, want string }{
		{"given", "mqtts://broker.example:8883", "tcp://127.0.0.1:1883", "https://hub.example", "mqtts://broker.example:8883"},
		{"derived", "", "tcp://127.0.0.1:1883", "https://hub.example:8443/x", "tcp://hub.example:1883"},
		{"tls", "", "ssl://localhost:8883", "http://10.0.0.5:8080", "ssl://10.0.0.5:8883"},
		{"no port", "", "tcp://localhost", "http://[fd00::1]:8080", "tcp://[fd00::1]"},
		{"no host", "", "tcp://localhost:1883", "/", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := config{publicMQTTURL: tt.public, mqttURL: tt.mqtt}
			got, err := cfg.publicBrokerURL(tt.publicURL)
			if got != tt.want || (err != nil) != (tt.want == "") {
				t.Fatalf("got %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}
