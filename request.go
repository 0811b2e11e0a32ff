package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/mail"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// A request body that is too large, or that could not be read.
var (
	errBodyTooLarge   = errors.New("request body too large")
	errBodyUnreadable = errors.New("request body could not be read")
)

// fieldErrors collects validation problems per field, in order. As an
// error it is answered as a 422 in Laravel's shape.
type fieldErrors struct {
	fields []string
	msgs   map[string][]string
}

func (e *fieldErrors) add(field, format string, args ...any) {
	if e.msgs == nil {
		e.msgs = map[string][]string{}
	}
	if _, ok := e.msgs[field]; !ok {
		e.fields = append(e.fields, field)
	}
	label := strings.ReplaceAll(field, "_", " ")
	e.msgs[field] = append(e.msgs[field], "The "+label+" field "+fmt.Sprintf(format, args...))
}

func (e *fieldErrors) Error() string { return "invalid fields: " + strings.Join(e.fields, ", ") }

// err returns e as an error, or nil when no field is wrong.
func (e *fieldErrors) err() error {
	if len(e.fields) == 0 {
		return nil
	}
	return e
}

// decodeField decodes a body whose one field, field, is a required
// string of at most 255 characters, and returns it.
func decodeField(w http.ResponseWriter, r *http.Request, field string) (string, error) {
	body, err := decodeJSON(w, r)
	if err != nil {
		return "", err
	}
	var e fieldErrors
	v := body.str(&e, field, true, 255)
	if err := e.err(); err != nil {
		return "", err
	}
	return *v, nil
}

// intField reads v, the value of field, as a whole number from lo to
// hi; a bad one is a field error in e.
func intField(e *fieldErrors, field, v string, lo, hi int) int {
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		e.add(field, "must be an integer between %d and %d.", lo, hi)
	}
	return n
}

// queryInt reads an integer parameter in [lo, hi], def when absent. A
// parameter given empty is a field error like any other value out of
// range (docs/decisions.md), not its default.
func queryInt(e *fieldErrors, q url.Values, field string, def, lo, hi int) int {
	if !q.Has(field) {
		return def
	}
	return intField(e, field, q.Get(field), lo, hi)
}

// historyLimit reads the ?limit= of a history, newest first (a device's
// commands, the audit log): 1 to 100, 25 when absent.
func historyLimit(e *fieldErrors, q url.Values) int {
	return queryInt(e, q, "limit", 25, 1, 100)
}

// validEmail reports whether email is a bare address: "ann@example.com",
// not "Ann <ann@example.com>" nor "ann@".
func validEmail(email string) bool {
	a, err := mail.ParseAddress(email)
	return err == nil && a.Name == "" && a.Address == email
}

// fieldError is a single field's problem as an error.
func fieldError(field, format string, args ...any) error {
	var e fieldErrors
	e.add(field, format, args...)
	return &e
}

// write answers 422 in Laravel's shape: the first message (and how many
// more there are) plus every message per field.
func (e *fieldErrors) write(w http.ResponseWriter) {
	n := 0
	for _, f := range e.fields {
		n += len(e.msgs[f])
	}
	msg := e.msgs[e.fields[0]][0]
	if n > 1 {
		plural := "s"
		if n == 2 {
			plural = ""
		}
		msg += fmt.Sprintf(" (and %d more error%s)", n-1, plural)
	}
	writeJSON(w, http.StatusUnprocessableEntity, struct {
		Message string              `json:"message"`
		Errors  map[string][]string `json:"errors"`
	}{msg, e.msgs})
}

// jsonBody is a decoded JSON object, its fields still raw.
type jsonBody map[string]json.RawMessage

// decodeJSON reads a JSON object body of at most maxJSONBody bytes. An
// empty body is an empty object.
func decodeJSON(w http.ResponseWriter, r *http.Request) (jsonBody, error) {
	return decodeJSONUpTo(w, r, maxJSONBody)
}

