package main

// The admin commands that run a fleet from the command line: users,
// devices and tokens (the command table is in main.go, the SQL in internal/store/store_admin.go).

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode/utf8"

	"devicehub/internal/model"
	"devicehub/internal/mqttlink"
	"devicehub/internal/store"
)

// checkEmail refuses an email that is not a bare address (validEmail).
func checkEmail(email string) error {
	if !validEmail(email) {
		return usageError{fmt.Sprintf("invalid email %q: want a bare address such as ann@example.com", email)}
	}
	return nil
}

// readPassword reads a new password: on a terminal it prompts on stderr,
// twice, with echo off; otherwise it takes the first line of stdin.
func (c *cli) readPassword(ctx context.Context) (string, error) {
	if f, ok := c.stdin.(*os.File); ok && isTerminal(f) {
		return c.promptPassword(ctx, f)
	}
	line, err := bufio.NewReader(c.stdin).ReadString('\n')
	if err != nil && line == "" {
		if errors.Is(err, io.EOF) {
			return "", errors.New(c.fs.Name() + ": no password on stdin (give it as its first line)")
		}
		return "", fmt.Errorf("read password from stdin: %w", err)
	}
	password := strings.TrimRight(line, "\r\n")
	if password == "" {
		return "", usageError{c.fs.Name() + ": empty password"}
	}
	return password, nil
}

// promptPassword asks for the password twice on the terminal tty, with
// echo off until it returns (also when ctx is cancelled by Ctrl-C).
func (c *cli) promptPassword(ctx context.Context, tty *os.File) (string, error) {
	restore, err := echoOff(tty)
	if err != nil {
		return "", err
	}
	defer restore()
	r := bufio.NewReader(tty)
	var answers [2]string
	for i, prompt := range []string{"Password: ", "Repeat password: "} {
		fmt.Fprint(c.stderr, prompt)
		line, err := readLineCtx(ctx, r)
		fmt.Fprintln(c.stderr) // the Enter key was not echoed
		if err != nil {
			return "", err
		}
		answers[i] = strings.TrimRight(line, "\r\n")
	}
	switch {
	case answers[0] == "":
		return "", usageError{c.fs.Name() + ": empty password"}
	case answers[0] != answers[1]:
		return "", usageError{c.fs.Name() + ": the passwords do not match"}
	}
	return answers[0], nil
}

