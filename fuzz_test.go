package main

// Fuzz targets: every JSON request body, the multipart firmware upload,
// the token header, the device status and telemetry messages and the
// signed OTA link. `go test` runs the seeds (f.Add and testdata/fuzz/<Name>/)
// as regular tests; .ci/fuzz fuzzes each target for a short fixed time.
//
// The oracles do not decode a request the way the server does; they check
// properties that hold whatever the input, against the state read just
// before it (a target reuses one testEnv for every input): never a 5xx; a
// JSON answer, a message on every error, a 422 in Laravel's shape naming
// only fields the endpoint takes; a refusal changes nothing; a success
// changes only the acting user's rows, and what it answers is what the
// database then holds. The table tests pin the exact answers.
//
// Inside the fuzz function no method of the *testing.F may be called, so
// everything there takes the input's *testing.T. Seeds use placeholders
// ({A}: alice's device uid or token, {FA1}: the md5 of one of her
// firmwares, …) replaced before each run, so that mutations of a valid
// input stay close to valid although uids and tokens are random.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"devicehub/internal/mqttlink"
	"devicehub/internal/wire"
)

// fuzzFail stops the input, showing the answer (when there is one) and
// what the server logged.
func fuzzFail(t *testing.T, env *testEnv, w *httptest.ResponseRecorder, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if w != nil {
		msg += fmt.Sprintf("\nanswer: %d %s", w.Code, strings.TrimSpace(w.Body.String()))
	}
	if l := env.logs.Take(); l != "" {
		msg += "\nserver log:\n" + l
	}
	t.Fatal(msg)
}

// fuzzAnswer checks what every API answer must be and returns its body:
// no 5xx; a JSON object with the JSON and nosniff headers; a message on
// every error; errors only on a 422, in Laravel's shape, naming only the
// given fields, or "body" alone.
func fuzzAnswer(t *testing.T, env *testEnv, w *httptest.ResponseRecorder, fields ...string) map[string]any {
	t.Helper()
	if w.Code >= 500 {
		fuzzFail(t, env, w, "server error")
	}
	if w.Header().Get("Content-Type") != "application/json" || w.Header().Get("X-Content-Type-Options") != "nosniff" {
		fuzzFail(t, env, w, "headers %v, want JSON and nosniff", w.Header())
	}
	var v map[string]any
	if err := unmarshalNumbers(w.Body.Bytes(), &v); err != nil || v == nil {
		fuzzFail(t, env, w, "answer is not a JSON object: %v", err)
	}
	msg, _ := v["message"].(string)
	if w.Code >= 300 && msg == "" {
		fuzzFail(t, env, w, "error answer without a message")
	}
	if raw, has := v["errors"]; has {
		errs, _ := raw.(map[string]any)
		if err := laravelErrors(msg, errs); w.Code != http.StatusUnprocessableEntity || err != nil {
			fuzzFail(t, env, w, "errors not in Laravel's shape on a 422: %v", err)
		}
		for field := range errs {
			if !slices.Contains(fields, field) && (field != "body" || len(errs) > 1) {
				fuzzFail(t, env, w, "errors name %q, not a field of %v", field, fields)
			}
		}
	}
	return v
}

// laravelErrors checks a 422 body: errors is an object of field -> non-empty
// list of non-empty strings, and message is one field's first error, plus
// " (and N more error(s))" when there are N more.
func laravelErrors(msg string, errs map[string]any) error {
	if len(errs) == 0 {
		return errors.New("errors is not a non-empty object")
	}
	total, firsts := 0, map[string]bool{}
	for field, list := range errs {
		items, _ := list.([]any)
		for i, it := range items {
			if s, _ := it.(string); s == "" {
				return fmt.Errorf("errors.%s[%d] is not a non-empty string", field, i)
			} else if i == 0 {
				firsts[s] = true
			}
		}
		if len(items) == 0 {
			return fmt.Errorf("errors.%s is not a non-empty list", field)
		}
		total += len(items)
	}
	suffix := ""
	if total > 1 {
		suffix = fmt.Sprintf(" (and %d more error%s)", total-1, map[bool]string{true: "s"}[total > 2])
	}
	if first, ok := strings.CutSuffix(msg, suffix); !ok || !firsts[first] {
		return fmt.Errorf("message %q is not a field's first error followed by %q", msg, suffix)
	}
	return nil
}

// fuzzSame fails the input when the state changed for any owner not in allowed.
func fuzzSame(t *testing.T, env *testEnv, w *httptest.ResponseRecorder, before, after map[int64][]string, allowed ...int64) {
	t.Helper()
	for _, o := range changedOwners(before, after) {
		if !slices.Contains(allowed, o) {
			fuzzFail(t, env, w, "the rows of owner %d changed:\nbefore %q\nafter  %q", o, before[o], after[o])
		}
	}
}

