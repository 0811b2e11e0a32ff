package store

// The store's users and personal access tokens.

import (
	"context"
	"database/sql"
	"devicehub/internal/model"
	"errors"
	"fmt"
	"strings"
	"time"
)

// CreateUser adds a user to the team of the user with email teamOf, or,
// when teamOf is empty, to a new team named after them. ErrEmailTaken when
// the email is taken; ErrUserNotFound when teamOf is nobody's.
func (s *Store) CreateUser(ctx context.Context, name, email string, r model.Role, passwordHash, teamOf string) (id int64, err error) {
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		var teamID int64
		if teamOf != "" {
			err := tx.QueryRowContext(ctx, `SELECT team_id FROM users WHERE email = ?`, NormalizeEmail(teamOf)).Scan(&teamID)
			if err != nil {
				return notFound(err, ErrUserNotFound)
			}
		} else if err := tx.QueryRowContext(ctx, `INSERT INTO teams (name, created_at) VALUES (?, ?) RETURNING id`,
			name+"'s team", s.Timestamp()).Scan(&teamID); err != nil {
			return fmt.Errorf("insert team: %w", err)
		}
		id, err = insertUser(ctx, tx, teamID, name, email, r, passwordHash, s.Timestamp())
		return err
	})
	return id, err
}

// insertUser adds a user to a team; ErrEmailTaken when the email is taken.
func insertUser(ctx context.Context, tx *sql.Tx, teamID int64, name, email string, r model.Role, passwordHash, now string) (int64, error) {
	var id int64
	err := tx.QueryRowContext(ctx, `INSERT INTO users (team_id, name, email, role, password_hash, created_at)
		VALUES (?, ?, ?, ?, ?, ?) RETURNING id`, teamID, name, NormalizeEmail(email), r, passwordHash, now).Scan(&id)
	if isUniqueErr(err) {
		return 0, ErrEmailTaken
	}
	if err != nil {
		return 0, fmt.Errorf("insert user: %w", err)
	}
	return id, nil
}

func NormalizeEmail(email string) string { return strings.ToLower(strings.TrimSpace(email)) }

// UserRow is a user as the store reads one: with the password hash a
// login checks, and the version of that password (changePassword).
type UserRow struct {
	model.User
	PasswordHash    string `json:"-"`
	PasswordVersion int64  `json:"-"`
}

const userColumns = `id, name, email, role, email_verified_at, last_login_at, password_hash, password_version, team_id`

func scanUser(row scanner) (*UserRow, error) {
	u := &UserRow{}
	err := row.Scan(&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.PasswordHash,
		&u.PasswordVersion, &u.TeamID)
	if err != nil {
		return nil, notFound(err, ErrUserNotFound)
	}
	return u, nil
}

// UserByEmail returns the user with that email (case-insensitive) or ErrUserNotFound.
func (s *Store) UserByEmail(ctx context.Context, email string) (*UserRow, error) {
	return scanUser(s.reader.QueryRowContext(ctx, `SELECT `+userColumns+` FROM users WHERE email = ?`, NormalizeEmail(email)))
}

// userByID returns the user with that id or ErrUserNotFound.
func (s *Store) userByID(ctx context.Context, id int64) (*UserRow, error) {
	return userIn(ctx, s.reader, id)
}

func userIn(ctx context.Context, q queryer, id int64) (*UserRow, error) {
	return scanUser(q.QueryRowContext(ctx, `SELECT `+userColumns+` FROM users WHERE id = ?`, id))
}

// ErrPasswordChanged: the user's password changed after a login checked
// it, or the user was removed (CreateToken); the login is answered as a
// wrong password.
var ErrPasswordChanged = errors.New("the password changed during the login")

