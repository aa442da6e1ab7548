// Package inboxd_test holds checks of the repository as a whole.
package inboxd_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// sqlcPath finds the pinned sqlc: $SQLC (set by `make test`), else bin/sqlc.
func sqlcPath(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("SQLC"); p != "" {
		return p
	}
	p, err := filepath.Abs(filepath.Join("bin", "sqlc"))
	require.NoError(t, err)
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("the pinned sqlc is not at %s: `make test` builds it, or run `make tools` (or set SQLC)", p)
	}
	return p
}

// copyRepo copies the repository's sources (not .git or bin) to a new
// directory.
func copyRepo(t *testing.T) string {
	t.Helper()
	dst := t.TempDir()
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (path == ".git" || path == "bin") {
			return filepath.SkipDir
		}
		target := filepath.Join(dst, path)
		if d.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o644)
	})
	require.NoError(t, err)
	return dst
}

// replaceIn replaces the first old in the file at path with new, and fails
// the test if old is not there.
func replaceIn(t *testing.T, path, old, new string) {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Contains(t, string(b), old)
	require.NoError(t, os.WriteFile(path, []byte(strings.Replace(string(b), old, new, 1)), 0o644))
}

func makeVerify(t *testing.T, dir, sqlc string) (string, error) {
	t.Helper()
	cmd := exec.Command("make", "--no-print-directory", "verify", "SQLC="+sqlc)
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// `make verify` passes on the repository as committed, and fails as soon as
// a query or a migration changes without `make generate`.
func TestMakeVerifyCatchesStaleGeneratedCode(t *testing.T) {
	t.Parallel()
	sqlc := sqlcPath(t)

	t.Run("Fresh", func(t *testing.T) {
		t.Parallel()
		out, err := makeVerify(t, copyRepo(t), sqlc)
		require.NoError(t, err, out)
	})

	t.Run("QueryChanged", func(t *testing.T) {
		t.Parallel()
		dir := copyRepo(t)
		replaceIn(t, filepath.Join(dir, "queries", "inbox.sql"), "false AS another_user, 0::bigint AS request_id FROM stored", "false AS from_another_user, 0::bigint AS request_id FROM stored")
		out, err := makeVerify(t, dir, sqlc)
		require.Error(t, err, "make verify passed with a stale query:\n%s", out)
	})

	t.Run("QueryAdded", func(t *testing.T) {
		t.Parallel()
		dir := copyRepo(t)
		f, err := os.OpenFile(filepath.Join(dir, "queries", "inbox.sql"), os.O_APPEND|os.O_WRONLY, 0)
		require.NoError(t, err)
		_, err = f.WriteString("\n-- name: InboxCount :one\nSELECT count(*) FROM inbox;\n")
		require.NoError(t, err)
		require.NoError(t, f.Close())
		out, err := makeVerify(t, dir, sqlc)
		require.Error(t, err, "make verify passed with a new query:\n%s", out)
	})

	t.Run("MigrationChanged", func(t *testing.T) {
		t.Parallel()
		dir := copyRepo(t)
		replaceIn(t, filepath.Join(dir, "migrations", "00001_inbox.sql"), "    attempts         integer ", "    attempts         bigint  ")
		out, err := makeVerify(t, dir, sqlc)
		require.Error(t, err, "make verify passed with a changed migration:\n%s", out)
	})
}
