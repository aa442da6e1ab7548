// Package schemas holds inboxd's RabbitMQ contract in machine-readable form:
// a JSON Schema (draft 2020-12) for the body of each message it consumes,
// each event it publishes and its reply, and asyncapi.yaml, the AsyncAPI 3.0
// document of its exchanges, queues, AMQP properties and headers, which
// refers to them. The files are for producers and consumers; docs/contract.md
// says the same in prose.
//
// The package embeds the files and compiles them (Load), for the tests that
// hold inboxd to them: its decoder accepts what the consumed messages'
// schemas accept, and what a running inboxd publishes validates.
package schemas

import (
	"bytes"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"go.yaml.in/yaml/v3"
)

// FS holds the schema files and asyncapi.yaml.
//
//go:embed *.schema.json asyncapi.yaml
var FS embed.FS

// The files of FS: a JSON Schema per body, and the AsyncAPI document.
const (
	OrderCreated        = "order.created.schema.json"
	OrderCancelled      = "order.cancelled.schema.json"
	EventOrderConfirmed = "event.order.confirmed.schema.json"
	EventOrderRejected  = "event.order.rejected.schema.json"
	EventOrderCancelled = "event.order.cancelled.schema.json"
	EventEmailRequested = "event.email.requested.schema.json"
	Reply               = "reply.schema.json"
	AsyncAPI            = "asyncapi.yaml"
)

// Bodies lists the JSON Schema files of FS.
var Bodies = []string{OrderCreated, OrderCancelled, EventOrderConfirmed, EventOrderRejected, EventOrderCancelled, EventEmailRequested, Reply}

// base is the URL the files are compiled under, so that asyncapi.yaml's
// relative references reach the schema files beside it.
const base = "file:///inboxd/api/schemas/"

// Contract is the compiled contract: every body schema, and the messages of
// the AsyncAPI document.
type Contract struct {
	bodies   map[string]*jsonschema.Schema
	asyncAPI map[string]any
	compiler *jsonschema.Compiler
}

// Load parses and compiles every file of FS. Body schemas are draft 2020-12
// (their $schema says so); the AsyncAPI document's own schemas (headers and
// AMQP properties) compile as draft-07, which AsyncAPI's Schema Object
// extends.
func Load() (*Contract, error) {
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft7)
	for _, name := range Bodies {
		b, err := FS.ReadFile(name)
		if err != nil {
			return nil, err
		}
		doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(b))
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", name, err)
		}
		if err := c.AddResource(base+name, doc); err != nil {
			return nil, fmt.Errorf("add %s: %w", name, err)
		}
	}
	doc, err := ReadYAML(AsyncAPI)
	if err != nil {
		return nil, err
	}
	api, ok := doc.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s is not a mapping", AsyncAPI)
	}
	// Only its schemas are a schema resource: the rest of the document is
	// not JSON Schema, and its keys would read as keywords.
	components, _ := api["components"].(map[string]any)
	schemas := map[string]any{"components": map[string]any{"schemas": components["schemas"]}}
	if err := c.AddResource(base+AsyncAPI, schemas); err != nil {
		return nil, fmt.Errorf("add %s: %w", AsyncAPI, err)
	}
	k := &Contract{bodies: map[string]*jsonschema.Schema{}, asyncAPI: api, compiler: c}
	for _, name := range Bodies {
		s, err := c.Compile(base + name)
		if err != nil {
			return nil, fmt.Errorf("compile %s: %w", name, err)
		}
		k.bodies[name] = s
	}
	return k, nil
}

// ReadYAML reads a YAML file of FS as JSON would have it: mappings as
// map[string]any, numbers as json.Number.
func ReadYAML(name string) (any, error) {
	b, err := FS.ReadFile(name)
	if err != nil {
		return nil, err
	}
	var v any
	if err := yaml.Unmarshal(b, &v); err != nil {
		return nil, fmt.Errorf("parse %s: %w", name, err)
	}
	j, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%s as JSON: %w", name, err)
	}
	return jsonschema.UnmarshalJSON(bytes.NewReader(j))
}