// fuzzJSON fails the input unless got has the JSON form of want, numbers
// as written (JSON puts no limit on their range: 1e999 is a valid payload).
func fuzzJSON(t *testing.T, env *testEnv, w *httptest.ResponseRecorder, what string, got, want any) {
	t.Helper()
	norm := func(v any) string {
		j, err := json.Marshal(v)
		var x any
		if err == nil {
			err = unmarshalNumbers(j, &x)
		}
		j, _ = json.Marshal(x)
		return fmt.Sprint(string(j), err)
	}
	if g, x := norm(got), norm(want); g != x {
		fuzzFail(t, env, w, "%s: answered %s, the database holds %s", what, g, x)
	}
}

// unmarshalNumbers is json.Unmarshal keeping numbers as written.
func unmarshalNumbers(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	return d.Decode(v)
}

// Firmware images used by the targets; they start with the ESP image magic.
var (
	fuzzFirmwareA1 = []byte("\xe9\x04\x02\x20alice firmware 1.0\n")
	fuzzFirmwareA2 = []byte("\xe9\x04\x02\x20alice firmware 2.0\n")
	fuzzFirmwareB  = []byte("\xe9\x04\x02\x20bob firmware 1.0\n")
)

// fuzzJSONRoutes are the routes FuzzJSONBodies sends bodies to, and the
// fields each takes; the input's route byte picks one (modulo the length),
// so the order is that of the seeds in testdata.
var fuzzJSONRoutes = []fuzzRoute{
	{"login", "POST", "/v1/auth/login", []string{"email", "password", "token_name"}},
	{"device-patch", "PATCH", "/v1/user/devices/{uid}", []string{"name", "description"}},
	{"button-create", "POST", "/v1/user/devices/{uid}/command-buttons", []string{"id", "label", "payload", "confirm"}},
	{"command", "POST", "/v1/user/devices/{uid}/commands", []string{"payload"}},
	{"firmware-patch", "PATCH", "/v1/user/devices/{uid}/firmwares/{FA1id}", []string{"name", "version", "notes"}},
	{"set-target", "POST", "/v1/user/devices/{uid}/firmwares/set-target", []string{"md5"}},
	{"firmware-patch-by-md5", "PATCH", "/v1/user/devices/{uid}/firmwares/{FA2U}", []string{"name", "version", "notes"}},
}

type fuzzRoute struct {
	name, method, path string
	fields             []string
}

