package main

import (
	"encoding/json"
	"reflect"
	"testing"
)

func TestCompareReadingsNamesEveryDifference(t *testing.T) {
	before := map[string]reading{
		"view inbox_overview": {"pending": {"1"}, "dead": {"6"}},
		"page /api/overview":  {"inbox.pending": {"1"}},
		"view gone":           {"n": {"1"}},
	}
	after := map[string]reading{
		"view inbox_overview":   {"pending": {"1"}, "dead": {"7"}, "new_column": {"0"}},
		"page /api/overview":    {"inbox.pending": {"1"}},
		"view inbox_key_ledger": {"keys": {"3"}},
	}
	same, differ, added := compareReadings(before, after)
	if want := []string{"page /api/overview"}; !reflect.DeepEqual(same, want) {
		t.Errorf("same = %q, want %q", same, want)
	}
	if want := []string{"view inbox_overview: dead: before 6, after 7", "view gone: only before"}; !reflect.DeepEqual(differ, want) {
		t.Errorf("differ = %q, want %q", differ, want)
	}
	if want := []string{"view inbox_key_ledger", "view inbox_overview: new_column"}; !reflect.DeepEqual(added, want) {
		t.Errorf("added = %q, want %q", added, want)
	}
}

func TestFlattenLeavesOutWhenAndSumsPerMinute(t *testing.T) {
	var doc any
	if err := json.Unmarshal([]byte(`{
		"read_at": "2026-12-03T15:00:00Z",
		"service": {"build": "abc"},
		"inbox": {"pending": 1, "oldest_pending_seconds": 3.5, "processed_last_minute": 9},
		"throughput": [{"minute": "x", "processed": 2, "dead": 1}, {"minute": "y", "processed": 3, "dead": 0}],
		"dead": [{"message_id": "b", "died_at": "t", "attempts": 1}, {"message_id": "a", "died_at": "u", "attempts": 2}],
		"held_back": []
	}`), &doc); err != nil {
		t.Fatal(err)
	}
	rd := reading{}
	flatten(rd, "", doc)
	want := reading{
		"inbox.pending":          {"1"},
		"throughput[].processed": {"5"},
		"throughput[].dead":      {"1"},
		"dead[]":                 {"attempts=1 message_id=b", "attempts=2 message_id=a"},
		"held_back[]":            {},
	}
	if !reflect.DeepEqual(rd, want) {
		t.Errorf("flatten = %q, want %q", rd, want)
	}
}

func TestWhenNotWhatGoesByWholeWords(t *testing.T) {
	for field, want := range map[string]bool{
		"message_id": false, "message_type": false, "attempts": false, "messages": false, "waiting_retry": false,
		"read_at": true, "oldest_age": true, "processed_last_minute": true, "per_second_last_5_minutes": true,
		"failed_attempts_last_5_minutes": true, "inboxd_inbox_oldest_pending_age_seconds": true, "id": true, "build": true,
	} {
		if got := whenNotWhat(field); got != want {
			t.Errorf("whenNotWhat(%q) = %v, want %v", field, got, want)
		}
	}
}

func TestCurrentMetricNameReadsAnEarlierBuildsNames(t *testing.T) {
	for name, want := range map[string]string{
		"inbox_pending":                  "inboxd_inbox_pending",
		"outbox_backlog":                 "inboxd_outbox_backlog",
		"stock_unfolded_age_seconds":     "inboxd_stock_unfolded_age_seconds",
		"inboxd_inbox_pending":           "inboxd_inbox_pending",
		"inboxd_events_unroutable":       "inboxd_events_unroutable",
		"inbox_database_gauges_exporter": "inboxd_inbox_database_gauges_exporter",
	} {
		if got := currentMetricName(name); got != want {
			t.Errorf("currentMetricName(%q) = %q, want %q", name, got, want)
		}
	}
}