// Body returns the compiled schema of the file name, one of Bodies.
func (c *Contract) Body(name string) *jsonschema.Schema {
	s, ok := c.bodies[name]
	if !ok {
		panic("schemas: no body schema " + name)
	}
	return s
}

// ValidateJSON validates body against s as JSON text (RFC 8259): UTF-8, one
// value, nothing after it.
func ValidateJSON(s *jsonschema.Schema, body []byte) error {
	if !utf8.Valid(body) {
		return errors.New("not UTF-8 text")
	}
	v, err := jsonschema.UnmarshalJSON(bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	return s.Validate(v)
}

// Message is a message of the AsyncAPI document, its schemas compiled.
type Message struct {
	// Name is its key in components.messages.
	Name string
	// Type is its AMQP type (bindings.amqp.messageType).
	Type string
	// Payload, Headers and Properties validate its body (nil: any body),
	// its application headers and its AMQP properties (x-amqp-properties).
	Payload, Headers, Properties *jsonschema.Schema
}

// MessageOn returns the message the AsyncAPI document says travels on the
// channel of exchange and routing key address (address "" for a channel
// whose address is null, as the replies'), with the AMQP type messageType
// (any, when ""). Exactly one must match.
func (c *Contract) MessageOn(exchange, address, messageType string) (*Message, error) {
	var found []*Message
	channels, _ := c.asyncAPI["channels"].(map[string]any)
	for id, ch := range channels {
		ch, _ := ch.(map[string]any)
		addr, _ := ch["address"].(string)
		if lookup(ch, "bindings", "amqp", "is") != "routingKey" || lookup(ch, "bindings", "amqp", "exchange", "name") != exchange || addr != address {
			continue
		}
		msgs, _ := ch["messages"].(map[string]any)
		for key, m := range msgs {
			msg, err := c.message(m)
			if err != nil {
				return nil, fmt.Errorf("channel %s, message %s: %w", id, key, err)
			}
			if messageType == "" || msg.Type == messageType {
				found = append(found, msg)
			}
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("%d messages of type %q on exchange %q with routing key %q, not one", len(found), messageType, exchange, address)
	}
	return found[0], nil
}

// message compiles a channel's message, a reference to components.messages.
func (c *Contract) message(m any) (*Message, error) {
	ref, _ := lookup(m, "$ref").(string)
	name, ok := strings.CutPrefix(ref, "#/components/messages/")
	if !ok {
		return nil, fmt.Errorf("not a reference to a component message: %v", m)
	}
	def := lookup(c.asyncAPI, "components", "messages", name)
	if def == nil {
		return nil, fmt.Errorf("no message %s", ref)
	}
	msg := &Message{Name: name}
	msg.Type, _ = lookup(def, "bindings", "amqp", "messageType").(string)
	if p, _ := lookup(def, "payload", "schema", "$ref").(string); p != "" {
		file := path.Clean(p)
		if msg.Payload = c.bodies[file]; msg.Payload == nil {
			return nil, fmt.Errorf("payload %s is not a body schema", p)
		}
	}
	var err error
	if msg.Headers, err = c.component(def, "headers"); err != nil {
		return nil, err
	}
	if msg.Properties, err = c.component(def, "x-amqp-properties"); err != nil {
		return nil, err
	}
	return msg, nil
}

// component compiles the schema def[key] refers to in components.schemas.
func (c *Contract) component(def any, key string) (*jsonschema.Schema, error) {
	ref, _ := lookup(def, key, "$ref").(string)
	if !strings.HasPrefix(ref, "#/components/schemas/") {
		return nil, fmt.Errorf("%s is not a reference to a component schema", key)
	}
	s, err := c.compiler.Compile(base + AsyncAPI + ref)
	if err != nil {
		return nil, fmt.Errorf("compile %s: %w", ref, err)
	}
	return s, nil
}

// lookup returns the value at the keys of nested mappings, or nil.
func lookup(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// Validate checks a delivery of m: its body against Payload, its headers
// against Headers and its AMQP properties (those set, by their AMQP names)
// against Properties.
func (m *Message) Validate(d amqp.Delivery) error {
	var errs []error
	if m.Payload != nil {
		if err := ValidateJSON(m.Payload, d.Body); err != nil {
			errs = append(errs, fmt.Errorf("body: %w", err))
		}
	}
	if err := m.Headers.Validate(jsonValue(map[string]any(d.Headers))); err != nil {
		errs = append(errs, fmt.Errorf("headers: %w", err))
	}
	if err := m.Properties.Validate(Properties(d)); err != nil {
		errs = append(errs, fmt.Errorf("properties: %w", err))
	}
	return errors.Join(errs...)
}

// Properties returns the AMQP properties d carries, by their AMQP names
// (content_type, message_id, …): a property not set is absent, the
// timestamp is in seconds since 1970.
func Properties(d amqp.Delivery) map[string]any {
	p := map[string]any{}
	set := func(name, v string) {
		if v != "" {
			p[name] = v
		}
	}
	set("content_type", d.ContentType)
	set("content_encoding", d.ContentEncoding)
	set("correlation_id", d.CorrelationId)
	set("reply_to", d.ReplyTo)
	set("expiration", d.Expiration)
	set("message_id", d.MessageId)
	set("type", d.Type)
	set("user_id", d.UserId)
	set("app_id", d.AppId)
	if d.DeliveryMode != 0 {
		p["delivery_mode"] = int(d.DeliveryMode)
	}
	if d.Priority != 0 {
		p["priority"] = int(d.Priority)
	}
	if !d.Timestamp.IsZero() {
		p["timestamp"] = d.Timestamp.Unix()
	}
	return p
}

// jsonValue turns an AMQP field value into what the validator takes.
func jsonValue(v any) any {
	switch v := v.(type) {
	case map[string]any:
		out := make(map[string]any, len(v))
		for k, x := range v {
			out[k] = jsonValue(x)
		}
		return out
	case amqp.Table:
		return jsonValue(map[string]any(v))
	case []any:
		out := make([]any, len(v))
		for i, x := range v {
			out[i] = jsonValue(x)
		}
		return out
	case []byte:
		return string(v)
	case time.Time:
		return v.Unix()
	case amqp.Decimal:
		return fmt.Sprintf("%de-%d", v.Value, v.Scale)
	case nil, string, bool, int, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64:
		return v
	default:
		return fmt.Sprint(v)
	}
}

// Refs returns every "$ref" in v, a parsed document, with the path to it.
func Refs(v any) map[string]string {
	refs := map[string]string{}
	var walk func(at string, v any)
	walk = func(at string, v any) {
		switch v := v.(type) {
		case map[string]any:
			for k, x := range v {
				if s, ok := x.(string); ok && k == "$ref" {
					refs[at+"/$ref"] = s
					continue
				}
				walk(at+"/"+k, x)
			}
		case []any:
			for i, x := range v {
				walk(fmt.Sprintf("%s/%d", at, i), x)
			}
		}
	}
	walk("", v)
	return refs
}

// Resolve returns what ref, a reference from the file from of FS, points
// to: a file of FS beside it and a JSON pointer into it (RFC 6901).
func Resolve(from, ref string) (any, error) {
	file, pointer, _ := strings.Cut(ref, "#")
	if file == "" {
		file = from
	} else {
		file = path.Join(path.Dir(from), file)
	}
	if _, err := fs.Stat(FS, file); err != nil {
		return nil, fmt.Errorf("%s: no file %s", ref, file)
	}
	var doc any
	var err error
	if strings.HasSuffix(file, ".yaml") {
		doc, err = ReadYAML(file)
	} else {
		var b []byte
		if b, err = FS.ReadFile(file); err == nil {
			doc, err = jsonschema.UnmarshalJSON(bytes.NewReader(b))
		}
	}
	if err != nil {
		return nil, err
	}
	if pointer == "" {
		return doc, nil
	}
	if !strings.HasPrefix(pointer, "/") {
		return nil, fmt.Errorf("%s: not a JSON pointer", ref)
	}
	for _, tok := range strings.Split(pointer[1:], "/") {
		tok = strings.NewReplacer("~1", "/", "~0", "~").Replace(tok)
		m, ok := doc.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("%s: %q is not in a mapping", ref, tok)
		}
		if doc, ok = m[tok]; !ok {
			return nil, fmt.Errorf("%s: no %q", ref, tok)
		}
	}
	return doc, nil
}
