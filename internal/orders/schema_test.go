package orders_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/api/schemas"
	"github.com/orderconfirm/inboxd/internal/orders"
)

// The schemas of api/schemas state what the decoder accepts: these tests
// run the same bodies through both.

var loadContract = sync.OnceValues(schemas.Load)

func contract(t testing.TB) *schemas.Contract {
	t.Helper()
	c, err := loadContract()
	require.NoError(t, err)
	return c
}

// schemaFile is the schema of a consumed message type.
var schemaFile = map[string]string{orders.TypeOrderCreated: schemas.OrderCreated, orders.TypeOrderCancelled: schemas.OrderCancelled}

// decodeAs runs body through the decoder of messageType.
func decodeAs(messageType string, body []byte) error {
	if messageType == orders.TypeOrderCreated {
		_, err := orders.DecodeOrderCreated(body)
		return err
	}
	_, err := orders.DecodeOrderCancelled(body)
	return err
}

// A gap is a rule JSON Schema cannot state, on which schema and decoder
// part; each is named in the schema's description by the phrase.
type gap string

const (
	// gapBytes: maxLength counts characters, the decoder UTF-8 bytes.
	gapBytes gap = "bounded in UTF-8 bytes"
	// gapLiteral: 2.0 and 2e0 are the integer 2 to JSON Schema.
	gapLiteral gap = "integer literal"
	// gapSurrogate: JSON Schema sees the parsed value, in which an escaped
	// half of a surrogate pair is gone.
	gapSurrogate gap = "half of a surrogate pair"
	// gapFold: the decoder matches names regardless of case; the schema
	// refuses such names.
	gapFold gap = "regardless of case"
	// gapDuplicate: the decoder keeps the last of two members that is not
	// null; the schema sees the last.
	gapDuplicate gap = "last of two members"
)

// sample is a body and who accepts it. A sample on which the two part
// names the gap.
type sample struct {
	name, messageType, body string
	schema, decoder         bool
	gap                     gap
}

const validCreated = `{"orderId":"o-1","userId":"u-1","email":"a@example.com","items":[{"sku":"S","quantity":2}]}`

// createdBody is validCreated with the member name set to value (JSON text),
// or left out when value is "".
func createdBody(name, value string) string {
	fields := []string{"orderId", "userId", "email", "items"}
	values := map[string]string{"orderId": `"o-1"`, "userId": `"u-1"`, "email": `"a@example.com"`, "items": `[{"sku":"S","quantity":2}]`}
	var members []string
	for _, f := range fields {
		if f == name {
			continue
		}
		members = append(members, fmt.Sprintf("%q:%s", f, values[f]))
	}
	if value != "" {
		members = append(members, fmt.Sprintf("%q:%s", name, value))
	}
	return "{" + strings.Join(members, ",") + "}"
}

// itemBody is a created body with one item, whose members are the JSON text
// members.
func itemBody(members string) string { return createdBody("items", "[{"+members+"}]") }