// FuzzJSONBodies sends fuzzed bodies to every route that takes a JSON body,
// with alice's token, at her device or (foreign) at bob's. Beyond the
// common properties: a foreign device is a 404 and a body past 64 KiB a
// 413; a refused command is not published; a success is checked against
// the database (the device, button, firmware or target it answers; a
// login's token authenticates its user; a command publishes its payload).
func FuzzJSONBodies(f *testing.F) {
	link := &recordingLink{}
	env := newTestEnv(f, link)
	alice, bob := env.alice, env.bob
	env.setStatus(alice.device, "online") // so that a valid command is published
	fa1, fa1MD5 := env.uploadOK(alice, map[string]string{"name": "alice-1", "version": "1.0"}, fuzzFirmwareA1)
	_, fa2MD5 := env.uploadOK(alice, map[string]string{"name": "alice-2"}, fuzzFirmwareA2)
	_, fbMD5 := env.uploadOK(bob, map[string]string{"name": "bob-1"}, fuzzFirmwareB)
	aliceDev := env.deviceRef(alice)
	repl := strings.NewReplacer("{FA1}", fa1MD5, "{FA1U}", strings.ToUpper(fa1MD5), "{FA2}", fa2MD5, "{FB}", fbMD5)
	paths := strings.NewReplacer("{FA1id}", strconv.FormatInt(fa1, 10), "{FA2U}", strings.ToUpper(fa2MD5))

	add := func(name string, foreign bool, bodies ...string) {
		r := slices.IndexFunc(fuzzJSONRoutes, func(rt fuzzRoute) bool { return rt.name == name })
		for _, b := range bodies {
			f.Add(uint8(r), foreign, []byte(b))
		}
	}
	add("login", false, `{"email":"alice@example.com","password":"alice-password","token_name":"laptop"}`,
		`{"email":"  BOB@Example.COM ","password":"bob-password","token_name":"ci"}`,
		`{"email":"alice@example.com","password":"wrong","token_name":"laptop"}`,
		`{"email":null,"password":null,"token_name":null}`, `{"email":1,"password":true,"token_name":[]}`,
		`{"email":"alice@example.com","email":"bob@example.com","password":"bob-password","token_name":"dup"}`,
		``, `null`, `[]`, `"x"`, `{`)
	add("device-patch", false, `{"name":"Kitchen sensor","description":"on the shelf"}`, `{"description":null}`,
		`{"name":""}`, `{"name":"   "}`, `{"name":123}`, `{"name":"`+strings.Repeat("é", 256)+`"}`,
		`{"name":"a","name":"b"}`, `{"name":"\u0000\ud800 日本語 🚀"}`, `{}`, `   `, `{"name":"x"} trailing`, `{"name":1e999}`,
		strings.Repeat(`{"a":`, 100)+`1`+strings.Repeat(`}`, 100), strings.Repeat(`[`, 20000))
	add("device-patch", true, `{"name":"stolen"}`)
	add("button-create", false, `{"id":"led-on","label":"LED on","payload":{"cmd":"led","on":true},"confirm":false}`,
		`{"id":"a.b_c-d","label":"x","payload":{}}`, `{"id":"..","label":"dots","payload":{}}`,
		`{"id":"has space","label":"x","payload":{}}`, `{"id":"x","label":"x","payload":[]}`,
		`{"id":"x","label":"x","payload":{"n":123456789012345678901234567890e300}}`,
		`{"id":"x","label":"x","payload":{"a":1,"a":2},"confirm":"yes"}`,
		`{"id":"x","label":"<b>&amp;</b>","payload":{"html":"<script>"},"confirm":null}`, `{}`)
	add("button-create", true, `{"id":"evil","label":"x","payload":{}}`)
	add("command", false, `{"payload":{"cmd":"blink","times":3}}`, `{"payload":{ "a" : [ 1, 2, {"b": null} ] }}`,
		`{"payload":[]}`, `{"payload":null}`, `{"payload":{"big":1e308,"small":-1e-308,"u":"\u2028"}}`)
	add("command", true, `{"payload":{"cmd":"reboot"}}`)
	for _, r := range []string{"firmware-patch", "firmware-patch-by-md5"} {
		add(r, false, `{"name":"stable","version":"1.2.3","notes":"fixes"}`, `{"version":null,"notes":""}`,
			`{"name":null}`, `{"version":7}`, `{"notes":"`+strings.Repeat("n", 2001)+`"}`)
		add(r, true, `{"name":"stolen"}`)
	}
	add("set-target", false, `{"md5":"{FA1}"}`, `{"md5":" {FA1U} "}`, `{"md5":"{FB}"}`, `{"md5":"not-an-md5"}`, `{"md5":5}`)
	add("set-target", true, `{"md5":"{FB}"}`)

	f.Fuzz(func(t *testing.T, r uint8, foreign bool, body []byte) {
		env.t = t // the helpers may not call the *testing.F here
		env.logs.Take()
		link.take()
		rt := fuzzJSONRoutes[int(r)%len(fuzzJSONRoutes)]
		body = []byte(repl.Replace(string(body)))
		uid := alice.device
		if foreign {
			uid = bob.device
		}
		path := paths.Replace(strings.ReplaceAll(rt.path, "{uid}", uid))
		before := dbState(t, env.st)
		w := env.serve(t, newRequest(rt.method, path, "Bearer "+alice.token, "application/json", bytes.NewReader(body)))
		v := fuzzAnswer(t, env, w, rt.fields...)
		after := dbState(t, env.st)
		sent := link.take()
		switch {
		case foreign && rt.name != "login" && (w.Code != 404 || v["message"] != "Device not found."):
			fuzzFail(t, env, w, "a request at bob's device: want 404 Device not found.")
		case len(body) > maxJSONBody && (!foreign || rt.name == "login") && w.Code != 413:
			fuzzFail(t, env, w, "a body of %d bytes: want 413", len(body))
		}
		if w.Code >= 300 {
			fuzzSame(t, env, w, before, after)
			if len(sent) > 0 {
				fuzzFail(t, env, w, "a refused command was published: %q", sent)
			}
			if w.Code == http.StatusTooManyRequests {
				env.clock.advance(time.Minute + time.Second) // let the login throttle's window pass
			}
			return
		}
		actor := alice.id
		data, _ := v["data"].(map[string]any)
		switch rt.name {
		case "login":
			user, _ := v["user"].(map[string]any)
			tok, _ := v["token"].(string)
			rec, err := authenticate(context.Background(), env.st, tok)
			if err != nil || fmt.Sprint(rec.User.ID) != fmt.Sprint(user["id"]) || rec.User.Email != user["email"] {
				fuzzFail(t, env, w, "the token answered does not authenticate the user answered: %v", err)
			}
			actor = rec.User.ID
		case "device-patch":
			fuzzJSON(t, env, w, "device", data, env.device(alice))
		case "button-create":
			id, _ := data["id"].(string)
			b, err := env.st.Button(context.Background(), aliceDev, id)
			if err != nil || w.Code != http.StatusCreated {
				fuzzFail(t, env, w, "button %q answered as created: %v", id, err)
			}
			fuzzJSON(t, env, w, "button", data, b)
		case "command":
			var req map[string]json.RawMessage
			var payload bytes.Buffer
			if json.Unmarshal(body, &req) != nil || json.Compact(&payload, req["payload"]) != nil ||
				len(sent) != 1 || sent[0].uid != alice.device || !bytes.Equal(sent[0].payload, payload.Bytes()) {
				fuzzFail(t, env, w, "published %q, want exactly the payload sent, compacted, to %s", sent, alice.device)
			}
		case "firmware-patch", "firmware-patch-by-md5":
			fw, err := env.st.FirmwareOf(context.Background(), aliceDev, fmt.Sprint(data["id"]))
			if err != nil {
				fuzzFail(t, env, w, "firmware answered: %v", err)
			}
			fuzzJSON(t, env, w, "firmware", data, fw)
		case "set-target":
			if tf := env.device(alice).TargetFirmware; tf == nil || v["md5"] != *tf.MD5 {
				fuzzFail(t, env, w, "answered md5 %v, the target is %+v", v["md5"], tf)
			}
		}
		fuzzSame(t, env, w, before, after, actor)
	})
}

