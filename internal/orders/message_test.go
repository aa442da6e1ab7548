package orders_test

import (
	"errors"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/orders"
)

func TestDecodeOrderCreated(t *testing.T) {
	t.Parallel()
	valid := `{"orderId":"o-1","userId":"u-1","email":"a@example.com","items":[{"sku":"S","quantity":2}]}`

	t.Run("Valid", func(t *testing.T) {
		t.Parallel()
		m, err := orders.DecodeOrderCreated([]byte(valid))
		require.NoError(t, err)
		require.Equal(t, orders.OrderCreated{OrderID: "o-1", UserID: "u-1", Email: "a@example.com",
			Items: []orders.Item{{SKU: "S", Quantity: 2}}}, m)
	})

	t.Run("UnknownFieldsAreIgnored", func(t *testing.T) {
		t.Parallel()
		_, err := orders.DecodeOrderCreated([]byte(strings.Replace(valid, `{"orderId"`, `{"channel":"web","orderId"`, 1)))
		require.NoError(t, err)
	})

	for name, tc := range map[string]struct{ payload, want string }{
		"Empty":           {"", "empty body"},
		"Whitespace":      {"  \n", "empty body"},
		"NotJSON":         {"not json", "not a JSON object"},
		"Truncated":       {valid[:20], "not a JSON object"},
		"Array":           {"[1,2]", "not a JSON object"},
		"WrongType":       {`{"orderId":42,"userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "not a JSON object"},
		"TrailingData":    {valid + `{}`, "data after the JSON object"},
		"MissingOrderID":  {`{"userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "orderId is missing"},
		"NoItems":         {`{"orderId":"o","userId":"u","email":"a@b","items":[]}`, "items is missing or empty"},
		"BadEmail":        {`{"orderId":"o","userId":"u","email":"nope","items":[{"sku":"S","quantity":1}]}`, "email is not an address"},
		"NULInOrderID":    {`{"orderId":"o\u0000","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "orderId holds a NUL character"},
		"LongOrderID":     {`{"orderId":"` + strings.Repeat("x", 256) + `","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "longer than 255 bytes"},
		"SeveralProblems": {`{"orderId":"o"}`, "userId is missing; email is missing; items is missing or empty"},
		// Text passed on downstream: a header injection at the mail
		// service, a spoofed address, a terminal escape in a log.
		"CRLFInEmail":    {`{"orderId":"o","userId":"u","email":"a@b\r\nBcc: all@example.com","items":[{"sku":"S","quantity":1}]}`, "email holds the control character U+000D at byte 3"},
		"LFInEmail":      {`{"orderId":"o","userId":"u","email":"a@b\nBcc: x@y","items":[{"sku":"S","quantity":1}]}`, "email holds the control character U+000A"},
		"RLOInEmail":     {`{"orderId":"o","userId":"u","email":"a@\u202egro.example","items":[{"sku":"S","quantity":1}]}`, "email holds the bidirectional formatting character U+202E"},
		"IsolateInEmail": {`{"orderId":"o","userId":"u","email":"a@\u2067b","items":[{"sku":"S","quantity":1}]}`, "email holds the bidirectional formatting character U+2067"},
		"ESCInOrderID":   {`{"orderId":"o\u001b[2J","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "orderId holds the control character U+001B at byte 1"},
		"C1InOrderID":    {`{"orderId":"o\u009b","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "orderId holds the control character U+009B"},
		"DELInUserID":    {`{"orderId":"o","userId":"u\u007f","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "userId holds the control character U+007F"},
		"TabInSKU":       {`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1},{"sku":"S\t1","quantity":1}]}`, "items[1].sku holds the control character U+0009"},
		"ZeroWidthInID":  {`{"orderId":"o\u200b1","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`, "orderId holds the invisible or line-breaking character U+200B"},
		"BOMInEmail":     {`{"orderId":"o","userId":"u","email":"\ufeffa@b","items":[{"sku":"S","quantity":1}]}`, "email holds the invisible or line-breaking character U+FEFF"},
		"LineSepInSKU":   {`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"S\u2028","quantity":1}]}`, "items[0].sku holds the invisible or line-breaking character U+2028"},
		"RLOInSKU":       {`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"\u202eS","quantity":1}]}`, "items[0].sku holds the bidirectional formatting character U+202E"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := orders.DecodeOrderCreated([]byte(tc.payload))
			require.ErrorIs(t, err, orders.ErrInvalidPayload)
			require.ErrorContains(t, err, tc.want)
		})
	}

	// A quantity is a whole number in range, never rounded or wrapped.
	for _, q := range []string{"0", "-1", "2147483648", "4294967297", "1.5", "1e9", "1E2", "2.0", `"3"`, "null", "1000001", "99999999999999999999999"} {
		t.Run("Quantity"+q, func(t *testing.T) {
			t.Parallel()
			_, err := orders.DecodeOrderCreated([]byte(`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1},{"sku":"T","quantity":` + q + `}]}`))
			require.ErrorIs(t, err, orders.ErrInvalidPayload)
			require.ErrorContains(t, err, "items[1].quantity must be a whole number between 1 and 1000000, got "+q)
		})
	}
	t.Run("MissingQuantity", func(t *testing.T) {
		t.Parallel()
		_, err := orders.DecodeOrderCreated([]byte(`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"S"}]}`))
		require.ErrorContains(t, err, "items[0].quantity must be a whole number between 1 and 1000000, got nothing")
	})
	t.Run("LargestQuantity", func(t *testing.T) {
		t.Parallel()
		m, err := orders.DecodeOrderCreated([]byte(`{"orderId":"o","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1000000}]}`))
		require.NoError(t, err)
		require.Equal(t, orders.MaxItemQuantity, m.Items[0].Quantity)
	})
	t.Run("TooManyItems", func(t *testing.T) {
		t.Parallel()
		items := strings.Repeat(`{"sku":"S","quantity":1},`, orders.MaxItems)
		_, err := orders.DecodeOrderCreated([]byte(`{"orderId":"o","userId":"u","email":"a@b","items":[` + items + `{"sku":"S","quantity":1}]}`))
		require.ErrorContains(t, err, "items has 1001 lines, at most 1000 are allowed")
	})
}

func TestDecodeOrderCancelled(t *testing.T) {
	t.Parallel()
	m, err := orders.DecodeOrderCancelled([]byte(`{"orderId":"o-1","reason":"changed mind"}`))
	require.NoError(t, err)
	require.Equal(t, orders.OrderCancelled{OrderID: "o-1", Reason: "changed mind"}, m)

	_, err = orders.DecodeOrderCancelled([]byte(`{"reason":"x"}`))
	require.ErrorContains(t, err, "orderId is missing")

	_, err = orders.DecodeOrderCancelled([]byte(`{"orderId":"o\r\n","reason":"x"}`))
	require.ErrorContains(t, err, "orderId holds the control character U+000D")
	_, err = orders.DecodeOrderCancelled([]byte(`{"orderId":"o","reason":"gone\u001b]0;pwned\u0007"}`))
	require.ErrorContains(t, err, "reason holds the control or line-breaking character U+001B")
	_, err = orders.DecodeOrderCancelled([]byte(`{"orderId":"o","reason":"gone\u2029Bcc: x"}`))
	require.ErrorContains(t, err, "reason holds the control or line-breaking character U+2029")
	// A reason is free text: lines and tabs are fine, and so is any script.
	m, err = orders.DecodeOrderCancelled([]byte(`{"orderId":"o","reason":"changed\tmind\nשונה"}`))
	require.NoError(t, err)
	require.Equal(t, "changed\tmind\nשונה", m.Reason)
}

// A body is JSON text, UTF-8 (RFC 8259): a byte that is not UTF-8, or an
// escaped half of a surrogate pair, is refused, not read as U+FFFD, which
// would make orders the producer told apart ("o-1\xff", "o-1\xfe") one.
func TestDecodeRefusesWhatIsNotUTF8Text(t *testing.T) {
	t.Parallel()
	created := func(orderID string) []byte {
		return []byte(`{"orderId":"` + orderID + `","userId":"u","email":"a@b","items":[{"sku":"S","quantity":1}]}`)
	}
	for name, tc := range map[string]struct {
		payload []byte
		want    string
	}{
		"InvalidByte":         {created("o-1\xff"), "not UTF-8 text: a byte at 15 is not UTF-8"},
		"OtherInvalidByte":    {created("o-1\xfe"), "not UTF-8 text"},
		"TruncatedSequence":   {created("o-1\xe2\x82"), "not UTF-8 text"},
		"InvalidInUnknown":    {[]byte("{\"note\":\"\xff\"," + string(created("o-1"))[1:]), "not UTF-8 text"},
		"LoneHighSurrogate":   {created(`o-1\ud800`), `the escape \ud800 at byte 15 is half of a UTF-16 surrogate pair`},
		"LoneLowSurrogate":    {created(`o-1\udc00`), `the escape \udc00 at byte 15`},
		"TwoHighSurrogates":   {created(`o-1\ud800\ud800`), `the escape \ud800 at byte 15`},
		"HighThenText":        {created(`o-1\ud83dx`), `the escape \ud83d at byte 15`},
		"LoneAfterEscapedBsl": {created(`o-1\\\ud800`), `the escape \ud800 at byte 17`},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := orders.DecodeOrderCreated(tc.payload)
			require.ErrorIs(t, err, orders.ErrInvalidPayload)
			require.ErrorContains(t, err, tc.want)
		})
	}
	_, err := orders.DecodeOrderCancelled([]byte(`{"orderId":"o-1","reason":"\udfff"}`))
	require.ErrorContains(t, err, "half of a UTF-16 surrogate pair")

	// A pair is a character; an escaped backslash before a u is no escape.
	m, err := orders.DecodeOrderCreated(created(`o-\ud83d\ude00-\\ud800`))
	require.NoError(t, err)
	require.Equal(t, "o-\U0001F600-\\ud800", m.OrderID)
	m, err = orders.DecodeOrderCreated(created("o-\uFFFD-\u00e9"))
	require.NoError(t, err, "U+FFFD sent as such is a character like any other")
	require.Equal(t, "o-\uFFFD-\u00e9", m.OrderID)
}

// Identifiers in any script are fine: only control and bidirectional
// formatting characters are refused.
func TestDecodeOrderCreatedTakesAnyScript(t *testing.T) {
	t.Parallel()
	m, err := orders.DecodeOrderCreated([]byte(`{"orderId":"הזמנה-1","userId":"ユーザー","email":"δοκιμή@παράδειγμα.δοκιμή","items":[{"sku":"SKU-Ω","quantity":1}]}`))
	require.NoError(t, err)
	require.Equal(t, "הזמנה-1", m.OrderID)
}

// FuzzDecode checks that decoding never panics, and that whatever it accepts
// satisfies the validation rules. `make test` runs the seed corpus; `make
// fuzz` explores further.
func FuzzDecode(f *testing.F) {
	for _, seed := range []string{
		`{"orderId":"o-1","userId":"u-1","email":"a@example.com","items":[{"sku":"S","quantity":2}]}`,
		`{"orderId":"o-1","reason":"x"}`,
		``, `null`, `[]`, `{}`, `{"orderId":null}`, "{\"orderId\":\"\x00\"}", `{"items":[{"quantity":-1}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":1e30}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":4294967297}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":-2147483648}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":1.5}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":1e9}]}`,
		"\xff\xfe{}", `{"orderId":"\ud800"}`, "{\"orderId\":\"o\xff\",\"reason\":\"x\"}", `{"orderId":"o\udc00","reason":"x"}`,
		`{"orderId":"a\u001b","userId":"b","email":"c@d\u202e","items":[{"sku":"e\r\n","quantity":1}]}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, payload []byte) {
		if m, err := orders.DecodeOrderCreated(payload); err == nil {
			if m.OrderID == "" || m.UserID == "" || len(m.Items) == 0 {
				t.Fatalf("accepted an incomplete order: %+v", m)
			}
			for _, it := range m.Items {
				if it.Quantity < 1 || it.Quantity > orders.MaxItemQuantity || it.SKU == "" {
					t.Fatalf("accepted a bad item: %+v", it)
				}
				requirePlainText(t, it.SKU)
			}
			requirePlainText(t, m.OrderID, m.UserID, m.Email)
		} else if !errors.Is(err, orders.ErrInvalidPayload) {
			t.Fatalf("error does not wrap ErrInvalidPayload: %v", err)
		}
		if m, err := orders.DecodeOrderCancelled(payload); err == nil && m.OrderID == "" {
			t.Fatalf("accepted a cancellation without orderId")
		}
		if _, err := orders.DecodeOrderCancelled(payload); err == nil && !utf8.Valid(payload) {
			t.Fatalf("accepted a body that is not UTF-8")
		}
	})
}

// requirePlainText fails when an accepted identifier holds a control or
// bidirectional formatting character.
func requirePlainText(t *testing.T, values ...string) {
	t.Helper()
	for _, v := range values {
		if i := strings.IndexFunc(v, func(r rune) bool {
			return unicode.IsControl(r) || unicode.In(r, unicode.Bidi_Control, unicode.Cf, unicode.Zl, unicode.Zp)
		}); i >= 0 {
			t.Fatalf("accepted %q, which holds a control or bidi formatting character at byte %d", v, i)
		}
	}
}

func TestOrderingKey(t *testing.T) {
	t.Parallel()
	require.Equal(t, "o-1", orders.OrderingKey(orders.TypeOrderCreated, []byte(`{"orderId":"o-1","items":[]}`)))
	require.Equal(t, "o-2", orders.OrderingKey(orders.TypeOrderCancelled, []byte(`{"orderId":"o-2"}`)))
	require.Empty(t, orders.OrderingKey(orders.TypeOrderCreated, []byte(`not json`)))
	require.Empty(t, orders.OrderingKey(orders.TypeOrderCreated, []byte(`{"orderId":7}`)))
	require.Empty(t, orders.OrderingKey("test.other", []byte(`{"orderId":"o-1"}`)))
}

// BenchmarkDecodeOrderCreated decodes and checks a body of the shape the
// bench's traffic carries: the work every order.created costs the worker
// before any statement.
func BenchmarkDecodeOrderCreated(b *testing.B) {
	body := []byte(`{"eventType":"order.created","orderId":"bench-1796592848155514294-015030","userId":"user-0042",` +
		`"email":"customer-0042@example.com","items":[{"sku":"SKU-00780","quantity":2},{"sku":"SKU-00887","quantity":1}]}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := orders.DecodeOrderCreated(body); err != nil {
			b.Fatal(err)
		}
	}
}