// jsonString is s as a JSON string.
func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func samples() []sample {
	c, x := orders.TypeOrderCreated, orders.TypeOrderCancelled
	both := func(name, typ, body string) sample {
		return sample{name: name, messageType: typ, body: body, schema: true, decoder: true}
	}
	neither := func(name, typ, body string) sample { return sample{name: name, messageType: typ, body: body} }
	schemaOnly := func(name, typ, body string, g gap) sample {
		return sample{name: name, messageType: typ, body: body, schema: true, gap: g}
	}
	decoderOnly := func(name, typ, body string, g gap) sample {
		return sample{name: name, messageType: typ, body: body, decoder: true, gap: g}
	}
	items := func(n int) string {
		return createdBody("items", "["+strings.TrimSuffix(strings.Repeat(`{"sku":"S","quantity":1},`, n), ",")+"]")
	}
	return []sample{
		both("Valid", c, validCreated),
		both("UnknownMembers", c, strings.Replace(validCreated, `{"orderId"`, `{"channel":"web","meta":{"a":[1,null,1e400]},"orderId"`, 1)),
		both("UnknownItemMember", c, itemBody(`"sku":"S","quantity":1,"price":"9.99"`)),
		both("AnyScript", c, `{"orderId":"הזמנה-1","userId":"ユーザー","email":"δοκιμή@παράδειγμα.δοκιμή","items":[{"sku":"SKU-Ω","quantity":1}]}`),
		both("SurrogatePair", c, createdBody("orderId", `"o-\ud83d\ude00"`)),
		both("ReplacementCharacter", c, createdBody("orderId", `"o-\ufffd"`)),
		both("SpaceOnly", c, createdBody("userId", `" "`)),
		both("JustAnAt", c, createdBody("email", `"@"`)),
		both("LargestQuantity", c, itemBody(`"sku":"S","quantity":1000000`)),
		both("ThousandItems", c, items(1000)),
		both("LongestOrderID", c, createdBody("orderId", jsonString(strings.Repeat("x", 255)))),
		both("LongestInTwoByteCharacters", c, createdBody("orderId", jsonString(strings.Repeat("é", 127)))),
		both("WhitespaceAround", c, " \n"+validCreated+"\n "),
		both("LastOfTwoMembers", c, strings.Replace(validCreated, `{"orderId":"o-1"`, `{"orderId":"o\u0000","orderId":"o-1"`, 1)),

		neither("Empty", c, ``),
		neither("Whitespace", c, " \n"),
		neither("NotJSON", c, `not json`),
		neither("Truncated", c, validCreated[:30]),
		neither("TrailingData", c, validCreated+`{}`),
		neither("Array", c, `[]`),
		neither("Null", c, `null`),
		neither("String", c, `"order"`),
		neither("NotUTF8", c, createdBody("orderId", "\"o-1\xff\"")),
		neither("NotUTF8InUnknownMember", c, strings.Replace(validCreated, `{"orderId"`, "{\"note\":\"\xfe\",\"orderId\"", 1)),
		neither("MissingOrderID", c, createdBody("orderId", "")),
		neither("MissingUserID", c, createdBody("userId", "")),
		neither("MissingEmail", c, createdBody("email", "")),
		neither("MissingItems", c, createdBody("items", "")),
		neither("EmptyOrderID", c, createdBody("orderId", `""`)),
		neither("NullOrderID", c, createdBody("orderId", `null`)),
		neither("NumberOrderID", c, createdBody("orderId", `42`)),
		neither("BoolUserID", c, createdBody("userId", `true`)),
		neither("ItemsObject", c, createdBody("items", `{}`)),
		neither("ItemsEmpty", c, createdBody("items", `[]`)),
		neither("ItemsNull", c, createdBody("items", `null`)),
		neither("TooManyItems", c, items(1001)),
		neither("ItemNull", c, createdBody("items", `[null]`)),
		neither("ItemString", c, createdBody("items", `["S"]`)),
		neither("ItemWithoutSKU", c, itemBody(`"quantity":1`)),
		neither("ItemWithoutQuantity", c, itemBody(`"sku":"S"`)),
		neither("SKUNumber", c, itemBody(`"sku":7,"quantity":1`)),
		neither("SKUEmpty", c, itemBody(`"sku":"","quantity":1`)),
		neither("QuantityZero", c, itemBody(`"sku":"S","quantity":0`)),
		neither("QuantityNegative", c, itemBody(`"sku":"S","quantity":-1`)),
		neither("QuantityTooLarge", c, itemBody(`"sku":"S","quantity":1000001`)),
		neither("QuantityHuge", c, itemBody(`"sku":"S","quantity":99999999999999999999`)),
		neither("QuantityFraction", c, itemBody(`"sku":"S","quantity":1.5`)),
		neither("QuantityString", c, itemBody(`"sku":"S","quantity":"2"`)),
		neither("QuantityNull", c, itemBody(`"sku":"S","quantity":null`)),
		neither("EmailWithoutAt", c, createdBody("email", `"nope"`)),
		neither("LongOrderID", c, createdBody("orderId", jsonString(strings.Repeat("x", 256)))),
		neither("NUL", c, createdBody("orderId", `"o\u0000"`)),
		neither("CRLFInEmail", c, createdBody("email", `"a@b\r\nBcc: all@example.com"`)),
		neither("TabInSKU", c, itemBody(`"sku":"S\t1","quantity":1`)),
		neither("ESCInOrderID", c, createdBody("orderId", `"o\u001b[2J"`)),
		neither("DELInUserID", c, createdBody("userId", `"u\u007f"`)),
		neither("C1InOrderID", c, createdBody("orderId", `"o\u009b"`)),
		neither("NELInOrderID", c, createdBody("orderId", `"o\u0085"`)),
		neither("RLOInEmail", c, createdBody("email", `"a@\u202egro.example"`)),
		neither("IsolateInEmail", c, createdBody("email", `"a@\u2067b"`)),
		neither("ArabicLetterMark", c, createdBody("userId", `"u\u061c"`)),
		neither("ZeroWidthSpace", c, createdBody("orderId", `"o\u200b1"`)),
		neither("SoftHyphen", c, createdBody("orderId", `"o\u00ad1"`)),
		neither("BOM", c, createdBody("email", `"\ufeffa@b"`)),
		neither("LineSeparator", c, itemBody(`"sku":"S\u2028","quantity":1`)),
		neither("ParagraphSeparator", c, createdBody("userId", `"u\u2029"`)),
		neither("TagCharacter", c, createdBody("orderId", `"o\udb40\udc01"`)),
		neither("LastOfTwoMembersIsBad", c, strings.Replace(validCreated, `{"orderId":"o-1"`, `{"orderId":"o-1","orderId":""`, 1)),

		schemaOnly("LongInTwoByteCharacters", c, createdBody("orderId", jsonString(strings.Repeat("é", 128))), gapBytes),
		schemaOnly("LongSKUInThreeByteCharacters", c, itemBody(`"sku":`+jsonString(strings.Repeat("ユ", 86))+`,"quantity":1`), gapBytes),
		schemaOnly("QuantityWithFraction", c, itemBody(`"sku":"S","quantity":2.0`), gapLiteral),
		schemaOnly("QuantityWithExponent", c, itemBody(`"sku":"S","quantity":1e0`), gapLiteral),
		schemaOnly("QuantityWithCapitalExponent", c, itemBody(`"sku":"S","quantity":1E2`), gapLiteral),
		schemaOnly("LoneSurrogate", c, createdBody("orderId", `"o-\ud800"`), gapSurrogate),
		decoderOnly("NameInCapitals", c, strings.Replace(validCreated, `"orderId"`, `"ORDERID"`, 1), gapFold),
		decoderOnly("SKUInMixedCase", c, itemBody(`"sKu":"S","quantity":1`), gapFold),
		decoderOnly("SKUWithKelvinSign", c, itemBody(`"s\u212au":"S","quantity":1`), gapFold),
		decoderOnly("ItemsWithLongS", c, strings.Replace(validCreated, `"items"`, `"item\u017f"`, 1), gapFold),
		decoderOnly("NameTwiceInTwoCases", c, strings.Replace(validCreated, `{"orderId":"o-1"`, `{"orderId":"o-1","OrderId":"o-1"`, 1), gapFold),
		decoderOnly("NullAfterAMember", c, strings.Replace(validCreated, `{"orderId":"o-1"`, `{"orderId":"o-1","orderId":null`, 1), gapDuplicate),

		both("Cancelled", x, `{"orderId":"o-1","reason":"changed mind"}`),
		both("CancelledWithoutReason", x, `{"orderId":"o-1"}`),
		both("CancelledNullReason", x, `{"orderId":"o-1","reason":null}`),
		both("CancelledEmptyReason", x, `{"orderId":"o-1","reason":""}`),
		both("CancelledReasonLinesAndTabs", x, `{"orderId":"o-1","reason":"changed\tmind\nשונה"}`),
		both("CancelledReasonFormatCharacters", x, `{"orderId":"o-1","reason":"\u202eבדיקה\u200b"}`),
		both("CancelledLongestReason", x, `{"orderId":"o-1","reason":`+jsonString(strings.Repeat("r", 1000))+`}`),
		both("CancelledUnknownMembers", x, `{"orderId":"o-1","by":{"user":"u-1"}}`),
		neither("CancelledEmpty", x, `{}`),
		neither("CancelledNull", x, `null`),
		neither("CancelledMissingOrderID", x, `{"reason":"x"}`),
		neither("CancelledOrderIDNumber", x, `{"orderId":7}`),
		neither("CancelledOrderIDControl", x, `{"orderId":"o\r\n"}`),
		neither("CancelledOrderIDBidi", x, `{"orderId":"o\u202e"}`),
		neither("CancelledReasonNumber", x, `{"orderId":"o-1","reason":5}`),
		neither("CancelledReasonCR", x, `{"orderId":"o-1","reason":"a\rb"}`),
		neither("CancelledReasonESC", x, `{"orderId":"o-1","reason":"gone\u001b]0;pwned\u0007"}`),
		neither("CancelledReasonNUL", x, `{"orderId":"o-1","reason":"\u0000"}`),
		neither("CancelledReasonNEL", x, `{"orderId":"o-1","reason":"a\u0085b"}`),
		neither("CancelledReasonParagraphSeparator", x, `{"orderId":"o-1","reason":"gone\u2029Bcc: x"}`),
		neither("CancelledReasonTooLong", x, `{"orderId":"o-1","reason":`+jsonString(strings.Repeat("r", 1001))+`}`),
		neither("CancelledCapitalReasonNotText", x, `{"orderId":"o-1","REASON":5}`),
		schemaOnly("CancelledReasonLongInBytes", x, `{"orderId":"o-1","reason":`+jsonString(strings.Repeat("é", 501))+`}`, gapBytes),
		schemaOnly("CancelledLoneSurrogate", x, `{"orderId":"o-1","reason":"\udc00"}`, gapSurrogate),
		decoderOnly("CancelledReasonCapitalized", x, `{"orderId":"o-1","Reason":"x"}`, gapFold),
	}
}

