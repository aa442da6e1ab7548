// Package msgid holds the rules for message ids, the idempotency keys of the
// whole flow: which producer ids the service takes, and how the id of an
// event derived from one is built so that it always fits where it goes.
//
// AMQP carries message_id as a short string of at most 255 bytes, and
// amqp091-go closes the whole connection on a publish whose short string
// does not fit. A producer's id may use all 255 bytes; an event's id adds
// its routing key. EventID keeps such an id within the limit by
// construction, the same on every replica and every retry.
package msgid

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"unicode/utf8"
)

// MaxBytes is the longest id an AMQP short string holds, and so the longest
// message id the service takes and the longest event id it publishes.
const MaxBytes = 255

// Reasons Check gives for an id it refuses.
var (
	ErrEmpty   = errors.New("message id is empty")
	ErrTooLong = errors.New("message id is longer than 255 bytes")
	ErrUTF8    = errors.New("message id is not valid UTF-8")
	ErrNUL     = errors.New("message id contains a NUL byte")
)

// Check returns nil for an id the service stores (1 to MaxBytes bytes of
// UTF-8 without NUL, which PostgreSQL's text refuses), else the reason.
func Check(id string) error {
	switch {
	case id == "":
		return ErrEmpty
	case len(id) > MaxBytes:
		return ErrTooLong
	case !utf8.ValidString(id):
		return ErrUTF8
	case strings.ContainsRune(id, 0):
		return ErrNUL
	}
	return nil
}

// digestHexLen is how many hex digits of SHA-256 stand for the part of an
// id cut off by EventID: 128 bits, so two ids sharing a prefix collide only
// by a SHA-256 collision.
const digestHexLen = 32

// EventID returns the id of the event with routingKey caused by the
// message messageID: the outbox's idempotency key and the event's AMQP
// message_id. It is messageID + ":" + routingKey when that fits in MaxBytes;
// else messageID is cut, at a character boundary, to what fits beside "~",
// 32 hex digits of the SHA-256 of the whole of messageID, ":" and
// routingKey. Either way the result is at most MaxBytes long (routing keys
// are the service's own, far shorter) and depends on its arguments only.
func EventID(messageID, routingKey string) string {
	id := messageID + ":" + routingKey
	if len(id) <= MaxBytes {
		return id
	}
	sum := sha256.Sum256([]byte(messageID))
	suffix := "~" + hex.EncodeToString(sum[:])[:digestHexLen] + ":" + routingKey
	return cut(messageID, MaxBytes-len(suffix)) + suffix
}

// cut returns the longest prefix of s of at most n bytes that ends at a
// character boundary.
func cut(s string, n int) string {
	if n <= 0 {
		return ""
	}
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
