package main

import (
	"cmp"
	"encoding/json"
	"io"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// redactedMask replaces a password wherever inboxd prints text.
const redactedMask = "xxxxx"

// minSecretLen is the shortest password form replaced wherever it appears
// in a text; shorter ones are still masked where they stand in a URL's
// userinfo or after password=, but not in free text, where they would
// mask ordinary words.
const minSecretLen = 3

// redactor removes the passwords of the secret settings' values from any
// text. It finds them by string operations, so a value that no parser
// accepts is redacted too, and it masks every spelling a library may print:
// raw, percent-decoded, percent-encoded, Go- and JSON-quoted.
type redactor struct {
	secrets []string // longest first, so a longer form is masked whole
}

// newRedactor returns a redactor for the passwords found in values (URLs
// or key=value DSNs; others add nothing).
func newRedactor(values ...string) *redactor {
	r := &redactor{}
	for _, v := range values {
		r.add(passwordsIn(v)...)
	}
	return r
}

// otlpHeaderSettings are the OpenTelemetry variables whose values are
// headers sent to the collector: key=value pairs separated by commas, each
// value percent-encoded, and as far as inboxd knows each a credential (an
// API key, a bearer token).
var otlpHeaderSettings = []string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"}

// redactorFor returns the redactor of the secrets in the environment: the
// passwords of DATABASE_URL and of each AMQP_URL node, and the values of
// the OTLP headers.
func redactorFor(getenv func(string) string, amqpNodes func(string) []string) *redactor {
	r := newRedactor(append([]string{getenv("DATABASE_URL")}, amqpNodes(getenv("AMQP_URL"))...)...)
	for _, name := range otlpHeaderSettings {
		r.add(headerValues(getenv(name))...)
	}
	return r
}

// headerValues returns the values of a key=value,... header list, each as
// written and percent-decoded, and the last word of each (the token of
// "Bearer <token>"). A pair without "=" (the common slip
// "Authorization: Bearer <token>"), which the OpenTelemetry SDK prints
// whole when it refuses it, gives the pair and its last word.
func headerValues(v string) []string {
	var out []string
	lastWord := func(s string) string {
		words := strings.FieldsFunc(s, func(r rune) bool { return r == ' ' || r == '\t' || r == ':' })
		if len(words) < 2 {
			return ""
		}
		return words[len(words)-1]
	}
	for pair := range strings.SplitSeq(v, ",") {
		_, val, ok := strings.Cut(pair, "=")
		if !ok {
			val = pair
		}
		val = strings.TrimSpace(val)
		out = append(out, val, lastWord(val))
		if dec, err := url.PathUnescape(val); err == nil && dec != val {
			out = append(out, dec, lastWord(dec))
		}
	}
	return out
}

// add makes the redactor mask each of secrets, in every spelling.
func (r *redactor) add(secrets ...string) {
	seen := map[string]bool{}
	for _, s := range r.secrets {
		seen[s] = true
	}
	for _, secret := range secrets {
		for _, form := range spellings(secret) {
			if len(form) >= minSecretLen && !seen[form] {
				seen[form] = true
				r.secrets = append(r.secrets, form)
			}
		}
	}
	slices.SortFunc(r.secrets, func(a, b string) int { return cmp.Compare(len(b), len(a)) })
}

// redact returns s without any password: every known form of the
// passwords is masked, and so is whatever stands in a URL's userinfo
// password or after password= in s.
func (r *redactor) redact(s string) string {
	if r != nil {
		for _, pw := range r.secrets {
			s = strings.ReplaceAll(s, pw, redactedMask)
		}
	}
	return maskKeyValuePasswords(maskURLPasswords(s))
}

// writer returns w with every write redacted (the logger writes a record
// per call).
func (r *redactor) writer(w io.Writer) io.Writer { return redactingWriter{w: w, r: r} }

type redactingWriter struct {
	w io.Writer
	r *redactor
}

func (w redactingWriter) Write(p []byte) (int, error) {
	if _, err := io.WriteString(w.w, w.r.redact(string(p))); err != nil {
		return 0, err
	}
	return len(p), nil
}

// redactedError keeps err for errors.Is and errors.As, and prints it
// redacted.
type redactedError struct {
	err error
	r   *redactor
}

func (e redactedError) Error() string { return e.r.redact(e.err.Error()) }
func (e redactedError) Unwrap() error { return e.err }

// passwordsIn returns what may be a password in v, found without parsing
// it: for each scheme://user:…@, the text between the user's colon and
// each later @ (a password may hold a raw @, so the last @ may end it, or
// an earlier one); and each value of password= or sslpassword= (quoted or
// not).
func passwordsIn(v string) []string {
	var out []string
	for i := 0; ; {
		j := strings.Index(v[i:], "://")
		if j < 0 {
			break
		}
		rest := v[i+j+3:]
		i += j + 3
		colon := strings.IndexByte(rest, ':')
		at := strings.LastIndexByte(rest, '@')
		if colon < 0 || at < colon || strings.ContainsAny(rest[:colon], "/?#@") {
			continue
		}
		for k := colon + 1; k <= at; k++ {
			if rest[k] == '@' {
				out = append(out, rest[colon+1:k])
			}
		}
	}
	for _, m := range keyValuePassword.FindAllStringSubmatch(v, -1) {
		val := m[2]
		if strings.HasPrefix(val, "'") {
			val = strings.TrimSuffix(strings.TrimPrefix(val, "'"), "'")
			out = append(out, val, strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(val))
		} else {
			out = append(out, val)
		}
	}
	return out
}

// spellings returns pw as a library may print it: raw, percent-decoded
// (leniently: invalid escapes stay as they are), percent-encoded, quoted.
func spellings(pw string) []string {
	decoded := lenientUnescape(pw)
	forms := []string{pw, decoded, url.QueryEscape(decoded), url.PathEscape(decoded),
		(&url.URL{User: url.UserPassword("", decoded)}).User.String()[1:]}
	for _, f := range []string{pw, decoded} {
		q := strconv.Quote(f)
		forms = append(forms, q[1:len(q)-1])
		if b, err := json.Marshal(f); err == nil {
			forms = append(forms, string(b[1:len(b)-1]))
		}
	}
	return forms
}

// lenientUnescape decodes the valid %XX escapes of s and keeps the rest.
func lenientUnescape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '%' && i+2 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+3], 16, 8); err == nil {
				b.WriteByte(byte(n))
				i += 2
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// keyValuePassword matches password=… and sslpassword=… in a DSN or a
// URL's query: a quoted value with its escapes, or one up to a space, &
// or quote.
var keyValuePassword = regexp.MustCompile(`(?i)\b((?:ssl)?password=)('(?:[^'\\]|\\.)*'?|[^\s&'"` + "`" + `]*)`)

func maskKeyValuePasswords(s string) string {
	return keyValuePassword.ReplaceAllString(s, "${1}"+redactedMask)
}

// urlUserinfo matches scheme://user:password@ in free text; the password
// is what lies between the user's colon and the last @ before the URL ends
// (at a space or a quote).
var urlUserinfo = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@"'` + "`" + `]*:)[^\s"'` + "`" + `]*@`)

func maskURLPasswords(s string) string {
	return urlUserinfo.ReplaceAllString(s, "${1}"+redactedMask+"@")
}
