package inboxd_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/doctable"
)

// notInTheTree are the top-level directories the repository ignores
// (.gitignore): built tools and scratch space, never committed.
var notInTheTree = []string{".git", "bin", "tmp"}

// docs/layout.md's Layout table names only paths that exist, and lists
// every top-level directory (by itself or by a path under it), every
// directory of cmd/, internal/, deploy/, api/ and examples/, every Go
// package under cmd/, internal/, examples/ and api/, and migrations/.
func TestLayoutTableMatchesTheTree(t *testing.T) {
	t.Parallel()
	root := doctable.Root(t)
	var listed []string
	for _, cells := range doctable.Table(t, "layout.md", "layout", 2) {
		paths := doctable.Backquoted(cells[0])
		require.NotEmpty(t, paths, "a row of docs/layout.md's Layout table names a path: %s", cells[0])
		for _, p := range paths {
			p = strings.TrimSuffix(p, "/")
			_, err := os.Stat(filepath.Join(root, filepath.FromSlash(p)))
			require.NoError(t, err, "docs/layout.md's Layout table names %s", p)
			listed = append(listed, p)
		}
	}

	var missing []string
	need := func(dir string) {
		if !slices.Contains(listed, dir) && !slices.Contains(missing, dir) {
			missing = append(missing, dir)
		}
	}
	top, err := os.ReadDir(root)
	require.NoError(t, err)
	for _, e := range top {
		if !e.IsDir() || slices.Contains(notInTheTree, e.Name()) {
			continue
		}
		if !slices.ContainsFunc(listed, func(p string) bool { return p == e.Name() || strings.HasPrefix(p, e.Name()+"/") }) {
			missing = append(missing, e.Name())
		}
	}
	need("migrations")
	for _, parent := range []string{"cmd", "internal", "deploy", "api", "examples"} {
		entries, err := os.ReadDir(filepath.Join(root, parent))
		require.NoError(t, err)
		for _, e := range entries {
			if e.IsDir() {
				need(parent + "/" + e.Name())
			}
		}
	}
	for _, parent := range []string{"cmd", "internal", "examples", "api"} {
		err := filepath.WalkDir(filepath.Join(root, parent), func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || filepath.Ext(path) != ".go" {
				return err
			}
			dir, err := filepath.Rel(root, filepath.Dir(path))
			if err == nil && dir != parent {
				need(filepath.ToSlash(dir))
			}
			return err
		})
		require.NoError(t, err)
	}
	slices.Sort(missing)
	require.Empty(t, missing, "directories docs/layout.md's Layout table does not list")
}