// FuzzUpload sends fuzzed multipart bodies and Content-Types to the
// firmware upload. Beyond the common properties: firmware/tmp is empty
// after every request; a 201 answers the firmware row the database holds,
// whose file, named by its sha256, has its sha256, md5 and size and is an
// ESP image (first byte 0xE9: alice's device is an esp32).
func FuzzUpload(f *testing.F) {
	env := newTestEnv(f, nil)
	alice := env.alice
	env.uploadOK(alice, map[string]string{"name": "existing"}, fuzzFirmwareA1)
	env.uploadOK(env.bob, map[string]string{"name": "bob's"}, fuzzFirmwareB)
	aliceDev := env.deviceRef(alice)

	fw := []byte("\xe9\x04\x02\x20new firmware\x00\xff\n")
	for _, s := range []struct {
		fields map[string]string
		file   []byte
	}{
		{map[string]string{"name": "ok", "version": "2.0", "notes": "notes"}, fw},
		{map[string]string{"name": "dup of alice's"}, fuzzFirmwareA1},
		{map[string]string{"name": "same bytes as bob's"}, fuzzFirmwareB},
		{map[string]string{"name": "empty"}, []byte{}},
		{map[string]string{"name": "no file"}, nil},
		{nil, fw},
		{map[string]string{"name": strings.Repeat("ü", 256)}, fw},
		{map[string]string{"name": "bad utf8 \xff\xfe"}, fw},
	} {
		body, ct := multipartForm(s.fields, s.file)
		f.Add(ct, body)
	}
	form, ct := multipartForm(map[string]string{"name": "x"}, []byte("\xe9 truncated"))
	f.Add(ct, form[:60])
	f.Add("multipart/form-data", form)
	f.Add("application/json", []byte(`{"name":"json"}`))
	f.Add("", []byte{})
	f.Add("multipart/form-data; boundary=fzB", []byte("--fzB\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nfirst\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nsecond\r\n"+
		"--fzB\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\ntwo files\r\n--fzB--\r\n"))

	f.Fuzz(func(t *testing.T, contentType string, body []byte) {
		env.t = t // the helpers may not call the *testing.F here
		env.logs.Take()
		before := dbState(t, env.st)
		req := newRequest("POST", "/v1/user/devices/"+alice.device+"/firmwares", "Bearer "+alice.token, contentType, bytes.NewReader(body))
		w := env.serve(t, req)
		v := fuzzAnswer(t, env, w, "name", "version", "notes", "file")
		after := dbState(t, env.st)
		if tmp, err := os.ReadDir(filepath.Join(firmwareDir(env.st), "tmp")); err != nil || len(tmp) != 0 {
			fuzzFail(t, env, w, "firmware/tmp not empty after the request: %v %v", tmp, err)
		}
		if w.Code != http.StatusCreated {
			fuzzSame(t, env, w, before, after)
			return
		}
		fuzzSame(t, env, w, before, after, alice.id, 0)
		data, _ := v["data"].(map[string]any)
		row, err := env.st.FirmwareOf(context.Background(), aliceDev, fmt.Sprint(data["id"]))
		if err != nil {
			fuzzFail(t, env, w, "firmware answered: %v", err)
		}
		fuzzJSON(t, env, w, "firmware", data, row)
		stored, err := os.ReadFile(firmwarePath(env.st, *row.SHA256))
		if err != nil || md5Hex(stored) != *row.MD5 || sha256Hex(stored) != *row.SHA256 || int64(len(stored)) != *row.Size || len(stored) == 0 || stored[0] != 0xE9 {
			fuzzFail(t, env, w, "stored file of %s: %d bytes, md5 %s, sha256 %s, %v", *row.MD5, len(stored), md5Hex(stored), sha256Hex(stored), err)
		}
		// Delete it again, so that the fuzzer's state stays small.
		if err := env.st.DeleteFirmware(context.Background(), aliceDev, *row.MD5, nil); err != nil {
			fuzzFail(t, env, w, "delete the upload: %v", err)
		}
	})
}