// Acceptance: the decoder refuses what the schema refuses and accepts what
// it accepts, sample by sample, but for the rules JSON Schema cannot state,
// each of which the schema's description names.
func TestTheDecoderTakesWhatTheSchemaTakes(t *testing.T) {
	t.Parallel()
	c := contract(t)
	descriptions := map[string]string{}
	for typ, file := range schemaFile {
		b, err := schemas.FS.ReadFile(file)
		require.NoError(t, err)
		var doc struct{ Description string }
		require.NoError(t, json.Unmarshal(b, &doc))
		descriptions[typ] = doc.Description
	}
	for _, s := range samples() {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			schemaErr := schemas.ValidateJSON(c.Body(schemaFile[s.messageType]), []byte(s.body))
			decodeErr := decodeAs(s.messageType, []byte(s.body))
			require.Equal(t, s.schema, schemaErr == nil, "the schema: %v", schemaErr)
			require.Equal(t, s.decoder, decodeErr == nil, "the decoder: %v", decodeErr)
			if s.schema != s.decoder {
				require.NotEmpty(t, s.gap, "schema and decoder part on a rule with no name")
				require.Contains(t, descriptions[s.messageType], string(s.gap), "the schema's description says what it cannot state")
			} else {
				require.Empty(t, s.gap)
			}
		})
	}
}

