package main

// The event stream, GET /v1/user/events: Server-Sent Events of what
// changes in the caller's fleet. The engines (the MQTT link, the
// commander, the rollout engine) and the handlers tell the hub what they
// changed; the hub keeps each team's recent events in a ring and wakes
// that team's streams; each stream's one write loop copies what it has
// not sent yet. A stream is scoped to the team that owns the devices.

import (
	"devicehub/internal/model"
	"devicehub/internal/store"
	"errors"
	"net/http"
	"time"
)

const (
	// eventRing and eventRingBytes bound a team's newest events kept for
	// a client that reconnects with Last-Event-ID: at most 10,000 events
	// and 1 MiB of frames, whichever is reached first.
	eventRing      = 10_000
	eventRingBytes = 1 << 20
	// maxStreams is how many streams a user may have open at once,
	// maxTeamStreams the members of a team together, and maxAllStreams
	// everyone: a stream holds no -max-conns slot, so these bound its
	// socket, goroutine and buffers (some tens of KiB each).
	maxStreams     = 10
	maxTeamStreams = 100
	maxAllStreams  = 1000
	// coalesceWindow is the least time between two telemetry-driven
	// device.status events of one device; a status change goes at once.
	coalesceWindow = 5 * time.Second
	// keepAliveEvery is how often a comment line keeps proxies from
	// closing an idle stream.
	keepAliveEvery = 25 * time.Second
	// tokenCheckEvery is how often a stream looks its token up again (in
	// the read cache, so one PRAGMA data_version while nothing changed): a
	// revoked token's stream ends within it.
	tokenCheckEvery = time.Second
	// streamWriteWait is how long one write to a stream may take; a
	// client that stops reading fills its socket and is dropped then.
	streamWriteWait = 10 * time.Second
	// ringIdle is how long a team's ring outlives its last stream.
	ringIdle = 10 * time.Minute
)

// The data of each event type, as openapi.json describes them.
type (
	// commandStateEvent is the data of command.state: which command of
	// which device, and its state.
	commandStateEvent struct {
		DeviceUID string     `json:"device_uid"`
		Command   commandRef `json:"command"`
	}
	// commandRef names a command: the client fetches the rest.
	commandRef struct {
		ID    string             `json:"id"`
		Kind  model.CommandKind  `json:"kind"`
		State model.CommandState `json:"state"`
	}
	// memberUpdated is the data of member.updated: a member's new role,
	// which their open pages redraw their controls for, or a member who
	// has just used their invite.
	memberUpdated struct {
		ID   int64      `json:"id"`
		Name string     `json:"name"`
		Role model.Role `json:"role"`
	}
	// rolloutProgress is the data of rollout.progress.
	rolloutProgress struct {
		ID     int64                            `json:"id"`
		State  model.RolloutState               `json:"state"`
		Counts map[model.RolloutDeviceState]int `json:"counts"`
	}
)

// handleEvents serves GET /v1/user/events: the caller's events as
// text/event-stream until the client goes, its token is revoked, or it
// stops reading. The stream gives back its -max-conns slot: it is no
// request in flight, and maxStreams, maxTeamStreams and maxAllStreams
// bound it.
func (s *server) handleEvents(w http.ResponseWriter, r *http.Request) error {
	ctx := r.Context()
	a := authFrom(ctx)
	st, err := s.events.subscribe(a.user.TeamID, a.user.ID)
	if err != nil {
		return err
	}
	defer s.events.unsubscribe(st)
	s.events.resume(st, r.Header.Get("Last-Event-ID"))
	releaseConnSlot(ctx)
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no") // nginx: pass each event on at once
	h.Set("Connection", "close")     // its slot is given back: no request may follow on it
	w.WriteHeader(http.StatusOK)
	writeWait, idle := s.events.streamWaits()
	// Each frame must go within writeWait: a client that stops reading
	// fills its socket, and is dropped then.
	write := func(frames ...[]byte) error {
		for _, f := range frames {
			rc.SetWriteDeadline(time.Now().Add(writeWait))
			if _, err := w.Write(f); err != nil {
				return err
			}
		}
		rc.SetWriteDeadline(time.Now().Add(writeWait))
		return rc.Flush()
	}
	keepAlive, check := time.NewTicker(idle), time.NewTicker(tokenCheckEvery)
	defer keepAlive.Stop()
	defer check.Stop()
	for {
		// The first round sends the headers, and a reset if one is due.
		frames := s.events.since(st)
		if err := write(frames...); err != nil {
			return nil // the client is gone, or stopped reading: drop it
		}
		if len(frames) == maxBatch {
			continue
		}
		select {
		case <-st.woken():
		case <-keepAlive.C:
			if err := write([]byte(": keep-alive\n\n")); err != nil {
				return nil
			}
		case <-check.C:
			if _, err := s.store.TokenByID(ctx, a.tokenID); errors.Is(err, store.ErrTokenNotFound) {
				return nil
			}
		case <-ctx.Done():
			return nil
		}
	}
}