// FuzzBearerToken fuzzes the Authorization header of GET /v1/auth/me:
// exactly "Bearer <a live token>" answers 200 with that token's user (a
// token's secret alone is looked up by its hash, as Sanctum does);
// everything else is 401 {"message":"Unauthenticated."}, never a 5xx.
func FuzzBearerToken(f *testing.F) {
	env := newTestEnv(f, nil)
	alice, bob := env.alice, env.bob
	_, loggedOut, err := issueToken(context.Background(), env.st, alice.id, "logged-out", nil, nil)
	if err != nil || env.request("POST", "/v1/auth/logout", loggedOut, nil).Code != http.StatusOK {
		f.Fatalf("log out a token: %v", err)
	}
	carol := env.addUser("Carol", "carol@example.com", "carol-password")
	mustExec(f, env.st, `DELETE FROM users WHERE id = ?`, carol.id)
	live := map[string]testUser{}
	for _, u := range []testUser{alice, bob} {
		_, secret, _ := strings.Cut(u.token, "|")
		live[u.token], live[secret] = u, u
	}
	aliceID, aliceSecret, _ := strings.Cut(alice.token, "|")
	repl := strings.NewReplacer("{A}", alice.token, "{B}", bob.token, "{L}", loggedOut, "{C}", carol.token, "{Aid}", aliceID, "{As}", aliceSecret)
	for _, h := range []string{
		"Bearer {A}", "Bearer {B}", "Bearer {L}", "Bearer {C}", "bearer {A}", "Bearer  {A}", "Bearer\t{A}", "Bearer {A} ",
		"Bearer {A}x", "Bearer {Aid}|", "Bearer {Aid}|wrong", "Bearer 0{Aid}|{As}", "Bearer -1|{As}", "Bearer 99999999999999999999|{As}",
		"Bearer |{As}", "Bearer {As}", "Bearer {Aid}", "Bearer {Aid}|{As}\x00", "Bearer ", "", "Token {A}", "Bearer \xff\xfe",
	} {
		f.Add(h)
	}

	f.Fuzz(func(t *testing.T, header string) {
		env.t = t // the helpers may not call the *testing.F here
		env.logs.Take()
		header = repl.Replace(header)
		req := newRequest("GET", "/v1/auth/me", "", "", nil)
		req.Header["Authorization"] = []string{header}
		w := env.serve(t, req)
		v := fuzzAnswer(t, env, w)
		tok, bearer := strings.CutPrefix(header, "Bearer ")
		if u, ok := live[tok]; ok && bearer {
			data, _ := v["data"].(map[string]any)
			if w.Code != http.StatusOK || fmt.Sprint(data["id"]) != fmt.Sprint(u.id) || data["email"] != u.email {
				fuzzFail(t, env, w, "token of %s: want 200 with that user", u.email)
			}
		} else if w.Code != http.StatusUnauthorized || len(v) != 1 || v["message"] != "Unauthenticated." {
			fuzzFail(t, env, w, "not a live token: want 401 {\"message\":\"Unauthenticated.\"}")
		}
	})
}