// decodeJSONUpTo is decodeJSON for a route whose bodies may be larger.
func decodeJSONUpTo(w http.ResponseWriter, r *http.Request, limit int64) (jsonBody, error) {
	if r.ContentLength > limit {
		return nil, errBodyTooLarge
	}
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if isTooBig(err) {
		return nil, errBodyTooLarge
	}
	if err != nil {
		return nil, errBodyUnreadable
	}
	body := jsonBody{}
	if len(bytes.Trim(data, " \t\r\n")) == 0 { // JSON's white space only
		return body, nil
	}
	if err := json.Unmarshal(data, &body); err != nil || body == nil {
		return nil, fieldError("body", "must be a valid JSON object.")
	}
	if hasDuplicateKey(data, false) {
		// Unmarshal kept the last; another parser may keep the first.
		return nil, fieldError("body", "must not contain duplicate keys.")
	}
	return body, nil
}

// hasDuplicateKey reports whether an object of the JSON text raw has a key
// twice (as unescaped), at its top level or, with deep, at any depth. Two
// parsers may disagree on which one counts. raw must be valid JSON.
func hasDuplicateKey(raw []byte, deep bool) bool {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dup, err := scanDuplicates(dec, deep, true)
	return dup && err == nil
}

// scanDuplicates reads the next value from dec and reports whether an
// object in it has a key twice; only the top level's when deep is false.
func scanDuplicates(dec *json.Decoder, deep, top bool) (bool, error) {
	tok, err := dec.Token()
	if err != nil {
		return false, err
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			key, err := dec.Token()
			if err != nil {
				return false, err
			}
			if seen[key.(string)] && (deep || top) {
				return true, nil
			}
			seen[key.(string)] = true
			if dup, err := scanDuplicates(dec, deep, false); dup || err != nil {
				return dup, err
			}
		}
	case json.Delim('['):
		for dec.More() {
			if dup, err := scanDuplicates(dec, deep, false); dup || err != nil {
				return dup, err
			}
		}
	default:
		return false, nil
	}
	_, err = dec.Token() // the closing delimiter
	return false, err
}

// validText reports whether the JSON text raw is text every parser reads
// the same: UTF-8, and no escaped UTF-16 surrogate without its pair
// (encoding/json would silently read either as U+FFFD; a device's parser
// may fail, or keep the bytes). raw must be valid JSON.
func validText(raw []byte) bool {
	if !utf8.Valid(raw) {
		return false
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		i++ // the escaped character: a backslash here is not a new escape
		if i+4 >= len(raw) || raw[i] != 'u' {
			continue
		}
		r := escapedRune(raw[i+1:])
		i += 4
		switch {
		case !utf16.IsSurrogate(r):
		case r < 0xDC00 && bytes.HasPrefix(raw[i+1:], []byte(`\u`)) && isLowSurrogate(escapedRune(raw[i+3:])):
			i += 6 // a high surrogate and its low one
		default:
			return false
		}
	}
	return true
}

// escapedRune is the code unit of the four hex digits b starts with.
func escapedRune(b []byte) rune {
	n, err := strconv.ParseUint(string(b[:min(4, len(b))]), 16, 16)
	if err != nil {
		return utf8.RuneError
	}
	return rune(n)
}

func isLowSurrogate(r rune) bool { return 0xDC00 <= r && r <= 0xDFFF }

func isNull(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

// has reports whether the body names field at all (null included).
func (b jsonBody) has(field string) bool {
	_, ok := b[field]
	return ok
}

// str reads an optional string field (absent or null: nil) of at most max
// characters, text as text checks it; required makes absence, null and
// blank an error.
func (b jsonBody) str(e *fieldErrors, field string, required bool, max int) *string {
	v, ok := b.jsonString(e, field, required)
	if !ok {
		return nil
	}
	return e.text(field, v, required, max)
}

// password reads a required string field that is a password, of at most
// max characters: any character goes, as a password is never shown.
func (b jsonBody) password(e *fieldErrors, field string, max int) *string {
	v, ok := b.jsonString(e, field, true)
	if !ok {
		return nil
	}
	return e.anyText(field, v, true, max)
}

// jsonString reads a string field: false when it is absent or null (an
// error when required), not a string, or not text every parser reads the
// same (validText).
func (b jsonBody) jsonString(e *fieldErrors, field string, required bool) (*string, bool) {
	raw := b[field]
	if isNull(raw) {
		if required {
			e.add(field, "is required.")
		}
		return nil, false
	}
	var v string
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be a string.")
		return nil, false
	}
	if !validText(raw) {
		e.add(field, "must be valid UTF-8.")
		return nil, false
	}
	return &v, true
}

