// Package statuspage serves inboxd's read-only status page and its JSON:
// what the operators' views say now (inbox_overview, outbox_backlog), the
// last 15 minutes (inbox_throughput), what is dying (inbox_dead,
// inbox_dead_by_error, inbox_failures_by_build, inbox_held_back, replays,
// inbox_conflicts) and one message's story (inbox, inbox_attempts). It
// never shows a payload.
//
// Every read is one read-only transaction under a short statement_timeout,
// on a pool of its own, and its answer is cached for about a second and
// shared by every request, so a page left open on many screens costs the
// database at most one query per view per second.
package statuspage

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/orderconfirm/inboxd/internal/msgid"
)

// Defaults of Config.
const (
	// TimeoutDefault bounds one read of the views.
	TimeoutDefault = 2 * time.Second
	// CacheTTLDefault is how long an answer is served from the cache.
	CacheTTLDefault = time.Second
	// RefreshDefault is how often the page reloads itself.
	RefreshDefault = 5 * time.Second
	// MaxRowsDefault bounds each list on the page.
	MaxRowsDefault = 20
	// PoolSizeDefault is the connection budget the status page's pool
	// should have; the caller builds the pool.
	PoolSizeDefault = 2
)

// maxCachedMessages bounds the cache of message pages.
const maxCachedMessages = 1000

// Config configures a Handler.
type Config struct {
	// Logger receives a warning when the database becomes unreachable and
	// a note when it is back. Defaults to slog.Default().
	Logger *slog.Logger
	// Build names the running build of inboxd.
	Build string
	// Started is when the service started. Defaults to the time New is
	// called.
	Started time.Time
	// State reports the service's own state on every request. Defaults to
	// a func reporting the zero ServiceState.
	State func() ServiceState
	// Timeout bounds one read of the views (connecting included) and is
	// the statement_timeout of each of its queries. Defaults to
	// TimeoutDefault (2 seconds).
	Timeout time.Duration
	// CacheTTL is how long one read is served to every request. Defaults
	// to CacheTTLDefault (1 second).
	CacheTTL time.Duration
	// Refresh is how often the page reloads itself. Defaults to
	// RefreshDefault (5 seconds).
	Refresh time.Duration
	// MaxRows bounds each list (dead messages, replays, …). Defaults to
	// MaxRowsDefault (20).
	MaxRows int
}

// Handler serves the status page: GET / (HTML), /messages/{message_id},
// /api/overview, /api/messages/{message_id} and /static/.
type Handler struct {
	cfg       Config
	reader    *reader
	overviews *cache[*Overview]
	messages  *cache[*Message]
	mux       *http.ServeMux
	dbDown    atomic.Bool
}

// New returns the status page reading through pool, which should be a pool
// of its own (PoolSizeDefault connections): the page then cannot take
// connections from the service's work.
func New(pool *pgxpool.Pool, cfg *Config) (*Handler, error) {
	if pool == nil {
		return nil, errors.New("statuspage: a pool is required")
	}
	c := *cfg
	c.Logger = cmp.Or(c.Logger, slog.Default())
	if c.Started.IsZero() {
		c.Started = time.Now()
	}
	if c.State == nil {
		c.State = func() ServiceState { return ServiceState{} }
	}
	c.Timeout = cmp.Or(c.Timeout, TimeoutDefault)
	c.CacheTTL = cmp.Or(c.CacheTTL, CacheTTLDefault)
	c.Refresh = cmp.Or(c.Refresh, RefreshDefault)
	c.MaxRows = cmp.Or(c.MaxRows, MaxRowsDefault)
	if c.Timeout < 0 || c.CacheTTL < 0 || c.Refresh < 0 || c.MaxRows < 0 {
		return nil, errors.New("statuspage: Timeout, CacheTTL, Refresh and MaxRows must not be negative")
	}
	c.Logger = c.Logger.With("component", "statuspage")
	h := &Handler{
		cfg:       c,
		reader:    newReader(pool, c.Timeout, c.MaxRows),
		overviews: newCache[*Overview](c.CacheTTL, 1),
		messages:  newCache[*Message](c.CacheTTL, maxCachedMessages),
		mux:       http.NewServeMux(),
	}
	h.mux.HandleFunc("GET /{$}", h.serveOverviewPage)
	h.mux.HandleFunc("GET /api/overview", h.serveOverviewJSON)
	h.mux.HandleFunc("GET /messages/{message_id...}", h.serveMessagePage)
	h.mux.HandleFunc("GET /api/messages/{message_id...}", h.serveMessageJSON)
	h.mux.Handle("GET /static/", http.StripPrefix("/static/", staticHandler()))
	return h, nil
}

// ServeHTTP serves the page's routes; any other path is 404.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	// Nothing but this origin, and no scripts: the page works on a closed
	// network and cannot be made to load anything else.
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; frame-ancestors 'none'; form-action 'none'; base-uri 'none'")
	w.Header().Set("Referrer-Policy", "no-referrer")
	h.mux.ServeHTTP(w, r)
}

