package sim

import (
	"cmp"
	"context"
	"crypto/md5"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	mqtt "github.com/eclipse/paho.mqtt.golang"

	"devicehub/internal/wire"
)

// What the HTTP updater reports about the chip, and how it reads.
const (
	chipSize    = 16 << 20
	sdkVersion  = "v5.1.4"
	imageMagic  = 0xE9 // first byte of an ESP application image
	updaterWait = 8 * time.Second
	// readChunk is how much the updater writes to flash at a time.
	readChunk = 4096
)

// otaCommand is {"cmd":"ota",...}. sha256 and size are checked when
// present (the server sends both; an older server sends no sha256).
type otaCommand struct {
	URL     string  `json:"url"`
	MD5     string  `json:"md5"`
	SHA256  string  `json:"sha256"`
	Size    *int64  `json:"size"`
	Version *string `json:"version"`
}

func (o *otaCommand) validate() error {
	u, err := url.Parse(o.URL)
	switch {
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		return errors.New("ota: url must be an absolute http or https URL")
	case !wire.IsHex(o.MD5, 32):
		return errors.New("ota: md5 must be 32 hex digits")
	case o.SHA256 != "" && !wire.IsHex(o.SHA256, 64):
		return errors.New("ota: sha256 must be 64 hex digits")
	case o.Size != nil && *o.Size <= 0:
		return errors.New("ota: size must be a positive number of bytes")
	}
	return nil
}

// errNotModified is a 304: the server says the device runs that image.
var errNotModified = errors.New("not modified")

// startOTA checks the command and starts the update in its own goroutine;
// one update at a time, as the single-threaded updater would.
func (d *device) startOTA(c mqtt.Client, id string, payload []byte) {
	var cmd otaCommand
	if err := json.Unmarshal(payload, &cmd); err != nil {
		d.answer(c, id, failure("ota: malformed command: %v", err))
		return
	}
	if err := cmd.validate(); err != nil {
		d.answer(c, id, failure("%v", err))
		return
	}
	d.mu.Lock()
	busy, again := d.otaBusy, d.otaID == id
	if !busy {
		d.otaBusy, d.otaID = true, id
	}
	d.mu.Unlock()
	switch {
	case busy && again: // the server sent it again after a reset: it is under way
		return
	case busy:
		d.answer(c, id, failure("ota: an update is already in progress"))
		return
	}
	if !d.fleet.spawn(func() { d.runOTA(c, id, cmd, payload) }) {
		d.setOTABusy(false)
	}
}

// carriedOTA is an ota command that reached the device as it reset: the
// device carries it out once back (as a persistent broker session would
// hand it over again), rather than leave it unanswered.
type carriedOTA struct {
	id      string
	payload []byte
}

// carryOTA keeps the command for the next boot when this one (c) has
// ended, and reports whether it did.
func (d *device) carryOTA(c mqtt.Client, id string, payload []byte) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.client == c {
		return false
	}
	d.carried = &carriedOTA{id, payload}
	return true
}

// setOTABusy(false) ends the update: the next command is a new one.
func (d *device) setOTABusy(b bool) {
	d.mu.Lock()
	d.otaBusy = b
	if !b {
		d.otaID = ""
	}
	d.mu.Unlock()
}

// runOTA downloads and checks the image, then "flashes" it: it records the
// image as the one it runs (non-volatile, kept across the reboot), reboots,
// and confirms with ok once it is back and has reported the new fw_md5.
func (d *device) runOTA(c mqtt.Client, id string, cmd otaCommand, payload []byte) {
	defer d.setOTABusy(false)
	if d.carryOTA(c, id, payload) {
		return
	}
	report := func(p int) { d.answer(c, id, progress{Progress: p, State: "downloading"}) }
	fw, err := d.download(cmd, report)
	if errors.Is(err, errNotModified) {
		d.answer(c, id, final{OK: true})
		return
	}
	if err != nil {
		d.fleet.log.Debug("simulated ota failed", "uid", d.uid, "id", id, "err", err)
		d.answer(c, id, failure("%v", err))
		return
	}
	d.mu.Lock()
	if d.client != c { // a reset cut the update short: it starts again once back
		d.carried = &carriedOTA{id, payload}
		d.mu.Unlock()
		return
	}
	d.fw = fw
	d.pendingOTA = id
	d.mu.Unlock()
	t := d.answer(c, id, progress{Progress: 100, State: "rebooting"})
	d.reboot(c, t)
}