// textPattern returns the pattern of the schema file name at pointer.
func textPattern(t *testing.T, name string, pointer ...string) *regexp.Regexp {
	t.Helper()
	doc, err := schemas.Resolve(name, "")
	require.NoError(t, err)
	for _, k := range pointer {
		doc = doc.(map[string]any)[k]
	}
	p, ok := doc.(map[string]any)["pattern"].(string)
	require.True(t, ok, "%s %v has a pattern", name, pointer)
	return regexp.MustCompile(p) // the validator's engine: Go's regexp
}

// next is the character after r the sweep below looks at: every one of
// the planes that hold characters (0 to 3, and 14), and a sample of the
// others (4 to 13 hold none yet, 15 and 16 private use), to keep it short.
func next(r rune) rune {
	if r < 0x40000 || r >= 0xE0000 && r < 0xF0000 {
		return r + 1
	}
	return r + 251
}

// Every character, one at a time: the schemas' patterns refuse exactly the
// characters the decoder refuses in an id (orderId, userId, email, sku)
// and in a reason.
func TestTheTextPatternsRefuseTheCharactersTheDecoderRefuses(t *testing.T) {
	t.Parallel()
	id := textPattern(t, schemas.OrderCreated, "$defs", "identifier")
	for _, p := range [][]string{{schemas.OrderCancelled, "properties", "orderId"}} {
		require.Equal(t, id.String(), textPattern(t, p[0], p[1:]...).String(), "one rule for ids: %v", p)
	}
	reason := textPattern(t, schemas.OrderCancelled, "properties", "reason")
	for r := rune(0); r <= unicode.MaxRune; r = next(r) {
		if !utf8.ValidRune(r) {
			continue // a surrogate: no character, refused before (see gapSurrogate)
		}
		text := "a" + string(r) + "b"
		idErr := decodeAs(orders.TypeOrderCancelled, []byte(`{"orderId":`+jsonString(text)+`}`))
		if id.MatchString(text) != (idErr == nil) {
			t.Errorf("orderId with %U: the schema's pattern matches: %t; the decoder: %v", r, id.MatchString(text), idErr)
		}
		reasonErr := decodeAs(orders.TypeOrderCancelled, []byte(`{"orderId":"o","reason":`+jsonString(text)+`}`))
		if reason.MatchString(text) != (reasonErr == nil) {
			t.Errorf("reason with %U: the schema's pattern matches: %t; the decoder: %v", r, reason.MatchString(text), reasonErr)
		}
	}
}

