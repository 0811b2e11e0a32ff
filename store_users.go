package main

// The store's users and personal access tokens.

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
)

type user struct {
	ID              int64   `json:"id"`
	Name            string  `json:"name"`
	Email           string  `json:"email"`
	Role            string  `json:"role"`
	EmailVerifiedAt *string `json:"email_verified_at"`
	LastLoginAt     *string `json:"last_login_at"`
	passwordHash    string
}

// createUser adds a user; errEmailTaken when the email is taken.
func (s *store) createUser(ctx context.Context, name, email, role, passwordHash string) (int64, error) {
	res, err := s.wdb.ExecContext(ctx,
		`INSERT INTO users (name, email, role, password_hash, created_at) VALUES (?, ?, ?, ?, ?)`,
		name, normalizeEmail(email), role, passwordHash, s.timestamp())
	if isUniqueErr(err) {
		return 0, errEmailTaken
	}
	if err != nil {
		return 0, fmt.Errorf("insert user: %w", err)
	}
	return res.LastInsertId()
}

func normalizeEmail(email string) string { return strings.ToLower(strings.TrimSpace(email)) }

// userByEmail returns the user with that email (case-insensitive) or errUserNotFound.
func (s *store) userByEmail(ctx context.Context, email string) (*user, error) {
	u := &user{}
	err := s.read.QueryRowContext(ctx,
		`SELECT id, name, email, role, email_verified_at, last_login_at, password_hash FROM users WHERE email = ?`,
		normalizeEmail(email)).Scan(&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt, &u.passwordHash)
	if err != nil {
		return nil, notFound(err, errUserNotFound)
	}
	return u, nil
}

// createToken stores a new token for the user, records the login time when
// login is true, and returns the token's id. At the token limit a login
// makes room (makeTokenRoom); any other new token is refused with a
// quotaError.
func (s *store) createToken(ctx context.Context, userID int64, name string, secretHash []byte, login bool) (int64, error) {
	var id int64
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		if err := s.makeTokenRoom(ctx, tx, userID, login); err != nil {
			return err
		}
		now := s.timestamp()
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
			_, err = tx.ExecContext(ctx, `UPDATE users SET last_login_at = ? WHERE id = ?`, now, userID)
		}
		return err
	})
	return id, err
}

// makeTokenRoom checks the user's token count against the limit. For a
// login it deletes, until one more fits, tokens never used (oldest first),
// then the least recently used: a flood of logins recycles its own tokens,
// not one an integration is using. Any other new token is refused with a
// quotaError.
func (s *store) makeTokenRoom(ctx context.Context, tx *sql.Tx, userID int64, login bool) error {
	max := s.limits.tokens
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
		return &quotaError{quotaTokens, max}
	}
	_, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE id IN (SELECT id FROM tokens WHERE user_id = ?
		ORDER BY last_used_at IS NOT NULL, COALESCE(last_used_at, created_at), id LIMIT ?)`, userID, n-max+1)
	return err
}

// tokenRecord is a stored token with its user, as authentication needs it.
type tokenRecord struct {
	id         int64
	secretHash []byte
	lastUsedAt string
	user       *user
}

const tokenQuery = `SELECT t.id, t.secret_hash, COALESCE(t.last_used_at, ''),
	u.id, u.name, u.email, u.role, u.email_verified_at, u.last_login_at
	FROM tokens t JOIN users u ON u.id = t.user_id WHERE `

// tokenByID returns the token row and its user, or errTokenNotFound.
func (s *store) tokenByID(ctx context.Context, id int64) (*tokenRecord, error) {
	return cached(ctx, s.cache, s.cache.tokens, id, func() (*tokenRecord, error) {
		return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.id = ?`, id))
	})
}

// tokenByHash returns the token whose secret hashes to h and its user, or errTokenNotFound.
func (s *store) tokenByHash(ctx context.Context, h []byte) (*tokenRecord, error) {
	return scanToken(s.read.QueryRowContext(ctx, tokenQuery+`t.secret_hash = ?`, h))
}

func scanToken(row *sql.Row) (*tokenRecord, error) {
	t := &tokenRecord{user: &user{}}
	u := t.user
	err := row.Scan(&t.id, &t.secretHash, &t.lastUsedAt,
		&u.ID, &u.Name, &u.Email, &u.Role, &u.EmailVerifiedAt, &u.LastLoginAt)
	if err != nil {
		return nil, notFound(err, errTokenNotFound)
	}
	return t, nil
}

// touchToken records a use of the token.
func (s *store) touchToken(ctx context.Context, id int64) error {
	_, err := s.wdb.ExecContext(ctx, `UPDATE tokens SET last_used_at = ? WHERE id = ?`, s.timestamp(), id)
	return err
}

// tokenInfo is the API's view of a personal access token (README: API tokens);
// Current is the handler's to set.
type tokenInfo struct {
	ID         int64   `json:"id"`
	Name       string  `json:"name"`
	LastUsedAt *string `json:"last_used_at"`
	CreatedAt  string  `json:"created_at"`
	Current    bool    `json:"current"`
}

const tokenInfoQuery = `SELECT id, name, last_used_at, created_at FROM tokens WHERE user_id = ?`

// tokensOf lists the user's tokens, oldest first.
func (s *store) tokensOf(ctx context.Context, userID int64) ([]tokenInfo, error) {
	rows, err := s.read.QueryContext(ctx, tokenInfoQuery+` ORDER BY id`, userID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	list := []tokenInfo{}
	for rows.Next() {
		var t tokenInfo
		if err := rows.Scan(&t.ID, &t.Name, &t.LastUsedAt, &t.CreatedAt); err != nil {
			return nil, err
		}
		list = append(list, t)
	}
	return list, rows.Err()
}

// userToken returns one of the user's tokens, or errNoSuchToken.
func (s *store) userToken(ctx context.Context, userID, id int64) (*tokenInfo, error) {
	var t tokenInfo
	err := s.read.QueryRowContext(ctx, tokenInfoQuery+` AND id = ?`, userID, id).Scan(&t.ID, &t.Name, &t.LastUsedAt, &t.CreatedAt)
	if err != nil {
		return nil, notFound(err, errNoSuchToken)
	}
	return &t, nil
}

// deleteUserToken removes one of the user's tokens, or returns
// errNoSuchToken when the user has no token with that id.
func (s *store) deleteUserToken(ctx context.Context, userID, id int64) error {
	res, err := s.wdb.ExecContext(ctx, `DELETE FROM tokens WHERE id = ? AND user_id = ?`, id, userID)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return errNoSuchToken
	}
	return nil
}

// deleteToken removes one token.
func (s *store) deleteToken(ctx context.Context, id int64) error {
	_, err := s.wdb.ExecContext(ctx, `DELETE FROM tokens WHERE id = ?`, id)
	return err
}