// FuzzDeviceMessage feeds fuzzed topics, payloads and retained flags to
// the link's message handler, without a broker, then flushes. Properties:
// nothing panics or is logged; each message is counted as dropped at most
// once; one that names no known device under devices/, or is over 16 KiB,
// is dropped and changes nothing; otherwise only the rows of the device's
// owner may change, and when they do the device was seen now (last_seen_at
// kept by a retained replay that has one) and only a status message set
// the status, to what it says (surrounding white space forgiven); every
// status stays pending, online, offline or reconnecting and current_md5
// NULL or 32 lowercase hex digits.
func FuzzDeviceMessage(f *testing.F) {
	env := newTestEnv(f, nil)
	alice, bob := env.alice, env.bob
	_, faMD5 := env.uploadOK(alice, map[string]string{"name": "alice"}, fuzzFirmwareA1)
	_, fbMD5 := env.uploadOK(bob, map[string]string{"name": "bob"}, fuzzFirmwareB)
	env.setTarget(alice, faMD5)
	l := newOfflineLink(env.st, env.log)
	repl := strings.NewReplacer("{A}", alice.device, "{B}", bob.device, "{FA}", faMD5, "{FAU}", strings.ToUpper(faMD5), "{FB}", fbMD5)
	for _, s := range []struct {
		topic, payload string
		retained       bool
	}{
		{"devices/{A}/status", "online", false},
		{"devices/{A}/status", "offline", true},
		{"devices/{B}/status", "reconnecting\n", false},
		{"devices/{A}/status", "Online", false},
		{"devices/{A}/telemetry", `{"local_ip":"192.168.1.20","public_ip":"203.0.113.9","rssi":-61,"fw_md5":"{FAU}","fw_version":"1.0"}`, false},
		{"devices/{A}/telemetry", `{"fw_md5":"{FB}"}`, true},
		{"devices/{B}/telemetry", `{"rssi":-1e308,"fw_version":"only version"}`, false},
		{"devices/{A}/telemetry", `{"fw_md5":"not-hex-not-hex-not-hex-not-hex!"}`, false},
		{"devices/{A}/telemetry", `{"local_ip":"` + strings.Repeat("1", 256) + `"}`, false},
		{"devices/{A}/telemetry", `{"local_ip":"\u0000 \ud800 日本"}`, false},
		{"devices/{A}/telemetry", `{"pad":"` + strings.Repeat("x", 17000) + `"}`, false},
		{"devices/{A}/telemetry", `{"metrics":{` + fuzzMetrics("m", 16) + `}}`, false},
		{"devices/{A}/telemetry", `{"metrics":{` + fuzzMetrics("n", 3) + `}}`, false}, // past the device's series
		{"devices/{A}/result/no-such-command", `{"ok":true,"result":{"x":1}}`, false},
		{"devices/{A}/result/no-such-command", `{"progress":101}`, false},
		{"devices/{A}/cmd/1", `{"cmd":"reboot"}`, false},
		{"devices/{A}/status/extra", "online", false},
		{"devices//status", "online", false},
		{"other/{A}/status", "online", false},
	} {
		f.Add(s.topic, []byte(s.payload), s.retained)
	}
	lowerMD5 := regexp.MustCompile(`^[0-9a-f]{32}$`)
	teamID := map[string]int64{alice.device: alice.id, bob.device: bob.id}

	f.Fuzz(func(t *testing.T, topic string, payload []byte, retained bool) {
		env.t = t // the helpers may not call the *testing.F here
		env.logs.Take()
		topic, payload = repl.Replace(topic), []byte(repl.Replace(string(payload)))
		env.clock.advance(time.Second)
		now := env.st.Timestamp()
		before := dbState(t, env.st)
		seenBefore, statusBefore := map[string]string{}, map[string]string{}
		for uid := range teamID {
			seenBefore[uid] = scalar(t, env.st, `SELECT last_seen_at FROM devices WHERE uid = ?`, uid)
			statusBefore[uid] = scalar(t, env.st, `SELECT status FROM devices WHERE uid = ?`, uid)
		}
		d0, f0 := dropTotal(l), partsDropped(l)
		l.Handle(topic, payload, retained)
		l.Flush()
		// A message is dropped once, for one reason; but bad_telemetry
		// counts each bad field of a telemetry whose others apply, and
		// then its device may still be unknown, and series_limit each
		// sample left out (docs/integrations.md).
		fields := partsDropped(l) - f0
		dropped := dropTotal(l) - d0 - fields
		if dropped == 0 {
			dropped = min(fields, 1)
		}
		after := dbState(t, env.st)
		if logs := env.logs.Take(); logs != "" {
			fuzzFail(t, env, nil, "the link logged:\n%s", logs)
		}
		for uid := range teamID {
			status := scalar(t, env.st, `SELECT status FROM devices WHERE uid = ?`, uid)
			md5sum := scalar(t, env.st, `SELECT current_md5 FROM devices WHERE uid = ?`, uid)
			if !slices.Contains([]string{"pending", "online", "offline", "reconnecting"}, status) || md5sum != "<nil>" && !lowerMD5.MatchString(md5sum) {
				fuzzFail(t, env, nil, "device %s has status %q, current_md5 %q", uid, status, md5sum)
			}
		}
		// The device the topic names, if it is a known one and the message
		// fits: only its rows may change.
		rest, _ := strings.CutPrefix(topic, "devices/")
		uid, kind, _ := strings.Cut(rest, "/")
		named := teamID[uid] != 0 && strings.HasPrefix(topic, "devices/") && len(payload) <= wire.MaxPayload
		changed := len(changedOwners(before, after)) > 0
		switch {
		case dropped < 0 || dropped > 1:
			fuzzFail(t, env, nil, "one message counted %d times as dropped", dropped)
		case !named && (dropped != 1 || changed):
			fuzzFail(t, env, nil, "a message on %q of %d bytes was not dropped, or changed something", topic, len(payload))
		case !named, !changed && dropped == 1:
			return
		}
		// Applied, at least as a sign of life (a result for an unknown
		// command is one, and is then counted as dropped).
		fuzzSame(t, env, nil, before, after, teamID[uid])
		wantSeen := now
		if retained && seenBefore[uid] != "<nil>" {
			wantSeen = seenBefore[uid]
		}
		wantDB(t, env.st, wantSeen, `SELECT last_seen_at FROM devices WHERE uid = ?`, uid)
		wantDB(t, env.st, "1", `SELECT first_seen_at IS NOT NULL FROM devices WHERE uid = ?`, uid)
		if status := scalar(t, env.st, `SELECT status FROM devices WHERE uid = ?`, uid); kind == "status" && status != strings.TrimSpace(string(payload)) ||
			kind != "status" && status != statusBefore[uid] {
			fuzzFail(t, env, nil, "a message on %s (%q) left status %q", kind, payload, status)
		}
	})
}