// Every name the decoder reads as a field (Go's encoding/json matches names
// regardless of case, with Unicode's simple folding: ſ is s, the Kelvin
// sign K) is one the schema's propertyNames must find, and no other.
func TestThePropertyNamesRuleFindsTheNamesTheDecoderReads(t *testing.T) {
	t.Parallel()
	createdNames := textPattern(t, schemas.OrderCreated, "propertyNames", "if")
	itemNames := textPattern(t, schemas.OrderCreated, "$defs", "item", "propertyNames", "if")
	cancelledNames := textPattern(t, schemas.OrderCancelled, "propertyNames", "if")
	// The decoder takes each body only when the renamed member is read as
	// the field it stands for.
	fields := []struct {
		name    string
		pattern *regexp.Regexp
		body    func(name string) string
	}{
		{"orderId", createdNames, nil},
		{"userId", createdNames, nil},
		{"email", createdNames, nil},
		{"items", createdNames, nil},
		{"sku", itemNames, func(n string) string { return itemBody(fmt.Sprintf(`%q:"S","quantity":1`, n)) }},
		{"quantity", itemNames, func(n string) string { return itemBody(fmt.Sprintf(`"sku":"S",%q:1`, n)) }},
		{"orderId", cancelledNames, func(n string) string { return fmt.Sprintf(`{%q:"o-1"}`, n) }},
		{"reason", cancelledNames, func(n string) string { return fmt.Sprintf(`{"orderId":"o-1",%q:5}`, n) }},
	}
	values := map[string]string{"orderId": `"o-1"`, "userId": `"u-1"`, "email": `"a@example.com"`, "items": `[{"sku":"S","quantity":2}]`}
	var cased []rune // every character with another case, and a few without
	for r := rune(0); r <= unicode.MaxRune; r++ {
		if unicode.SimpleFold(r) != r || r == '_' || r == 'İ' || r == 'ı' {
			cased = append(cased, r)
		}
	}
	for _, f := range fields {
		typ := orders.TypeOrderCreated
		if f.pattern == cancelledNames {
			typ = orders.TypeOrderCancelled
		}
		body := f.body
		if body == nil {
			body = func(n string) string {
				b := createdBody(f.name, "")
				return b[:len(b)-1] + fmt.Sprintf(",%q:%s}", n, values[f.name])
			}
		}
		for pos := range []rune(f.name) {
			for _, r := range cased {
				name := []rune(f.name)
				name[pos] = r
				n := string(name)
				err := decodeAs(typ, []byte(body(n)))
				read := err == nil
				if f.name == "reason" { // a reason of 5 is refused only when read as the reason
					read = err != nil
				}
				if f.pattern.MatchString(n) != read {
					t.Errorf("%s as %q: the schema finds it: %t; the decoder reads it: %t (%v)", f.name, n, f.pattern.MatchString(n), read, err)
				}
			}
		}
	}
}