// download fetches cmd.URL the way arduino-esp32's HTTPUpdate does (its
// request headers, no redirects, no compression, one request per
// connection) and checks what it gets: status 200, Content-Length equal to
// the command's size and within the free space, x-MD5 equal to the
// command's md5, the image magic byte, and the md5 and sha256 of the bytes.
// It calls report at every 10% read, short of 100.
func (d *device) download(cmd otaCommand, report func(int)) (firmware, error) {
	req, err := http.NewRequestWithContext(d.fleet.ctx, http.MethodGet, cmd.URL, nil)
	if err != nil {
		return firmware{}, fmt.Errorf("ota: %v", err)
	}
	d.setUpdaterHeaders(req.Header)
	resp, err := d.fleet.http.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the URL holds the link's signature: keep it out of results and logs
		}
		return firmware{}, fmt.Errorf("download failed: %v", err)
	}
	defer resp.Body.Close()
	if err := checkResponse(resp, cmd, d.fleet.opts.FreeSpace); err != nil {
		return firmware{}, err
	}
	report(0)
	md5sum, sha, err := readImage(resp.Body, resp.ContentLength, report)
	if err != nil {
		return firmware{}, err
	}
	if md5sum != strings.ToLower(cmd.MD5) {
		return firmware{}, fmt.Errorf("md5 mismatch: the image's is %s, the command's %s", md5sum, strings.ToLower(cmd.MD5))
	}
	if cmd.SHA256 != "" && sha != strings.ToLower(cmd.SHA256) {
		return firmware{}, fmt.Errorf("sha256 mismatch: the image's is %s, the command's %s", sha, strings.ToLower(cmd.SHA256))
	}
	fw := firmware{md5: md5sum, sha256: sha, size: resp.ContentLength}
	if cmd.Version != nil {
		fw.version = *cmd.Version
	}
	return fw, nil
}

// setUpdaterHeaders sets the request headers of HTTPUpdate::handleUpdate,
// spelled as it spells them, with this device's values. The sketch md5 and
// sha256 are those of the image it last flashed (the sha256 in upper case,
// as the core renders it); x-ESP32-version is sent when the device knows
// its version, as when a sketch passes currentVersion.
func (d *device) setUpdaterHeaders(h http.Header) {
	d.mu.Lock()
	fw := d.fw
	d.mu.Unlock()
	set := func(k, v string) { h[k] = []string{v} }
	set("User-Agent", "ESP32-http-Update")
	set("Cache-Control", "no-cache")
	set("x-ESP32-BASE-MAC", d.staMAC) // 3.x cores; the base MAC is the station's
	set("x-ESP32-STA-MAC", d.staMAC)
	set("x-ESP32-AP-MAC", d.apMAC)
	set("x-ESP32-free-space", strconv.FormatInt(d.fleet.opts.FreeSpace, 10))
	set("x-ESP32-sketch-size", strconv.FormatInt(fw.size, 10))
	set("x-ESP32-sketch-md5", fw.md5)
	set("x-ESP32-sketch-sha256", strings.ToUpper(fw.sha256))
	set("x-ESP32-chip-size", strconv.Itoa(chipSize))
	set("x-ESP32-sdk-version", sdkVersion)
	set("x-ESP32-mode", "sketch")
	if fw.version != "" {
		set("x-ESP32-version", fw.version)
	}
}

