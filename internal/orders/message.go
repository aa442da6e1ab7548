// Package orders is the order-confirmation domain: it turns order messages
// from the inbox into order_confirmations rows, idempotently in the database
// itself, so that a message re-sent under a new id still confirms an order
// only once.
package orders

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/orderconfirm/inboxd/internal/inbox"
)

// Message types the handler understands.
const (
	TypeOrderCreated   = "order.created"
	TypeOrderCancelled = "order.cancelled"
)

// Bounds on what an order message may carry; beyond them a message is
// invalid, a permanent failure whose reason names the field.
const (
	// maxIDBytes bounds orderId, userId, email and sku.
	maxIDBytes = 255
	// MaxItems is the most lines an order may have.
	MaxItems = 1000
	// MaxItemQuantity is the largest quantity of one line.
	MaxItemQuantity = 1_000_000
	// maxReasonBytes bounds a cancellation's reason.
	maxReasonBytes = 1000
)

// OrderCreated is the body of an order.created message.
type OrderCreated struct {
	OrderID string `json:"orderId"`
	UserID  string `json:"userId"`
	Email   string `json:"email"`
	Items   []Item `json:"items"`
}

// Item is one line of an order.
type Item struct {
	SKU      string `json:"sku"`
	Quantity int    `json:"quantity"`
}

// OrderCancelled is the body of an order.cancelled message.
type OrderCancelled struct {
	OrderID string `json:"orderId"`
	Reason  string `json:"reason"`
}

// message is an order message of a batch, decoded once: exactly one of
// created and cancelled is set.
type message struct {
	index     int    // in the batch
	id        string // the inbox message id
	created   *OrderCreated
	cancelled *OrderCancelled
}

// decode decodes the inbox message m, at index in its batch. A body that
// does not decode and a type it does not know are permanent failures.
func decode(index int, m inbox.Message) (message, error) {
	d := message{index: index, id: m.MessageID}
	switch m.Type {
	case TypeOrderCreated:
		o, err := DecodeOrderCreated(m.Payload)
		if err != nil {
			return d, inbox.Permanent(err)
		}
		d.created = &o
	case TypeOrderCancelled:
		c, err := DecodeOrderCancelled(m.Payload)
		if err != nil {
			return d, inbox.Permanent(err)
		}
		d.cancelled = &c
	default:
		return d, inbox.Permanentf("unknown message type %q", m.Type)
	}
	return d, nil
}

// orderID is the order the message is about.
func (m message) orderID() string {
	if m.created != nil {
		return m.created.OrderID
	}
	return m.cancelled.OrderID
}

// ErrInvalidPayload is wrapped by every decoding and validation error.
var ErrInvalidPayload = errors.New("invalid payload")

// wireOrderCreated is an order.created body as it arrives: quantities are
// read as written, so that a fraction, an exponent or a number too large for
// an int is refused with its field named instead of rounded or wrapped.
type wireOrderCreated struct {
	OrderID string `json:"orderId"`
	UserID  string `json:"userId"`
	Email   string `json:"email"`
	Items   []struct {
		SKU      string          `json:"sku"`
		Quantity json.RawMessage `json:"quantity"`
	} `json:"items"`
}

// DecodeOrderCreated parses and validates an order.created body. Unknown
// fields are ignored, so producers can add fields without breaking the
// service.
func DecodeOrderCreated(payload []byte) (OrderCreated, error) {
	var w wireOrderCreated
	if err := decodeJSON(payload, &w); err != nil {
		return OrderCreated{}, err
	}
	m := OrderCreated{OrderID: w.OrderID, UserID: w.UserID, Email: w.Email}
	var problems []string
	if len(w.Items) > MaxItems {
		problems = append(problems, fmt.Sprintf("items has %d lines, at most %d are allowed", len(w.Items), MaxItems))
		w.Items = w.Items[:MaxItems]
	}
	for i, it := range w.Items {
		q, ok := parseQuantity(it.Quantity)
		if !ok {
			problems = append(problems, fmt.Sprintf("items[%d].quantity must be a whole number between 1 and %d, got %s",
				i, MaxItemQuantity, quote(it.Quantity)))
		}
		m.Items = append(m.Items, Item{SKU: it.SKU, Quantity: q})
	}
	problems = checkID(problems, "orderId", m.OrderID)
	problems = checkID(problems, "userId", m.UserID)
	problems = checkID(problems, "email", m.Email)
	if m.Email != "" && !strings.Contains(m.Email, "@") {
		problems = append(problems, "email is not an address")
	}
	if len(m.Items) == 0 {
		problems = append(problems, "items is missing or empty")
	}
	for i, it := range m.Items {
		if !plainID(it.SKU) {
			problems = checkID(problems, fmt.Sprintf("items[%d].sku", i), it.SKU)
		}
	}
	return m, validationError(problems)
}