// FuzzSchemaAgrees checks, for any body, that the schema and the decoder
// of each message type agree, but where the schemas' descriptions say they
// cannot: whatever the decoder accepts validates, unless it names a field
// in another case or twice; whatever validates, the decoder accepts, unless
// it refuses it for its length in bytes, a quantity's literal or an escaped
// half of a surrogate pair. `make fuzz-schema` explores further.
func FuzzSchemaAgrees(f *testing.F) {
	for _, s := range samples() {
		f.Add([]byte(s.body))
	}
	for _, seed := range []string{
		``, `null`, `[]`, `{}`, `{"orderId":null}`, "{\"orderId\":\"\x00\"}", `{"items":[{"quantity":-1}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":1e30}]}`,
		`{"orderId":"a","userId":"b","email":"c@d","items":[{"sku":"e","quantity":-2147483648}]}`,
		"\xff\xfe{}", `{"orderId":"\ud800"}`, `{"ORDERID":"o","orderId":"p","reason":null,"REASON":"x"}`,
	} {
		f.Add([]byte(seed))
	}
	c := contract(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, typ := range []string{orders.TypeOrderCreated, orders.TypeOrderCancelled} {
			schemaErr := schemas.ValidateJSON(c.Body(schemaFile[typ]), body)
			decodeErr := decodeAs(typ, body)
			switch {
			case (schemaErr == nil) != (decodeErr == nil) && namesFoldOrRepeat(body):
				// Which member each reads differs (gapFold, gapDuplicate).
			case decodeErr == nil && schemaErr != nil:
				t.Fatalf("%s: the decoder accepts %s, the schema refuses it: %v", typ, shortened(body), schemaErr)
			case schemaErr == nil && decodeErr != nil && !inexpressible(decodeErr):
				t.Fatalf("%s: the schema accepts %s, the decoder refuses it: %v", typ, shortened(body), decodeErr)
			}
		}
	})
}

// shortened quotes body, cut to 200 bytes.
func shortened(body []byte) string {
	if len(body) > 200 {
		return fmt.Sprintf("%q… (%d bytes)", body[:200], len(body))
	}
	return fmt.Sprintf("%q", body)
}

// inexpressible reports whether err, the decoder's refusal of a body the
// schema accepts, is for a rule JSON Schema cannot state.
func inexpressible(err error) bool {
	for _, problem := range strings.Split(err.Error(), "; ") {
		_, literal, quantity := strings.Cut(problem, "quantity must be a whole number between 1 and 1000000, got ")
		switch {
		case strings.Contains(problem, "bytes"), strings.Contains(problem, "surrogate pair"):
		case quantity && strings.ContainsAny(literal, ".eE"): // 2.0, 2e0: the integer 2 to JSON Schema
		default:
			return false
		}
	}
	return true
}

// fieldNames are the names the decoders read, at any depth.
var fieldNames = []string{"orderId", "userId", "email", "items", "sku", "quantity", "reason"}

// namesFoldOrRepeat reports whether body, JSON, has an object with two
// members whose names are one regardless of case, or a member whose name is
// a field's in another case.
func namesFoldOrRepeat(body []byte) bool {
	type container struct {
		object, wantName bool
		names            []string
	}
	var stack []*container
	dec := json.NewDecoder(bytes.NewReader(body))
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		var top *container
		if n := len(stack); n > 0 {
			top = stack[n-1]
		}
		if name, ok := tok.(string); ok && top != nil && top.wantName {
			for _, n := range append(top.names, fieldNames...) {
				if strings.EqualFold(n, name) && (n != name || slices.Contains(top.names, name)) {
					return true
				}
			}
			top.names = append(top.names, name)
			top.wantName = false
			continue
		}
		if d, ok := tok.(json.Delim); ok && (d == '}' || d == ']') {
			stack = stack[:len(stack)-1]
			continue
		}
		if top != nil && top.object {
			top.wantName = true // after this value, a name
		}
		if d, ok := tok.(json.Delim); ok {
			stack = append(stack, &container{object: d == '{', wantName: d == '{'})
		}
	}
}
