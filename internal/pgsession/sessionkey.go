package pgsession

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// SessionKey is the key by which a session of this process tells the
// others it is alive: the session holds the key's advisory lock and
// registers the key with its pid (inbox_sessions), and the key is live
// while that session holds it. When the process dies PostgreSQL ends the
// session and the key is live no more; no other login's hold of the same
// key counts. The liveness session's key is carried by the process's
// claims, the leader session's by the leader's row.
type SessionKey struct {
	key  atomic.Int64
	held atomic.Bool
}

// NewSessionKey returns a SessionKey with a random key.
func NewSessionKey() *SessionKey {
	k := &SessionKey{}
	k.key.Store(randomKey())
	return k
}

// randomKey returns a key no other process (or test sharing a database)
// will have; positive, so that it reads back from pg_locks as it was given.
func randomKey() int64 { return 1 + rand.Int64N(1<<62) }

// Take takes and registers the key on conn, a session of its own that
// must keep it until it ends. When another session holds the key (one
// that took it after this process's last session ended), it draws a new
// key and returns an error: the caller connects again and takes that one.
func (k *SessionKey) Take(ctx context.Context, conn *pgx.Conn) error {
	key := k.key.Load()
	_, err := dbsqlc.New().InboxHoldLiveness(ctx, conn, key)
	if errors.Is(err, pgx.ErrNoRows) {
		k.key.Store(randomKey())
		return fmt.Errorf("session key %d is held by another session; taking a new key", key)
	}
	if err != nil {
		return err
	}
	k.held.Store(true)
	return nil
}

// Release notes that the session holding the key has ended (or is about
// to).
func (k *SessionKey) Release() { k.held.Store(false) }

// Key returns the key.
func (k *SessionKey) Key() int64 { return k.key.Load() }

// Held returns the key while a session holds it, else 0.
func (k *SessionKey) Held() int64 {
	if k.held.Load() {
		return k.key.Load()
	}
	return 0
}