// CreateToken stores a new token for the user and returns its id. A
// login passes the password version it read with the hash it checked
// (loginVersion): its token is stored, and the login time recorded, only
// while that is still the user's, else ErrPasswordChanged; it replaces
// the user's older tokens of the same name (a client that logs in again
// keeps one token, not one per login), and at the token limit it makes
// room (makeTokenRoom). A token a signed-in user makes (loginVersion nil)
// is refused at the limit with a QuotaError. audit is made of its id.
func (s *Store) CreateToken(ctx context.Context, userID int64, name string, secretHash []byte, loginVersion *int64, audit Audit[int64]) (int64, error) {
	login := loginVersion != nil
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if login {
			var version int64
			err := tx.QueryRowContext(ctx, `SELECT password_version FROM users WHERE id = ?`, userID).Scan(&version)
			if err != nil {
				return notFound(err, ErrPasswordChanged) // the user is gone: no password is right
			}
			if version != *loginVersion {
				return ErrPasswordChanged
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE user_id = ? AND name = ?`, userID, name); err != nil {
				return err
			}
		}
		if err := s.makeTokenRoom(ctx, tx, userID, login); err != nil {
			return err
		}
		now := s.Timestamp()
		res, err := tx.ExecContext(ctx,
			`INSERT INTO tokens (user_id, name, secret_hash, created_at) VALUES (?, ?, ?, ?)`,
			userID, name, secretHash, now)
		if err != nil {
			return fmt.Errorf("insert token: %w", err)
		}
		if id, err = res.LastInsertId(); err != nil {
			return err
		}
		if login {
			if _, err = tx.ExecContext(ctx, `UPDATE users SET last_login_at = ? WHERE id = ?`, now, userID); err != nil {
				return err
			}
		}
		return insertAudit(ctx, tx, audit, id)
	})
	return id, err
}

// makeTokenRoom checks the user's token count against the limit. For a
// login it deletes, until one more fits, tokens never used (oldest first),
// then the least recently used: a flood of logins recycles its own tokens,
// not one an integration is using. Any other new token is refused with a
// QuotaError.
func (s *Store) makeTokenRoom(ctx context.Context, tx *sql.Tx, userID int64, login bool) error {
	max := s.limits.Tokens
	if max <= 0 {
		return nil
	}
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT count(*) FROM tokens WHERE user_id = ?`, userID).Scan(&n); err != nil {
		return err
	}
	if n < max {
		return nil
	}
	if !login {
		return &QuotaError{Quota: QuotaTokens, Limit: max}
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE id IN (SELECT id FROM tokens WHERE user_id = ?
		ORDER BY last_used_at IS NOT NULL, COALESCE(last_used_at, created_at), id LIMIT ?)`, userID, n-max+1)
	return err
}

const tokenQuery = `SELECT t.id, t.name, t.last_used_at, t.created_at, t.secret_hash,
	u.id, u.name, u.email, u.role, u.email_verified_at, u.last_login_at, u.team_id
	FROM tokens t JOIN users u ON u.id = t.user_id WHERE `

// TokenRow is a token as the store reads one: with the SHA-256 of its
// secret (the secret itself is never kept) and its user.
type TokenRow struct {
	model.TokenInfo
	SecretHash []byte      `json:"-"`
	User       *model.User `json:"-"`
}

// scanToken reads a row of tokenQuery.
func scanToken(row scanner) (*TokenRow, error) {
	t := &TokenRow{User: &model.User{}}
	u := t.User
	err := row.Scan(&t.ID, &t.Name, &t.LastUsedAt, &t.CreatedAt, &t.SecretHash,
		&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.TeamID)
	if err != nil {
		return nil, notFound(err, ErrTokenNotFound)
	}
	return t, nil
}

// TokenByID returns the token with its user, or ErrTokenNotFound.
func (s *Store) TokenByID(ctx context.Context, id int64) (*TokenRow, error) {
	return s.cache.token(ctx, id, func() (*TokenRow, error) {
		return scanToken(s.reader.QueryRowContext(pointRead(ctx), tokenQuery+`t.id = ?`, id))
	})
}

// TokenByHash returns the token whose secret hashes to h with its user,
// or ErrTokenNotFound.
func (s *Store) TokenByHash(ctx context.Context, h []byte) (*TokenRow, error) {
	return scanToken(s.reader.QueryRowContext(ctx, tokenQuery+`t.secret_hash = ?`, h))
}

// TouchToken records a use of the token.
func (s *Store) TouchToken(ctx context.Context, id int64) error {
	_, err := s.writer.ExecContext(ctx, `UPDATE tokens SET last_used_at = ? WHERE id = ?`, s.Timestamp(), id)
	return err
}

// TokensOf lists the user's tokens, oldest first.
func (s *Store) TokensOf(ctx context.Context, userID int64) ([]*TokenRow, error) {
	return queryAll(ctx, s.reader, scanToken, tokenQuery+`t.user_id = ? ORDER BY t.id`, userID)
}

// UserToken returns one of the user's tokens, or ErrTokenNotFound.
func (s *Store) UserToken(ctx context.Context, userID, id int64) (*TokenRow, error) {
	return scanToken(s.reader.QueryRowContext(ctx, tokenQuery+`u.id = ? AND t.id = ?`, userID, id))
}

// DeleteUserToken removes one of the user's tokens, or returns
// ErrTokenNotFound when the user has no token with that id. audit is
// made of the id.
func (s *Store) DeleteUserToken(ctx context.Context, userID, id int64, audit Audit[int64]) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		if err := deleteTokens(tx.ExecContext(ctx, `DELETE FROM tokens WHERE id = ? AND user_id = ?`, id, userID)); err != nil {
			return err
		}
		return insertAudit(ctx, tx, audit, id)
	})
}

// DeleteToken removes the token with that id, whoever's it is ('token
// revoke'), or returns ErrTokenNotFound.
func (s *Store) DeleteToken(ctx context.Context, id int64) error {
	return deleteTokens(s.writer.ExecContext(ctx, `DELETE FROM tokens WHERE id = ?`, id))
}

// deleteTokens is ErrTokenNotFound when a DELETE of tokens deleted none.
func deleteTokens(res sql.Result, err error) error {
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return ErrTokenNotFound
	}
	return nil
}

// RememberClient records that the user logged in from addr now, keeping
// their most recent MaxKnownPerEmail addresses.
func (s *Store) RememberClient(ctx context.Context, userID int64, addr string) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO known_clients (user_id, addr, at) VALUES (?, ?, ?)
			ON CONFLICT (user_id, addr) DO UPDATE SET at = excluded.at`, userID, addr, s.Timestamp())
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM known_clients WHERE user_id = ?1 AND addr NOT IN
			(SELECT addr FROM known_clients WHERE user_id = ?1 ORDER BY at DESC LIMIT ?2)`, userID, MaxKnownPerEmail)
		return err
	})
}

// KnownClients returns where each user logged in since since, oldest
// first: email, address and time.
func (s *Store) KnownClients(ctx context.Context, since time.Time) ([][3]string, error) {
	return queryAll(ctx, s.reader, func(row scanner) (k [3]string, err error) {
		return k, row.Scan(&k[0], &k[1], &k[2])
	}, `SELECT u.email, k.addr, k.at FROM known_clients k JOIN users u ON u.id = k.user_id
		WHERE k.at > ? ORDER BY k.at`, since.UTC().Format(TimeFormat))
}

// MaxKnownPerEmail is how many client addresses are remembered per
// email, the most recent.
const MaxKnownPerEmail = 8
