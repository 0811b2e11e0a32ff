package main

import (
	"encoding/json"
	"errors"
	"net/http"
	"slices"
)

// The streaming writer: a list answer written item by item as the store
// reads it, held in memory only up to a size and streamed past it.

// dataWriter writes an answer {"data": <head>[item, …]<tail>} whose
// array may be long (the device list, a rollout's devices), encoding each
// item as it comes. It holds the answer until it passes maxHeldAnswer,
// then writes it out and streams the rest in streamChunk writes, without
// a Content-Length: the server's memory does not grow with the array.
type dataWriter struct {
	w          http.ResponseWriter
	status     int
	head, tail string // the data around the array: "" for an array alone
	buf        []byte // the array so far, from its first item's comma
	streaming  bool   // the answer has begun
}

// newDataWriter is a dataWriter of an answer with status, its data the
// array alone until wrap says otherwise.
func newDataWriter(w http.ResponseWriter, status int) *dataWriter {
	return &dataWriter{w: w, status: status}
}

// wrap sets the data around the array, before the first item is added.
func (dw *dataWriter) wrap(head, tail string) { dw.head, dw.tail = head, tail }

// add appends an item to the array.
func (dw *dataWriter) add(item any) error {
	b, err := json.Marshal(item)
	if err != nil {
		return err
	}
	dw.buf = append(append(dw.buf, ','), b...)
	if len(dw.buf) > maxHeldAnswer || dw.streaming && len(dw.buf) > streamChunk {
		return dw.flush()
	}
	return nil
}

// flush writes out what buf holds, after the answer's head the first time.
func (dw *dataWriter) flush() error {
	if !dw.streaming {
		dw.w.Header().Set("Content-Type", "application/json")
		dw.w.WriteHeader(dw.status)
		dw.buf[0] = '[' // the first item's comma
		dw.buf = append([]byte(`{"data":`+dw.head), dw.buf...)
		dw.streaming = true
	}
	_, err := dw.w.Write(dw.buf)
	dw.buf = dw.buf[:0]
	return err
}

// errStreamedOut: a dataWriter's answer is written, streamed.
var errStreamedOut = errors.New("answer streamed")

// end closes the array. When the answer is held it returns the data
// (head, array, tail) for the caller to write; when it streams, it writes
// the rest of it and returns errStreamedOut (so that a read cache does not
// keep the answer).
func (dw *dataWriter) end() ([]byte, error) {
	if !dw.streaming {
		if len(dw.buf) == 0 {
			dw.buf = append(dw.buf, ',')
		}
		dw.buf[0] = '['
		return slices.Concat([]byte(dw.head), dw.buf, []byte("]"+dw.tail)), nil
	}
	dw.buf = append(dw.buf, "]"+dw.tail+"}\n"...)
	if err := dw.flush(); err != nil {
		return nil, err
	}
	return nil, errStreamedOut
}

// finish takes what writing dw's answer came to (err) and reports whether
// the answer is written, or returns the error to answer. A failure once
// the answer has begun cuts the connection (http.ErrAbortHandler), so
// that no client takes a part of the answer for the whole.
func (s *server) finish(dw *dataWriter, err error) (written bool, _ error) {
	switch {
	case errors.Is(err, errStreamedOut):
		return true, nil
	case err != nil && dw.streaming:
		s.log.Warn("answer cut short", "err", err)
		panic(http.ErrAbortHandler)
	}
	return false, err
}

const (
	// maxHeldAnswer is the longest array a dataWriter holds, to be answered
	// with a Content-Length (and a device list kept in the read cache).
	// BENCHMARKS.md has what holding it is worth.
	maxHeldAnswer = 256 << 10
	// streamChunk is how much of a streamed answer is written at once.
	streamChunk = 32 << 10
)