// text checks a text field's value as anyText does, and refuses what
// would let it pass for other text where it is shown (a terminal, a
// table, a page): control characters and bidirectional formatting.
func (e *fieldErrors) text(field string, v *string, required bool, max int) *string {
	if v = e.anyText(field, v, required, max); v != nil && strings.IndexFunc(*v, hiddenRune) >= 0 {
		e.add(field, "must not contain control characters or bidirectional overrides.")
		return nil
	}
	return v
}

// anyText checks a string field's value: v nil is absent; required makes
// absence and blank an error. It returns v, or nil when v is wrong.
func (e *fieldErrors) anyText(field string, v *string, required bool, max int) *string {
	if v != nil && !utf8.ValidString(*v) { // a form field: JSON's were checked as text
		e.add(field, "must be valid UTF-8.")
		return nil
	}
	if required && (v == nil || strings.TrimSpace(*v) == "") {
		e.add(field, "is required.")
		return nil
	}
	if v != nil && utf8.RuneCountInString(*v) > max {
		e.add(field, "must not be greater than %d characters.", max)
		return nil
	}
	return v
}

// hiddenRune reports whether r is a C0 or C1 control character (newline
// and tab included: a name with a newline forges a row of the CLI's
// tables, one with ESC drives the operator's terminal), DEL, or a
// bidirectional embedding, override or isolate, which reorders the text
// around it on screen ("Trojan Source", CVE-2021-42574).
func hiddenRune(r rune) bool {
	return unicode.IsControl(r) || '\u202a' <= r && r <= '\u202e' || '\u2066' <= r && r <= '\u2069'
}

// clearable reads an optional string field that null clears: absent is
// nil (unchanged), null and "" are a pointer to "" (cleared).
func (b jsonBody) clearable(e *fieldErrors, field string, max int) *string {
	if !b.has(field) {
		return nil
	}
	if isNull(b[field]) {
		return new(string)
	}
	return b.str(e, field, false, max)
}

// object reads a field that must be a JSON object and returns it compacted
// (key order and values as sent). It refuses what parsers on a device could
// read differently: a key twice in an object, at any depth, and text that
// is not valid UTF-8.
func (b jsonBody) object(e *fieldErrors, field string) json.RawMessage {
	raw := b[field]
	if isNull(raw) {
		e.add(field, "is required.")
		return nil
	}
	var buf bytes.Buffer
	switch {
	case raw[0] != '{' || json.Compact(&buf, raw) != nil:
		e.add(field, "must be a JSON object.")
	case !validText(raw):
		e.add(field, "must be valid UTF-8.")
	case hasDuplicateKey(raw, true):
		e.add(field, "must not contain duplicate keys.")
	default:
		return buf.Bytes()
	}
	return nil
}

// boolean reads an optional boolean field (absent or null: false).
func (b jsonBody) boolean(e *fieldErrors, field string) bool {
	raw := b[field]
	if isNull(raw) {
		return false
	}
	var v bool
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be true or false.")
	}
	return v
}

// integer reads an optional whole-number field between min and max (absent
// or null: def).
func (b jsonBody) integer(e *fieldErrors, field string, def, min, max int) int {
	raw := b[field]
	if isNull(raw) {
		return def
	}
	var v int
	if err := json.Unmarshal(raw, &v); err != nil || v < min || v > max {
		e.add(field, "must be an integer between %d and %d.", min, max)
		return def
	}
	return v
}

// stringList reads a required field that must be an array of at most max
// strings.
func (b jsonBody) stringList(e *fieldErrors, field string, max int) []string {
	raw := b[field]
	if isNull(raw) {
		e.add(field, "is required.")
		return nil
	}
	var v []string
	if err := json.Unmarshal(raw, &v); err != nil {
		e.add(field, "must be an array of strings.")
		return nil
	}
	switch {
	case len(v) == 0:
		e.add(field, "must not be empty.")
	case len(v) > max:
		e.add(field, "must not have more than %d items.", max)
		return nil
	}
	return v
}

// idPattern is what a button id, a platform key and a board key may be:
// safe in a topic and a URL path segment.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// validID reports whether s matches idPattern and is not "." or "..",
// which would be cleaned out of a URL.
func validID(s string) bool { return idPattern.MatchString(s) && s != "." && s != ".." }