// readLineCtx reads a line from r, giving up when ctx is done.
func readLineCtx(ctx context.Context, r *bufio.Reader) (string, error) {
	type result struct {
		line string
		err  error
	}
	ch := make(chan result, 1)
	go func() {
		line, err := r.ReadString('\n')
		ch <- result{line, err}
	}()
	select {
	case res := <-ch:
		if res.err != nil && res.line == "" {
			return "", fmt.Errorf("read password: %w", res.err)
		}
		return res.line, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// table writes rows as aligned columns under a header; empty cells show
// as "-", and a cell that is not plain text Go-quoted (shown). The
// free-text column (a name) goes last, so that the others stay easy to cut.
func table(w io.Writer, header string, rows [][]string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	for _, r := range rows {
		for i, cell := range r {
			r[i] = shown(cell)
		}
		fmt.Fprintln(tw, strings.Join(r, "\t"))
	}
	return tw.Flush()
}

// shown is a table cell as the operator's terminal is given it: "-" for
// empty, Go-quoted when it holds anything but graphic characters and
// spaces (a newline would forge a row, an escape sequence drive the
// terminal, a bidirectional override reorder the line; the API refuses
// them, but older rows or the database itself may hold them), else as it is.
func shown(cell string) string {
	switch {
	case cell == "":
		return "-"
	case !utf8.ValidString(cell) || strings.IndexFunc(cell, func(r rune) bool { return !strconv.IsGraphic(r) }) >= 0:
		return strconv.QuoteToGraphic(cell)
	}
	return cell
}

// orEmpty is *s, or "" for nil (which table shows as "-").
func orEmpty(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// listCommand runs a list command: it parses args (the command's flags
// defined), opens the store, and writes what load reads from it as a
// table under header, a row each as row renders it. email, unless nil,
// is the flag that narrows the list to a user's; an email that is no
// user's is an error naming it.
func listCommand[T any](ctx context.Context, c *cli, args []string, header string, email *string,
	load func(*store.Store) ([]T, error), row func(T) []string) error {
	if err := c.parse(args); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	items, err := load(st)
	if err != nil && email != nil {
		err = explainUser(err, *email)
	}
	if err != nil {
		return err
	}
	rows := make([][]string, len(items))
	for i, it := range items {
		rows[i] = row(it)
	}
	return table(c.stdout, header, rows)
}

func cmdUserList(ctx context.Context, c *cli, args []string) error {
	return listCommand(ctx, c, args, "ID\tEMAIL\tROLE\tTEAM\tDEVICES\tTOKENS\tCREATED\tLAST_LOGIN\tNAME", nil,
		func(st *store.Store) ([]*store.ListedUser, error) { return st.ListUsers(ctx) },
		func(u *store.ListedUser) []string {
			return []string{strconv.FormatInt(u.ID, 10), u.Email, string(u.Role), u.Team, strconv.Itoa(u.Devices),
				strconv.Itoa(u.Tokens), u.CreatedAt, orEmpty(u.LastLoginAt), u.Name}
		})
}

func cmdUserPasswd(ctx context.Context, c *cli, args []string) error {
	email := c.fs.String("email", "", "the user's email (required)")
	if err := c.parse(args, "email"); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	// Check the user before asking for a password that would be thrown away.
	if _, err := st.UserByEmail(ctx, *email); err != nil {
		return explainUser(err, *email)
	}
	password, err := c.readPassword(ctx)
	if err != nil {
		return err
	}
	hash, err := hashPassword(password, passwordIterations)
	if err != nil {
		return err
	}
	revoked, err := st.SetPassword(ctx, *email, hash)
	if err != nil {
		return explainUser(err, *email)
	}
	fmt.Fprintf(c.stdout, "password of %q changed; %d tokens revoked\n", store.NormalizeEmail(*email), revoked)
	return nil
}

func cmdUserRemove(ctx context.Context, c *cli, args []string) error {
	email := c.fs.String("email", "", "the user's email (required)")
	withDevices := c.fs.Bool("with-devices", false, "also delete the user's devices with their firmwares")
	if err := c.parse(args, "email"); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	devices, files, err := st.DeleteUser(ctx, *email, *withDevices)
	switch {
	case errors.Is(err, store.ErrUserNotFound):
		return fmt.Errorf("no user with email %q", *email)
	case errors.Is(err, store.ErrNeedsAdmin):
		return fmt.Errorf("user %q is the last admin of a team with other members: make another one admin first ('devicehub user add -team %q -role admin', or the team page)",
			*email, *email)
	case errors.Is(err, store.ErrUserHasDevices):
		return fmt.Errorf("user %q owns %d devices: remove them first ('devicehub device list -owner %q'), or pass -with-devices",
			*email, devices, *email)
	case err != nil:
		return err
	}
	fmt.Fprintf(c.stdout, "removed user %q with %d devices; %d firmware files deleted\n", store.NormalizeEmail(*email), devices, files)
	return nil
}

func cmdDeviceList(ctx context.Context, c *cli, args []string) error {
	owner := c.fs.String("owner", "", "list only the devices of this user's team (email)")
	return listCommand(ctx, c, args, "UID\tTEAM\tSTATUS\tPLATFORM\tBOARD\tLAST_SEEN\tNAME", owner,
		func(st *store.Store) ([]*model.DeviceSummary, error) { return st.ListDevices(ctx, *owner) },
		func(d *model.DeviceSummary) []string {
			return []string{d.UID, d.TeamName, string(d.Status), d.Platform.Key, d.Board.Key, orEmpty(d.LastSeenAt), d.Name}
		})
}

func cmdDeviceRemove(ctx context.Context, c *cli, args []string) error {
	uid, err := c.parseArg(args, "UID")
	if err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	logins, err := c.brokerLogins()
	if err != nil {
		return err
	}
	if logins != nil {
		defer logins.Close()
	}
	files := 0
	teamID, err := st.DeviceTeam(ctx, uid) // the operator's: any team's
	if err == nil {
		files, err = deleteDeviceWithLogin(ctx, st, logins, teamID, uid, nil)
	}
	if errors.Is(err, store.ErrDeviceNotFound) {
		return fmt.Errorf("no device with uid %q", uid)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "removed device %q; %d firmware files deleted\n", uid, files)
	return nil
}

// cmdDeviceCredentials issues the device a new broker password and prints
// its credentials as JSON (-mqtt-dynsec).
func cmdDeviceCredentials(ctx context.Context, c *cli, args []string) error {
	uid, err := c.parseArg(args, "UID")
	if err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	if _, err := st.DeviceTeam(ctx, uid); errors.Is(err, store.ErrDeviceNotFound) {
		return fmt.Errorf("no device with uid %q", uid)
	}
	logins, err := c.requireBrokerLogins()
	if err != nil {
		return err
	}
	defer logins.Close()
	password, err := logins.Rotate(ctx, uid)
	if err != nil {
		return err
	}
	out, err := json.MarshalIndent(model.Credentials(logins.Credentials(uid, password)), "", "  ")
	if err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, string(out))
	return nil
}

// cmdDeviceNarrowLogins gives every device's broker role exactly the
// protocol's topics, where earlier versions allowed everything under the
// device's prefix (-mqtt-dynsec). Run once after the upgrade; again is
// harmless.
func cmdDeviceNarrowLogins(ctx context.Context, c *cli, args []string) error {
	if err := c.parse(args); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	logins, err := c.requireBrokerLogins()
	if err != nil {
		return err
	}
	defer logins.Close()
	var narrowed, narrow, without int
	for after := ""; ; {
		uids, err := st.DeviceUIDsAfter(ctx, after, 500)
		if err != nil || len(uids) == 0 {
			fmt.Fprintf(c.stdout, "broker logins narrowed to the protocol's topics: %d; narrow already: %d; devices without one: %d\n",
				narrowed, narrow, without)
			return err
		}
		for _, uid := range uids {
			has, changed, err := logins.Narrow(ctx, uid)
			switch {
			case err != nil:
				return fmt.Errorf("device %s: %w", uid, err)
			case changed:
				narrowed++
			case has:
				narrow++
			default:
				without++
			}
		}
		after = uids[len(uids)-1]
	}
}

// requireBrokerLogins is brokerLogins for a command that cannot do
// without them: an error when -mqtt-dynsec is off.
func (c *cli) requireBrokerLogins() (*mqttlink.Logins, error) {
	logins, err := c.brokerLogins()
	if err == nil && logins == nil {
		err = fmt.Errorf("%s: broker logins are not managed by devicehub: pass -mqtt-dynsec", c.fs.Name())
	}
	return logins, err
}

// brokerLogins connects to the broker's dynamic security plugin when
// -mqtt-dynsec is on, and is nil when it is off; the caller closes it.
func (c *cli) brokerLogins() (*mqttlink.Logins, error) {
	if !c.cfg.mqttDynsec {
		return nil, nil
	}
	publicURL := c.cfg.publicURL
	if publicURL == "" { // as serve finds it, from -addr
		listen, err := net.ResolveTCPAddr("tcp", c.cfg.addr)
		if err != nil {
			return nil, fmt.Errorf("-addr: %w", err)
		}
		publicURL = defaultPublicURL(listen, net.InterfaceAddrs, c.logger())
	}
	brokerURL, err := c.cfg.publicBrokerURL(publicURL)
	if err != nil {
		return nil, err
	}
	return mqttlink.NewLogins(c.cfg.broker(), brokerURL, c.logger()), nil
}

func cmdTokenList(ctx context.Context, c *cli, args []string) error {
	email := c.fs.String("email", "", "list only this user's tokens")
	return listCommand(ctx, c, args, "ID\tEMAIL\tCREATED\tLAST_USED\tNAME", email,
		func(st *store.Store) ([]*store.TokenRow, error) { return st.ListTokens(ctx, *email) },
		func(t *store.TokenRow) []string {
			return []string{strconv.FormatInt(t.ID, 10), t.User.Email, t.CreatedAt, orEmpty(t.LastUsedAt), t.Name}
		})
}

func cmdTokenRevoke(ctx context.Context, c *cli, args []string) error {
	arg, err := c.parseArg(args, "ID")
	if err != nil {
		return err
	}
	id, err := strconv.ParseInt(arg, 10, 64)
	if err != nil || id <= 0 {
		return usageError{fmt.Sprintf("token revoke: %q is not a token id (the number 'token list' shows)", arg)}
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	if err := st.DeleteToken(ctx, id); errors.Is(err, store.ErrTokenNotFound) {
		return fmt.Errorf("no token with id %q", arg)
	} else if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "revoked token %d\n", id)
	return nil
}

func cmdUserAdd(ctx context.Context, c *cli, args []string) error {
	email := c.fs.String("email", "", "email (required)")
	name := c.fs.String("name", "", "name (required)")
	r := c.fs.String("role", string(model.RoleUser), "role: "+model.JoinStates(model.Roles))
	teamOf := c.fs.String("team", "", "join the team of the user with this email (default: a new team of their own)")
	password := c.fs.String("password", "", "password; discouraged: any local user sees it in the process list (default: prompted for on a terminal, else the first line of stdin)")
	if err := c.parse(args, "email", "name"); err != nil {
		return err
	}
	if err := checkEmail(*email); err != nil {
		return err
	}
	if !slices.Contains(model.Roles, model.Role(*r)) {
		return usageError{fmt.Sprintf("user add: role %q is not one of %s", *r, model.JoinStates(model.Roles))}
	}
	if *password != "" {
		fmt.Fprintln(c.stderr, "devicehub: warning: -password shows the password in the process list; pipe it on stdin instead")
	} else {
		p, err := c.readPassword(ctx)
		if err != nil {
			return err
		}
		*password = p
	}
	hash, err := hashPassword(*password, passwordIterations)
	if err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	id, err := st.CreateUser(ctx, *name, *email, model.Role(*r), hash, *teamOf)
	if errors.Is(err, store.ErrEmailTaken) {
		return fmt.Errorf("a user with email %q exists already", *email)
	}
	if errors.Is(err, store.ErrUserNotFound) {
		return explainUser(err, *teamOf)
	}
	if err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, id)
	return nil
}

// checkMQTTPort refuses a -mqtt-port that is no TCP port.
func checkMQTTPort(cmd string, port int) error {
	if port < 1 || port > 65535 {
		return usageError{fmt.Sprintf("%s: -mqtt-port %q is not 1-65535", cmd, strconv.Itoa(port))}
	}
	return nil
}

// owner opens the store and finds the user with email, whose team gets
// the devices a command creates.
func (c *cli) owner(ctx context.Context, email string) (*store.Store, *model.User, error) {
	st, err := c.openStore(ctx)
	if err != nil {
		return nil, nil, err
	}
	u, err := st.UserByEmail(ctx, email)
	if err != nil {
		return nil, nil, explainUser(err, email)
	}
	return st, &u.User, nil
}

func cmdDeviceAdd(ctx context.Context, c *cli, args []string) error {
	owner := c.fs.String("owner", "", "owner's email (required)")
	platform := c.fs.String("platform", "", "platform key, e.g. esp32 (required)")
	board := c.fs.String("board", "", "board key (required)")
	name := c.fs.String("name", "", "device name (default: its uid)")
	mqttPort := c.fs.Int("mqtt-port", 1883, "broker port the device was provisioned with")
	if err := c.parse(args, "owner", "platform", "board"); err != nil {
		return err
	}
	for _, key := range [][2]string{{"platform", *platform}, {"board", *board}} {
		if !validID(key[1]) {
			return usageError{fmt.Sprintf("device add: -%s %q may only contain letters, digits, dots, underscores and dashes", key[0], key[1])}
		}
	}
	if err := checkMQTTPort("device add", *mqttPort); err != nil {
		return err
	}
	st, u, err := c.owner(ctx, *owner)
	if err != nil {
		return err
	}
	nd := store.NewDevice{UID: store.NewDeviceUID(*platform), Platform: *platform, Board: *board, Name: *name, MQTTPort: *mqttPort}
	logins, err := c.brokerLogins()
	if err != nil {
		return err
	}
	if logins != nil { // its password is issued by 'device credentials'
		defer logins.Close()
	}
	if _, err := createDeviceWithLogin(ctx, st, logins, u.TeamID, nd, nil); err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, nd.UID)
	return nil
}

func cmdTokenCreate(ctx context.Context, c *cli, args []string) error {
	email := c.fs.String("email", "", "user's email (required)")
	name := c.fs.String("name", "", "token name (required)")
	if err := c.parse(args, "email", "name"); err != nil {
		return err
	}
	st, err := c.openStore(ctx)
	if err != nil {
		return err
	}
	u, err := st.UserByEmail(ctx, *email)
	if err != nil {
		return explainUser(err, *email)
	}
	_, tok, err := issueToken(ctx, st, u.ID, *name, nil, nil)
	var qe *store.QuotaError
	if errors.As(err, &qe) {
		return errors.New(quotaMessage(qe))
	}
	if err != nil {
		return err
	}
	fmt.Fprintln(c.stdout, tok)
	return nil
}

// explainUser turns store.ErrUserNotFound into a message that names the email;
// other errors pass through.
func explainUser(err error, email string) error {
	if errors.Is(err, store.ErrUserNotFound) {
		return fmt.Errorf("no user with email %q", email)
	}
	return err
}