// fuzzMetrics returns n metrics named prefix0, prefix1… as JSON members.
func fuzzMetrics(prefix string, n int) string {
	members := make([]string, n)
	for i := range members {
		members[i] = fmt.Sprintf(`"%s%d":1`, prefix, i)
	}
	return strings.Join(members, ",")
}

// partsDropped counts the drops of a message's parts: its bad fields
// (bad_telemetry) and the samples left out (series_limit).
func partsDropped(l *mqttlink.Offline) int64 {
	d := l.Stats().Drops
	return d["bad_telemetry"] + d["series_limit"]
}

// FuzzOTALink fuzzes the uid and file path segments (escaped, or raw),
// the exp and sig query values, the device's sketch-md5 header and the
// clock. Properties: never 5xx; a download (200, 206 or 304) only for
// exactly a link that otaURL issued (same uid, md5, expiry and signature)
// and that has not expired, a 200 with the file's bytes and x-MD5, a 304
// only when the sketch md5 is the file's; "Firmware not found." only for
// such a link; every other answer a JSON 403 or 404.
func FuzzOTALink(f *testing.F) {
	env := newTestEnv(f, nil)
	alice, bob := env.alice, env.bob
	_, fa := env.uploadOK(alice, map[string]string{"name": "alice"}, fuzzFirmwareA1)
	_, fb := env.uploadOK(bob, map[string]string{"name": "bob"}, fuzzFirmwareB)
	fdID, fd := env.uploadOK(alice, map[string]string{"name": "deleted"}, fuzzFirmwareA2)
	t0 := env.clock.now()

	type pair struct{ uid, md5 string }
	issued := map[pair]url.Values{}
	for _, p := range []pair{{alice.device, fa}, {bob.device, fb}, {alice.device, fb}, {bob.device, fa}, {alice.device, fd}} {
		u, err := url.Parse(env.srv.ota.url(p.uid, p.md5))
		must(f, err)
		issued[p] = u.Query()
	}
	must(f, env.st.DeleteFirmware(context.Background(), env.deviceRef(alice), fmt.Sprint(fdID), nil))
	files := map[pair][]byte{{alice.device, fa}: fuzzFirmwareA1, {bob.device, fb}: fuzzFirmwareB}
	repl := strings.NewReplacer("{A}", alice.device, "{B}", bob.device, "{FA}", fa, "{FAU}", strings.ToUpper(fa),
		"{FB}", fb, "{FD}", fd, "{exp}", issued[pair{alice.device, fa}].Get("exp"))

	day := int64(otaLinkLifetime / time.Second)
	for _, s := range []struct {
		uid, file, exp, sig, sketch string
		delta                       int64
		raw                         bool
	}{
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "", day, false},
		{"{A}", "{FA}.bin", "{exp}", "{sig}", "{FAU}", 0, false},
		{"{B}", "{FB}.bin", "{exp}", "{sig}", "", 3600, true},
		{"{A}", "{FB}.bin", "{exp}", "{sig}", "", 0, false}, // signed, but bob's firmware
		{"{A}", "{FD}.bin", "{exp}", "{sig}", "", 0, false}, // signed, then deleted
		{"{B}", "{FA}.bin", "{exp}", "", "", 0, false},
		{"{A}", "{FA}", "{exp}", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "9223372036854775807", "{sig}", "", 0, false},
		{"{A}", "{FA}.bin", "{exp}&sig={sig}", "x", "", 0, true},
		{"..", "{FA}.bin", "{exp}", "{sig}", "", 0, true},
		{"%41", "{FA}.bin", "{exp}", "{sig}", "", 0, true},
		{"日本", "ü.bin", "{exp}", "{sig}", "", 0, false},
	} {
		f.Add(s.uid, s.file, s.exp, s.sig, s.sketch, s.delta, s.raw)
	}

	f.Fuzz(func(t *testing.T, uid, file, exp, sig, sketch string, delta int64, raw bool) {
		env.t = t // the helpers may not call the *testing.F here
		env.logs.Take()
		uid, file, exp, sketch = repl.Replace(uid), repl.Replace(file), repl.Replace(exp), repl.Replace(sketch)
		if q, ok := issued[pair{uid, strings.TrimSuffix(file, ".bin")}]; ok {
			exp, sig = strings.ReplaceAll(exp, "{sig}", q.Get("sig")), strings.ReplaceAll(sig, "{sig}", q.Get("sig"))
		}
		now := t0.Add(time.Duration(delta%(20*365*day)) * time.Second)
		env.clock.set(now)
		target := "/ota/" + url.PathEscape(uid) + "/" + url.PathEscape(file) + "?" + url.Values{"exp": {exp}, "sig": {sig}}.Encode()
		if raw {
			target = "/ota/" + uid + "/" + file + "?exp=" + exp + "&sig=" + sig
		}
		u, err := url.ParseRequestURI(target)
		if err != nil || strings.ContainsFunc(target, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
			return // not a request line a client can send
		}
		req := httptest.NewRequest("GET", "/", nil)
		req.URL, req.RequestURI = u, target
		if sketch != "" {
			req.Header.Set("x-ESP32-sketch-md5", sketch)
		}
		w := env.serve(t, req)

		// The link the request names, if it is one that was issued and is
		// still valid.
		segs := strings.Split(strings.TrimPrefix(u.Path, "/ota/"), "/")
		var p pair
		if len(segs) == 2 && strings.HasPrefix(u.Path, "/ota/") {
			p = pair{segs[0], strings.TrimSuffix(segs[1], ".bin")}
		}
		q, isIssued := issued[p]
		// The expiry is signed as a number: "+1" and "01" are spellings of 1.
		expires, _ := strconv.ParseInt(q.Get("exp"), 10, 64)
		gotExp, err := strconv.ParseInt(u.Query().Get("exp"), 10, 64)
		valid := isIssued && err == nil && gotExp == expires && u.Query().Get("sig") == q.Get("sig") && now.Unix() < expires
		content, exists := files[p]
		body := strings.TrimSpace(w.Body.String())
		switch w.Code {
		case http.StatusOK, http.StatusPartialContent, http.StatusNotModified:
			if !valid || !exists {
				fuzzFail(t, env, w, "%s is not an issued, unexpired link to an existing firmware", target)
			}
			if w.Code == http.StatusOK && (!bytes.Equal(w.Body.Bytes(), content) || w.Header().Get("x-MD5") != p.md5) ||
				w.Code == http.StatusNotModified && !strings.EqualFold(sketch, p.md5) {
				fuzzFail(t, env, w, "issued link %s: want the file's bytes, or 304 only to a device running it", target)
			}
		case http.StatusNotFound:
			if body == `{"message":"Firmware not found."}` && !valid || body != `{"message":"Not found."}` && body != `{"message":"Firmware not found."}` {
				fuzzFail(t, env, w, "404 for %s (valid %v)", target, valid)
			}
		case http.StatusForbidden:
			if body != `{"message":"Invalid or expired link."}` {
				fuzzFail(t, env, w, "403 for %s", target)
			}
		default:
			fuzzFail(t, env, w, "%s: want a download, 403 or 404", target)
		}
	})
}