// checkResponse applies the updater's checks on the status and headers,
// and the command's: errNotModified for a 304.
func checkResponse(resp *http.Response, cmd otaCommand, freeSpace int64) error {
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotModified:
		return errNotModified
	case http.StatusNotFound:
		return errors.New("download failed: file not found (404)")
	case http.StatusForbidden:
		return errors.New("download failed: forbidden (403)")
	default:
		return fmt.Errorf("download failed: wrong HTTP code (%d)", resp.StatusCode)
	}
	n := resp.ContentLength
	xmd5 := resp.Header.Get("x-MD5")
	switch {
	case n <= 0:
		return errors.New("download failed: the server did not report a size (Content-Length)")
	case n > freeSpace:
		return fmt.Errorf("not enough space: the image has %d bytes, %d are free", n, freeSpace)
	case cmd.Size != nil && n != *cmd.Size:
		return fmt.Errorf("size mismatch: Content-Length is %d, the command's size %d", n, *cmd.Size)
	case xmd5 == "":
		return errors.New("download failed: the response has no x-MD5 header")
	case !strings.EqualFold(xmd5, cmd.MD5):
		return fmt.Errorf("md5 mismatch: x-MD5 is %s, the command's md5 %s", xmd5, strings.ToLower(cmd.MD5))
	}
	return nil
}

// readImage reads exactly size bytes in flash-sector chunks, as the
// updater writes them, and returns their md5 and sha256. The first byte
// must be the ESP image magic.
func readImage(body io.Reader, size int64, report func(int)) (md5sum, sha string, err error) {
	hm, hs := md5.New(), sha256.New()
	meter := &progressMeter{total: size, report: report}
	w := io.MultiWriter(&magicCheck{}, hm, hs, meter)
	n, err := io.CopyBuffer(w, io.LimitReader(body, size), make([]byte, readChunk))
	if errors.Is(err, errNotImage) {
		return "", "", err
	}
	if err != nil || n < size {
		return "", "", fmt.Errorf("download failed after %d of %d bytes: %v", n, size, cmp.Or(err, io.ErrUnexpectedEOF))
	}
	return hexSum(hm), hexSum(hs), nil
}

func hexSum(h hash.Hash) string { return hex.EncodeToString(h.Sum(nil)) }

var errNotImage = fmt.Errorf("not an ESP32 image: the first byte is not 0x%02X", imageMagic)

// magicCheck refuses a stream whose first byte is not the image magic,
// as the updater does before it writes anything.
type magicCheck struct{ checked bool }

func (m *magicCheck) Write(p []byte) (int, error) {
	if !m.checked && len(p) > 0 {
		m.checked = true
		if p[0] != imageMagic {
			return 0, errNotImage
		}
	}
	return len(p), nil
}

// progressMeter counts bytes and reports each 10% step once, below 100
// (100 is reported after the checks, as "rebooting").
type progressMeter struct {
	total, done int64
	last        int
	report      func(int)
}

func (m *progressMeter) Write(p []byte) (int, error) {
	m.done += int64(len(p))
	step := int(m.done*10/m.total) * 10
	if step > m.last && step < 100 {
		m.last = step
		m.report(step)
	}
	return len(p), nil
}

// newHTTPClient is the fleet's download client, shaped like the
// updater's: no redirects followed, no compression asked for, no proxy, one
// request per connection (it speaks HTTP/1.0, which Go's client cannot;
// HTTP/1.1 with "Connection: close" is the nearest), and its 8 s timeout
// applied to every read rather than to the whole download.
func newHTTPClient() *http.Client {
	dialer := &net.Dialer{Timeout: updaterWait}
	return &http.Client{
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := dialer.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return &idleConn{Conn: c}, nil
			},
			DisableKeepAlives:     true,
			DisableCompression:    true,
			TLSHandshakeTimeout:   updaterWait,
			ResponseHeaderTimeout: updaterWait,
		},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
}

// idleConn fails a read that waits longer than the updater would.
type idleConn struct{ net.Conn }

func (c *idleConn) Read(p []byte) (int, error) {
	c.SetReadDeadline(time.Now().Add(updaterWait))
	return c.Conn.Read(p)
}
