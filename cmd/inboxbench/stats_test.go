package main

import (
	"bytes"
	"testing"
	"time"
)

func TestQuantile(t *testing.T) {
	ms := time.Millisecond
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = time.Duration(100-i) * ms
	}
	for _, tc := range []struct {
		name string
		ds   []time.Duration
		p    float64
		want string
	}{
		{"none", nil, 0.5, "-"},
		{"median of three, unsorted", []time.Duration{3 * ms, 1 * ms, 2 * ms}, 0.5, "2ms"},
		{"the least", []time.Duration{3 * ms, 1 * ms, 2 * ms}, 0, "1ms"},
		{"1 is the greatest", []time.Duration{3 * ms, 1 * ms, 2 * ms}, 1, "3ms"},
		{"p50 of 100 is the 51st", hundred, 0.5, "51ms"},
		{"p99 of 100 is the 100th", hundred, 0.99, "100ms"},
		{"rounded to 100µs", []time.Duration{1234 * time.Microsecond}, 0.5, "1.2ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := quantile(tc.ds, tc.p); got != tc.want {
				t.Errorf("quantile(%v, %v) = %q, want %q", tc.ds, tc.p, got, tc.want)
			}
		})
	}
}

func TestPerWindow(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	ms := time.Millisecond
	for _, tc := range []struct {
		name    string
		sent    map[string]time.Duration // after t0
		latency map[string]time.Duration
		run     time.Duration
		want    string
	}{
		{
			name:    "a fifth of a short run",
			sent:    map[string]time.Duration{"a": 0, "b": time.Second, "c": 3 * time.Second},
			latency: map[string]time.Duration{"a": 10 * ms, "b": 20 * ms, "c": 30 * ms},
			run:     10 * time.Second,
			want:    "20ms, 30ms (each 2s)",
		},
		{
			name:    "a window with nothing sent",
			sent:    map[string]time.Duration{"a": 0, "c": 5 * time.Second},
			latency: map[string]time.Duration{"a": 10 * ms, "c": 30 * ms},
			run:     10 * time.Second,
			want:    "10ms, -, 30ms (each 2s)",
		},
		{
			name:    "at most a minute",
			sent:    map[string]time.Duration{"a": 0, "b": 90 * time.Second},
			latency: map[string]time.Duration{"a": 10 * ms, "b": 20 * ms},
			run:     10 * time.Minute,
			want:    "10ms, 20ms (each 1m0s)",
		},
		{
			name:    "at least a second",
			sent:    map[string]time.Duration{"a": 0},
			latency: map[string]time.Duration{"a": 10 * ms},
			run:     time.Second,
			want:    "10ms (each 1s)",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sent := make(map[string]time.Time, len(tc.sent))
			for id, d := range tc.sent {
				sent[id] = t0.Add(d)
			}
			if got := perWindow(sent, tc.latency, tc.run); got != tc.want {
				t.Errorf("perWindow = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestSinceSent(t *testing.T) {
	t0 := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC)
	sent := map[string]time.Time{"a": t0, "b": t0.Add(time.Second)}
	got := sinceSent(sent, map[string]time.Time{"b": t0.Add(1500 * time.Millisecond)})
	if len(got) != 1 || got[0] != 500*time.Millisecond {
		t.Errorf("sinceSent = %v, want [500ms]: only what arrived, from its own send", got)
	}
}

func TestMean(t *testing.T) {
	for _, tc := range []struct {
		xs   []float64
		want float64
	}{
		{[]float64{4}, 4},
		{[]float64{1, 2, 3}, 2},
		{[]float64{10, 20, 30, 40}, 25},
	} {
		if got := mean(tc.xs); got != tc.want {
			t.Errorf("mean(%v) = %v, want %v", tc.xs, got, tc.want)
		}
	}
}

func TestReportPrintAlignsTheFigures(t *testing.T) {
	r := &report{}
	r.add("1. short", "%.0f msg/s", 1234.4)
	r.add("   a longer name", "%d", 7)
	var b bytes.Buffer
	if err := r.print(&b); err != nil {
		t.Fatal(err)
	}
	want := "1. short          1234 msg/s\n   a longer name  7\n"
	if b.String() != want {
		t.Errorf("print wrote\n%q\nwant\n%q", b.String(), want)
	}
}
