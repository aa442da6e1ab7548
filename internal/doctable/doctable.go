// Package doctable reads the tables of docs/ that tests hold the code to:
// a table between "<!-- name: begin -->" and "<!-- name: end -->" markers,
// its rows as cells, and the names a cell gives in backquotes.
package doctable

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Root returns the repository's root: the nearest directory holding go.mod
// at or above the working directory (a package's directory under go test).
func Root(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		require.NotEqual(t, dir, parent, "no go.mod above the working directory")
		dir = parent
	}
}

// Table returns the cells of each row of the table between docs/doc's
// "<!-- name: begin -->" and "<!-- name: end -->" markers, after its header
// and separator rows, and fails the test unless every row has columns
// cells.
func Table(t testing.TB, doc, name string, columns int) [][]string {
	t.Helper()
	text, err := os.ReadFile(filepath.Join(Root(t), "docs", doc))
	require.NoError(t, err)
	_, rest, ok := strings.Cut(string(text), "<!-- "+name+": begin -->\n")
	require.True(t, ok, "docs/%s has the %s table's begin marker", doc, name)
	table, _, ok := strings.Cut(rest, "<!-- "+name+": end -->")
	require.True(t, ok, "docs/%s has the %s table's end marker", doc, name)
	lines := strings.Split(strings.TrimSpace(table), "\n")
	require.Greater(t, len(lines), 2, "docs/%s's %s table has rows", doc, name)
	var rows [][]string
	for _, line := range lines[2:] {
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		require.Len(t, cells, columns, "a row of the %s table in docs/%s: %s", name, doc, line)
		rows = append(rows, cells)
	}
	return rows
}

var backquotes = regexp.MustCompile("`([^`]+)`")

// Backquoted returns the names a table cell gives in backquotes.
func Backquoted(cell string) []string {
	var names []string
	for _, m := range backquotes.FindAllStringSubmatch(cell, -1) {
		names = append(names, m[1])
	}
	return names
}