// QueryCounts returns how many times each view (and the message queries,
// "inbox" and "inbox_attempts") has been queried since New.
func (h *Handler) QueryCounts() map[string]int64 { return h.reader.queryCounts() }

// Overview returns the page's data: from the cache when it is younger than
// Config.CacheTTL, else read once for every caller waiting on it. When the
// database cannot be read within Config.Timeout, Database.Reachable is
// false and only Service is filled.
func (h *Handler) Overview() *Overview {
	o, err := h.overviews.get("overview", func() (*Overview, error) {
		o, err := h.reader.overview(context.Background())
		if err == nil {
			o.ReadAt = time.Now()
		}
		return o, err
	})
	h.noteDatabase(err)
	out := &Overview{ReadAt: time.Now()}
	if err == nil {
		copied := *o
		out = &copied
		out.Database.Reachable = true
	} else {
		out.Database.Error = describe(err)
	}
	out.Service = h.service()
	return out
}

// Message returns one message's story, cached like Overview. Found is false
// when no inbox row has the id.
func (h *Handler) Message(messageID string) *Message {
	m, err := h.messages.get(messageID, func() (*Message, error) {
		m, err := h.reader.message(context.Background(), messageID)
		if errors.Is(err, errNotFound) {
			return &Message{ReadAt: time.Now(), Database: Database{Reachable: true}}, nil
		}
		if err == nil {
			m.ReadAt, m.Database.Reachable = time.Now(), true
		}
		return m, err
	})
	h.noteDatabase(err)
	if err != nil {
		return &Message{ReadAt: time.Now(), Database: Database{Error: describe(err)}}
	}
	return m
}

func (h *Handler) service() Service {
	return Service{
		Build:         h.cfg.Build,
		StartedAt:     h.cfg.Started,
		UptimeSeconds: time.Since(h.cfg.Started).Seconds(),
		ServiceState:  h.cfg.State(),
	}
}

// noteDatabase logs when the database becomes unreachable and when it is
// back, not on every request.
func (h *Handler) noteDatabase(err error) {
	if err != nil {
		if !h.dbDown.Swap(true) {
			h.cfg.Logger.Warn("status page cannot read the database", slog.String("error", err.Error()))
		}
		return
	}
	if h.dbDown.Swap(false) {
		h.cfg.Logger.Info("status page reads the database again")
	}
}

// describe says why a read failed, without connection details.
func describe(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return "database unreachable: no answer within the status page's timeout"
	}
	return "database unreachable or the views cannot be read"
}

func (h *Handler) serveOverviewPage(w http.ResponseWriter, _ *http.Request) {
	o := h.Overview()
	h.render(w, statusOf(o.Database), "overview.html", overviewPage{Overview: o, Chart: newChart(o.Throughput), Refresh: h.refreshSeconds()})
}

func (h *Handler) serveOverviewJSON(w http.ResponseWriter, _ *http.Request) {
	o := h.Overview()
	writeJSON(w, statusOf(o.Database), o)
}

// badMessageID answers 400, without asking the database, a request for an
// id the inbox cannot hold (see msgid.Check), and reports whether it did.
func badMessageID(w http.ResponseWriter, id string) bool {
	err := msgid.Check(id)
	if err == nil {
		return false
	}
	writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
	return true
}

func (h *Handler) serveMessagePage(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("message_id")
	if badMessageID(w, id) {
		return
	}
	m := h.Message(id)
	status := statusOf(m.Database)
	if status == http.StatusOK && !m.Found {
		status = http.StatusNotFound
	}
	h.render(w, status, "message.html", messagePage{ID: id, Message: m, Service: h.service(), Refresh: h.refreshSeconds()})
}

func (h *Handler) serveMessageJSON(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("message_id")
	if badMessageID(w, id) {
		return
	}
	m := h.Message(id)
	status := statusOf(m.Database)
	if status == http.StatusOK && !m.Found {
		status = http.StatusNotFound
	}
	writeJSON(w, status, m)
}

func (h *Handler) refreshSeconds() int {
	return max(int(h.cfg.Refresh.Round(time.Second).Seconds()), 1)
}

// statusOf is 503 while the database cannot be read (the page still says
// so, readably), else 200.
func statusOf(db Database) int {
	if !db.Reachable {
		return http.StatusServiceUnavailable
	}
	return http.StatusOK
}

func (h *Handler) render(w http.ResponseWriter, status int, name string, data any) {
	var buf bytes.Buffer
	if err := templates.ExecuteTemplate(&buf, name, data); err != nil {
		h.cfg.Logger.Error("render status page", slog.String("template", name), slog.String("error", err.Error()))
		http.Error(w, "the status page failed to render", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// overviewPage is the data of overview.html.
type overviewPage struct {
	*Overview
	Chart   chart
	Refresh int
}

// messagePage is the data of message.html.
type messagePage struct {
	ID      string
	Message *Message
	Service Service
	Refresh int
}
