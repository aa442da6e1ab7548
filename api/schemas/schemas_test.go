package schemas_test

import (
	"encoding/json"
	"io/fs"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/api/schemas"
)

// Every body schema is draft 2020-12 and compiles, with its own examples
// valid; nothing else lies beside them but the AsyncAPI document.
func TestEverySchemaCompiles(t *testing.T) {
	t.Parallel()
	c, err := schemas.Load()
	require.NoError(t, err)

	files, err := fs.Glob(schemas.FS, "*")
	require.NoError(t, err)
	require.ElementsMatch(t, append(slices.Clone(schemas.Bodies), schemas.AsyncAPI), files)

	for _, name := range schemas.Bodies {
		b, err := schemas.FS.ReadFile(name)
		require.NoError(t, err)
		var doc struct {
			Schema   string            `json:"$schema"`
			Title    string            `json:"title"`
			Examples []json.RawMessage `json:"examples"`
		}
		require.NoError(t, json.Unmarshal(b, &doc), name)
		require.Equal(t, "https://json-schema.org/draft/2020-12/schema", doc.Schema, name)
		require.NotEmpty(t, doc.Title, name)
		require.NotEmpty(t, doc.Examples, "%s shows what it takes", name)
		for _, ex := range doc.Examples {
			require.NoError(t, schemas.ValidateJSON(c.Body(name), ex), "%s: example %s", name, ex)
		}
	}
}

// The AsyncAPI document is AsyncAPI 3.0 YAML, and every $ref in it, and in
// the schemas it refers to, resolves to a file beside it and a definition
// in that file. Every body schema is the payload of a message, as JSON
// Schema 2020-12.
func TestTheAsyncAPIDocumentsReferencesResolve(t *testing.T) {
	t.Parallel()
	doc, err := schemas.ReadYAML(schemas.AsyncAPI)
	require.NoError(t, err)
	api := doc.(map[string]any)
	require.Equal(t, "3.0.0", api["asyncapi"])
	for _, key := range []string{"info", "servers", "channels", "operations", "components"} {
		require.Contains(t, api, key)
	}

	files := map[string]bool{}
	refs := schemas.Refs(doc)
	require.NotEmpty(t, refs)
	for at, ref := range refs {
		_, err := schemas.Resolve(schemas.AsyncAPI, ref)
		require.NoError(t, err, "%s at %s", ref, at)
		if file, _, _ := strings.Cut(ref, "#"); file != "" {
			files[strings.TrimPrefix(file, "./")] = true
			require.True(t, strings.HasSuffix(at, "/payload/schema/$ref"), "%s at %s: a schema file is a payload", ref, at)
		}
	}
	for _, name := range schemas.Bodies {
		require.True(t, files[name], "%s is the payload of a message", name)
		body, err := schemas.Resolve(schemas.AsyncAPI, name)
		require.NoError(t, err)
		for at, ref := range schemas.Refs(body) {
			_, err := schemas.Resolve(name, ref)
			require.NoError(t, err, "%s: %s at %s", name, ref, at)
		}
	}

	// Payloads name their format; every operation's channel and messages
	// are the document's.
	for name, m := range api["components"].(map[string]any)["messages"].(map[string]any) {
		payload := m.(map[string]any)["payload"].(map[string]any)
		if _, ok := payload["schema"]; ok {
			require.Equal(t, "application/schema+json;version=2020-12", payload["schemaFormat"], name)
		}
	}
	for name, op := range api["operations"].(map[string]any) {
		op := op.(map[string]any)
		require.Contains(t, []any{"send", "receive"}, op["action"], name)
		channel := op["channel"].(map[string]any)["$ref"].(string)
		for _, m := range op["messages"].([]any) {
			ref := m.(map[string]any)["$ref"].(string)
			require.True(t, strings.HasPrefix(ref, channel+"/messages/"), "%s: message %s is on its channel %s", name, ref, channel)
		}
	}
}

// Each message inboxd publishes is found by where it goes, as a consumer
// of the AsyncAPI document would find it.
func TestEveryPublishedMessageIsFoundByItsChannel(t *testing.T) {
	t.Parallel()
	c, err := schemas.Load()
	require.NoError(t, err)
	for _, tc := range []struct{ exchange, key, typ, name string }{
		{"order-confirmation.events", "order.confirmed", "order.confirmed", "orderConfirmed"},
		{"order-confirmation.events", "order.rejected", "order.rejected", "orderRejected"},
		{"order-confirmation.events", "order.cancelled", "order.cancelled", "orderCancelledEvent"},
		{"order-confirmation.events", "email.requested", "email.requested", "emailRequested"},
		{"", "", "reply", "reply"},
		{"order-confirmation.dlx", "", "", "deadLetter"},
		{"orders", "order.created", "order.created", "orderCreated"},
		{"orders", "order.cancelled", "order.cancelled", "orderCancelled"},
	} {
		m, err := c.MessageOn(tc.exchange, tc.key, tc.typ)
		require.NoError(t, err)
		require.Equal(t, tc.name, m.Name)
		require.Equal(t, tc.typ, m.Type)
		require.NotNil(t, m.Headers)
		require.NotNil(t, m.Properties)
		require.Equal(t, tc.name != "deadLetter", m.Payload != nil, tc.name)
	}
	_, err = c.MessageOn("order-confirmation.events", "order.shipped", "")
	require.Error(t, err)
}
