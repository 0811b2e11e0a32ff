package main

// `devicehub device import`: a fleet from CSV, all or nothing (the SQL
// is ImportDevices in internal/store/store_admin.go).

import (
	"bufio"
	"context"
	"devicehub/internal/store"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"unicode/utf8"
)

// importHeader is the one header line an import accepts.
var importHeader = []string{"uid", "name", "platform", "board"}

// uidSuffix is what a given uid has after "<platform>_".
var uidSuffix = regexp.MustCompile(`^[a-z0-9]{1,32}$`)

// cmdDeviceImport reads devices from CSV on stdin (uid,name,platform,board)
// and creates them for the team of -owner in one transaction: a bad row is
// named by its line number and nothing is created. It refuses to run with
// -mqtt-dynsec: a broker login is made one device at a time, by the
// broker's control topic, and a million of them in one go is neither
// atomic with the rows nor quick; such fleets are added with 'device add'
// or the API, or imported with logins the operator makes on the broker.
func cmdDeviceImport(ctx context.Context, c *cli, args []string) error {
	owner := c.fs.String("owner", "", "email of a user of the team that gets the devices (required)")
	mqttPort := c.fs.Int("mqtt-port", 1883, "broker port the devices were provisioned with")
	if err := c.parse(args, "owner"); err != nil {
		return err
	}
	if err := checkMQTTPort("device import", *mqttPort); err != nil {
		return err
	}
	if c.cfg.mqttDynsec {
		return usageError{"device import: makes no broker logins, so it does not run with -mqtt-dynsec: " +
			"add such devices with 'device add' or POST /v1/user/devices, or import with -mqtt-dynsec=false and make their logins on the broker"}
	}
	st, u, err := c.owner(ctx, *owner)
	if err != nil {
		return err
	}
	// The transaction holds the database's write lock: it must not wait
	// on a slow stdin, so the CSV is read to a temporary file first.
	spool, err := os.CreateTemp("", "devicehub-import-*.csv")
	if err != nil {
		return err
	}
	defer os.Remove(spool.Name())
	defer spool.Close()
	if _, err := io.Copy(spool, c.stdin); err != nil {
		return fmt.Errorf("device import: read stdin: %w", err)
	}
	if _, err := spool.Seek(0, io.SeekStart); err != nil {
		return err
	}
	n, err := st.ImportDevices(ctx, u.TeamID, *mqttPort, func(add func(store.NewDevice) error) error {
		return readImport(bufio.NewReader(spool), add)
	})
	if err != nil {
		return fmt.Errorf("device import: nothing imported: %w", err)
	}
	fmt.Fprintf(c.stdout, "imported %d devices\n", n)
	return nil
}

// readImport checks the header, then passes each row to add as a new
// device; the first bad row stops it with an error naming its line.
func readImport(in io.Reader, add func(store.NewDevice) error) error {
	r := csv.NewReader(in)
	r.FieldsPerRecord = len(importHeader)
	r.ReuseRecord = true
	for first := true; ; first = false {
		rec, err := r.Read()
		if errors.Is(err, io.EOF) {
			if first {
				return errors.New("no header line: want " + strings.Join(importHeader, ","))
			}
			return nil
		}
		if err != nil { // a csv.ParseError names its line
			return err
		}
		line, _ := r.FieldPos(0)
		if first {
			if strings.Join(rec, ",") != strings.Join(importHeader, ",") {
				return fmt.Errorf("line %d: header %q, want %q", line, strings.Join(rec, ","), strings.Join(importHeader, ","))
			}
			continue
		}
		nd, err := importRow(rec)
		if err == nil {
			err = add(nd)
		}
		if errors.Is(err, store.ErrUIDTaken) {
			err = fmt.Errorf("uid %q is taken (by an earlier line, or by a device that exists)", nd.UID)
		}
		if err != nil {
			return fmt.Errorf("line %d: %w", line, err)
		}
	}
}

// importRow checks one row, uid,name,platform,board: keys as 'device
// add' takes them, a given uid <platform>_[a-z0-9]{1,32}, a name of at
// most 255 characters. An empty uid is drawn here, so that an error can
// name it.
func importRow(rec []string) (store.NewDevice, error) {
	nd := store.NewDevice{UID: rec[0], Name: rec[1], Platform: rec[2], Board: rec[3]}
	for _, key := range [][2]string{{"platform", nd.Platform}, {"board", nd.Board}} {
		if !validID(key[1]) {
			return nd, fmt.Errorf("%s %q: want 1-64 letters, digits, dots, underscores or dashes", key[0], key[1])
		}
	}
	if suffix, ok := strings.CutPrefix(nd.UID, nd.Platform+"_"); nd.UID != "" && (!ok || !uidSuffix.MatchString(suffix)) {
		return nd, fmt.Errorf("uid %q: want empty, or %s_ and 1-32 lowercase letters or digits", nd.UID, nd.Platform)
	}
	if !utf8.ValidString(nd.Name) || utf8.RuneCountInString(nd.Name) > 255 {
		return nd, fmt.Errorf("name: want at most 255 characters of UTF-8")
	}
	if nd.UID == "" {
		nd.UID = store.NewDeviceUID(nd.Platform)
	}
	return nd, nil
}