// parseQuantity reads a JSON integer literal between 1 and MaxItemQuantity.
func parseQuantity(raw json.RawMessage) (int, bool) {
	s := string(raw)
	if s == "" || strings.ContainsAny(s, ".eE\"") {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 || n > MaxItemQuantity {
		return 0, false
	}
	return int(n), true
}

// quote shows a raw JSON value in an error, shortened.
func quote(raw json.RawMessage) string {
	s := string(raw)
	if s == "" {
		return "nothing"
	}
	if len(s) > 32 {
		s = s[:32] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}

// DecodeOrderCancelled parses and validates an order.cancelled body.
func DecodeOrderCancelled(payload []byte) (OrderCancelled, error) {
	var m OrderCancelled
	if err := decodeJSON(payload, &m); err != nil {
		return m, err
	}
	var problems []string
	problems = checkID(problems, "orderId", m.OrderID)
	problems = checkText(problems, "reason", m.Reason)
	if len(m.Reason) > maxReasonBytes {
		problems = append(problems, fmt.Sprintf("reason is longer than %d bytes", maxReasonBytes))
	}
	return m, validationError(problems)
}

// decodeJSON decodes payload, one JSON value, into v. The body must be JSON
// text as RFC 8259 has it, UTF-8, and name characters only: encoding/json
// turns a byte that is not UTF-8, and an escaped surrogate that is not half
// of a pair, into U+FFFD, so that ids the producer sent as different
// ("o-1\xff", "o-1\xfe", "o-1\ud800") would all read as one order.
func decodeJSON(payload []byte, v any) error {
	if len(bytes.TrimSpace(payload)) == 0 {
		return fmt.Errorf("%w: empty body", ErrInvalidPayload)
	}
	if !utf8.Valid(payload) {
		return fmt.Errorf("%w: not UTF-8 text: a byte at %d is not UTF-8", ErrInvalidPayload, invalidUTF8At(payload))
	}
	// json.Unmarshal takes exactly what the decoder below takes (one
	// value, then nothing but white space), without copying the body; the
	// decoder, run only for a body Unmarshal refused, says what is wrong.
	if err := json.Unmarshal(payload, v); err != nil {
		dec := json.NewDecoder(bytes.NewReader(payload))
		if err := dec.Decode(v); err != nil {
			return fmt.Errorf("%w: not a JSON object of the expected shape: %w", ErrInvalidPayload, err)
		}
		if _, err := dec.Token(); err != io.EOF {
			return fmt.Errorf("%w: data after the JSON object", ErrInvalidPayload)
		}
		return fmt.Errorf("%w: not a JSON object of the expected shape: %w", ErrInvalidPayload, err)
	}
	if i := unpairedSurrogate(payload); i >= 0 {
		return fmt.Errorf("%w: the escape %s at byte %d is half of a UTF-16 surrogate pair, not a character", ErrInvalidPayload, payload[i:i+6], i)
	}
	return nil
}

// invalidUTF8At returns the offset of the first byte of b that does not
// start a valid UTF-8 sequence, or -1.
func invalidUTF8At(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return -1
}

// unpairedSurrogate returns the offset in payload, valid JSON, of a \u
// escape of a UTF-16 surrogate that is not followed (a high one) or
// preceded (a low one) by its other half, or -1. In valid JSON a backslash
// starts an escape inside a string, and nothing else.
func unpairedSurrogate(payload []byte) int {
	for i := 0; i < len(payload); i++ {
		if payload[i] != '\\' {
			continue
		}
		if payload[i+1] != 'u' {
			i++ // the escaped character, a backslash maybe
			continue
		}
		r := hexRune(payload[i+2 : i+6])
		if !utf16.IsSurrogate(r) {
			i += 5
			continue
		}
		if i+12 <= len(payload) && payload[i+6] == '\\' && payload[i+7] == 'u' &&
			utf16.DecodeRune(r, hexRune(payload[i+8:i+12])) != unicode.ReplacementChar {
			i += 11
			continue
		}
		return i
	}
	return -1
}

// hexRune reads the four hex digits of a \u escape.
func hexRune(digits []byte) rune {
	n, err := strconv.ParseUint(string(digits), 16, 16)
	if err != nil {
		return unicode.ReplacementChar
	}
	return rune(n)
}

// checkID checks an identifier the service passes on downstream (an order
// id, user id, email or SKU): present, at most maxIDBytes, and free of
// control characters (C0, DEL and C1: a CR LF is a header injection at a
// mail service, an ESC a terminal escape in a log) and of the bidirectional
// formatting characters that make text display other than it is (a
// spoofed address).
func checkID(problems []string, field, v string) []string {
	if plainID(v) {
		return problems
	}
	switch {
	case v == "":
		return append(problems, field+" is missing")
	case len(v) > maxIDBytes:
		return append(problems, fmt.Sprintf("%s is longer than %d bytes", field, maxIDBytes))
	case strings.ContainsRune(v, 0):
		return append(problems, field+" holds a NUL character")
	}
	if i := strings.IndexFunc(v, unicode.IsControl); i >= 0 {
		r, _ := utf8.DecodeRuneInString(v[i:])
		return append(problems, fmt.Sprintf("%s holds the control character %U at byte %d", field, r, i))
	}
	if i := strings.IndexFunc(v, isBidiControl); i >= 0 {
		r, _ := utf8.DecodeRuneInString(v[i:])
		return append(problems, fmt.Sprintf("%s holds the bidirectional formatting character %U at byte %d", field, r, i))
	}
	if i := strings.IndexFunc(v, isInvisible); i >= 0 {
		r, _ := utf8.DecodeRuneInString(v[i:])
		return append(problems, fmt.Sprintf("%s holds the invisible or line-breaking character %U at byte %d", field, r, i))
	}
	return problems
}

// plainID reports an id checkID passes without looking further: not empty,
// no longer than maxIDBytes, and printable ASCII only (no control
// character; bidirectional and invisible characters are all outside
// ASCII). Most ids are such, and this one pass over their bytes spares
// them the look-ups of Unicode's tables.
func plainID(v string) bool {
	if v == "" || len(v) > maxIDBytes {
		return false
	}
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return false
		}
	}
	return true
}

