package mqttlink

// Offline is a link that connects to no broker: Handle takes a message
// as the link takes one from the broker, and Flush writes what was taken,
// as the link's flusher does every 100 ms. The server's tests of what its
// Sink makes of device messages, and its fuzz target, use it.
type Offline struct{ l *Link }

// NewOffline makes an Offline link; cfg's Broker needs only the Prefix.
func NewOffline(cfg Config) *Offline { return &Offline{newLink(cfg)} }

// Handle takes one message from a device topic, and parses and queues it
// at once, as the parser would.
func (o *Offline) Handle(topic string, payload []byte, retained bool) {
	o.l.take(topic, payload, retained)
	m, _ := o.l.next()
	o.l.parse(m)
}

// Flush writes what was taken through the Sink.
func (o *Offline) Flush() { o.l.flush() }

// Stats returns the link's counts.
func (o *Offline) Stats() Stats { return o.l.Stats() }
