package main

import (
	"context"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"devicehub/internal/model"
	"devicehub/internal/store"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// passwordIterations is the PBKDF2-SHA256 work factor for new passwords
// (OWASP's 2023 figure). Stored hashes carry their own count.
const passwordIterations = 600_000

// tokenTouchInterval is how stale last_used_at may get: a token's use is
// written at most once per interval, so that reads stay reads.
const tokenTouchInterval = time.Minute

// hashPassword returns "pbkdf2-sha256$<iterations>$<salt>$<key>".
func hashPassword(password string, iterations int) (string, error) {
	salt := make([]byte, 16)
	rand.Read(salt)
	key, err := pbkdf2.Key(sha256.New, password, salt, iterations, 32)
	if err != nil {
		return "", fmt.Errorf("hash password: %w", err)
	}
	b64 := base64.RawStdEncoding
	return fmt.Sprintf("pbkdf2-sha256$%d$%s$%s", iterations, b64.EncodeToString(salt), b64.EncodeToString(key)), nil
}

// checkPassword reports whether password matches the encoded hash. A
// malformed hash never matches.
func checkPassword(encoded, password string) bool {
	parts := strings.Split(encoded, "$")
	if len(parts) != 4 || parts[0] != "pbkdf2-sha256" {
		return false
	}
	iterations, err := strconv.Atoi(parts[1])
	if err != nil || iterations < 1 {
		return false
	}
	b64 := base64.RawStdEncoding
	salt, err1 := b64.DecodeString(parts[2])
	want, err2 := b64.DecodeString(parts[3])
	if err1 != nil || err2 != nil || len(want) == 0 {
		return false
	}
	got, err := pbkdf2.Key(sha256.New, password, salt, iterations, len(want))
	return err == nil && subtle.ConstantTimeCompare(got, want) == 1
}

func hashSecret(secret string) []byte {
	h := sha256.Sum256([]byte(secret))
	return h[:]
}

// issueToken creates a personal access token and returns it in its
// "<id>|<secret>" form; only the secret's SHA-256 is stored. A login
// passes the password version it verified (CreateToken); nil otherwise.
// audit (nil: none) is made of its id.
func issueToken(ctx context.Context, st *store.Store, userID int64, name string, loginVersion *int64,
	audit store.Audit[int64]) (id int64, token string, err error) {
	secret := store.RandomString(40, store.Alnum)
	id, err = st.CreateToken(ctx, userID, name, hashSecret(secret), loginVersion, audit)
	if err != nil {
		return 0, "", err
	}
	return id, strconv.FormatInt(id, 10) + "|" + secret, nil
}

// bearerToken returns the token of an "Authorization: Bearer <token>"
// header. Only that exact form is accepted.
func bearerToken(r *http.Request) (string, bool) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || tok == "" || strings.ContainsAny(tok, " \t") {
		return "", false
	}
	return tok, true
}

// authenticate resolves a presented token to its stored record. A token
// "<id>|<secret>" is looked up by id and its secret compared in constant
// time; a token without "<id>|" is looked up by the hash of the whole.
func authenticate(ctx context.Context, st *store.Store, tok string) (*store.TokenRow, error) {
	idPart, secret, hasID := strings.Cut(tok, "|")
	if !hasID {
		return st.TokenByHash(ctx, hashSecret(tok))
	}
	id, err := strconv.ParseInt(idPart, 10, 64)
	if err != nil || id <= 0 || secret == "" || strconv.FormatInt(id, 10) != idPart {
		return nil, errUnauthenticated
	}
	rec, err := st.TokenByID(ctx, id)
	if err != nil {
		return nil, err
	}
	if subtle.ConstantTimeCompare(rec.SecretHash, hashSecret(secret)) != 1 {
		return nil, errUnauthenticated
	}
	return rec, nil
}

type ctxKey int

const authKey ctxKey = 0

// authInfo is what auth puts in the request context.
type authInfo struct {
	user    *model.User
	tokenID int64
}

func authFrom(ctx context.Context) *authInfo { return ctx.Value(authKey).(*authInfo) }

// auth answers 401 unless the request carries a valid token, and
// otherwise calls h with the user and token in the context.
func (s *server) auth(h apiHandler) apiHandler {
	return func(w http.ResponseWriter, r *http.Request) error {
		ctx := s.store.MarkRequest(r.Context())
		tok, ok := bearerToken(r)
		if !ok {
			return errUnauthenticated
		}
		t, err := authenticate(ctx, s.store, tok)
		if errors.Is(err, store.ErrTokenNotFound) {
			return errUnauthenticated
		}
		if err != nil {
			return err
		}
		if t.LastUsedAt == nil || *t.LastUsedAt < s.store.Now().Add(-tokenTouchInterval).UTC().Format(store.TimeFormat) {
			if err := s.store.TouchToken(ctx, t.ID); err != nil {
				s.log.Warn("record token use", "err", err)
			}
		}
		return h(w, r.WithContext(context.WithValue(ctx, authKey, &authInfo{user: t.User, tokenID: t.ID})))
	}
}