// isInvisible reports a format character (Unicode's Cf: zero-width spaces
// and joiners, the soft hyphen, the byte order mark), which makes two ids
// that look alike differ, or a line or paragraph separator (Zl, Zp), which
// breaks a line where a reader does not expect one.
func isInvisible(r rune) bool { return unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp) }

// isBidiControl reports a character that changes the direction text is
// shown in (Unicode's Bidi_Control: marks, embeddings, overrides, isolates).
func isBidiControl(r rune) bool { return unicode.Is(unicode.Bidi_Control, r) }

// checkText checks free text the service passes on (a cancellation's
// reason): no control characters but tab and line feed, and no line or
// paragraph separator (U+2028, U+2029), which some readers take for a line
// feed and some do not.
func checkText(problems []string, field, v string) []string {
	if strings.ContainsRune(v, 0) {
		return append(problems, field+" holds a NUL character")
	}
	refused := func(r rune) bool {
		return (r != '\t' && r != '\n' && unicode.IsControl(r)) || unicode.In(r, unicode.Zl, unicode.Zp)
	}
	if i := strings.IndexFunc(v, refused); i >= 0 {
		r, _ := utf8.DecodeRuneInString(v[i:])
		return append(problems, fmt.Sprintf("%s holds the control or line-breaking character %U at byte %d", field, r, i))
	}
	return problems
}

func validationError(problems []string) error {
	if len(problems) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", ErrInvalidPayload, strings.Join(problems, "; "))
}

// OrderingKey returns the order id of an order message, which groups the
// messages the inbox handles one at a time and in arrival order; "" when the
// body has none or is not JSON. Ingest calls it for every delivery.
func OrderingKey(messageType string, body []byte) string {
	if messageType != TypeOrderCreated && messageType != TypeOrderCancelled {
		return ""
	}
	var m struct {
		OrderID string `json:"orderId"`
	}
	if json.Unmarshal(body, &m) != nil {
		return ""
	}
	return m.OrderID
}
