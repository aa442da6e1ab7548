package statuspage

import (
	"embed"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// templates are the page's HTML templates, parsed once.
var templates = template.Must(template.New("").Funcs(template.FuncMap{
	"num":        formatCount,
	"age":        formatAge,
	"when":       formatTime,
	"messageURL": messageURL,
	"str":        deref,
	"isoTime":    isoTime,
	"sub":        func(a, b float64) float64 { return a - b },
	"byBuild":    groupByBuild,
	"headData": func(title string, refresh int) map[string]any {
		return map[string]any{"Title": title, "Refresh": refresh}
	},
	"headerData": func(s Service, db Database, alert bool, refresh int) headerData {
		return headerData{Service: s, Database: db, Alert: alert || !db.Reachable, Degraded: s.Degraded(), Refresh: refresh}
	},
	"footerData": func(readAt time.Time, refresh int) map[string]any {
		return map[string]any{"ReadAt": readAt, "Refresh": refresh}
	},
}).ParseFS(templateFS, "templates/*.html"))

// headerData is the data of the header template: red (Alert) only for what
// needs a person, amber (Degraded) while RabbitMQ is not connected.
type headerData struct {
	Service  Service
	Database Database
	Alert    bool
	Degraded bool
	Refresh  int
}

func staticHandler() http.Handler {
	sub, err := fs.Sub(staticFS, "static")
	if err != nil {
		panic(err) // the embedded tree always has static/
	}
	files := http.FileServerFS(sub)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=3600")
		files.ServeHTTP(w, r)
	})
}

// formatCount writes n with thousands separators: 12,345.
func formatCount(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// formatAge writes a number of seconds the way a person reads it: 42s,
// 3m 20s, 2h 05m, 3d 4h.
func formatAge(seconds float64) string {
	d := time.Duration(seconds * float64(time.Second)).Round(time.Second)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm %02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 24*time.Hour:
		return fmt.Sprintf("%dh %02dm", int(d.Hours()), int(d.Minutes())%60)
	default:
		return fmt.Sprintf("%dd %dh", int(d.Hours())/24, int(d.Hours())%24)
	}
}

// formatTime writes a time in UTC to the second, "—" for none. It takes a
// time.Time or a *time.Time.
func formatTime(v any) string {
	var t time.Time
	switch x := v.(type) {
	case time.Time:
		t = x
	case *time.Time:
		if x == nil {
			return "—"
		}
		t = *x
	}
	if t.IsZero() {
		return "—"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func isoTime(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// messageURL is the path of a message's page.
func messageURL(id string) string { return "/messages/" + url.PathEscape(id) }

func deref(s *string) string {
	if s == nil {
		return "—"
	}
	return *s
}

// buildGroup is the rows of inbox_failures_by_build of one build, with the
// statement that replays its dead messages.
type buildGroup struct {
	Build     string
	Rows      []BuildFailure
	ReplaySQL string
}

// groupByBuild groups rows by build, in the order the view gives them.
func groupByBuild(rows []BuildFailure) []buildGroup {
	var groups []buildGroup
	index := map[string]int{}
	for _, r := range rows {
		i, ok := index[r.Build]
		if !ok {
			i = len(groups)
			index[r.Build] = i
			groups = append(groups, buildGroup{Build: r.Build, ReplaySQL: r.ReplaySQL})
		}
		groups[i].Rows = append(groups[i].Rows, r)
	}
	return groups
}
