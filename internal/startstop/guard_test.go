package startstop_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Every goroutine the service starts goes through Go or Guard, so that its
// panic is logged through inboxd's redactor (see SetPanicHandler): no bare
// go statement and no WaitGroup.Go of an unguarded function in the
// service's code.
func TestEveryGoroutineIsGuarded(t *testing.T) {
	t.Parallel()
	bare := regexp.MustCompile(`(^|[\s;{])go (func|[A-Za-z_.]+\()|\.Go\(func\(`)
	var found []string
	for _, root := range []string{"../../internal", "../../cmd/inboxd"} {
		err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			switch filepath.Base(filepath.Dir(path)) {
			case "testenv", "loadgen", "startstop": // test harness, and the guard itself
				return nil
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for n, line := range strings.Split(string(src), "\n") {
				code, _, _ := strings.Cut(line, "//")
				if bare.MatchString(strings.ReplaceAll(code, "startstop.Go(", "")) {
					found = append(found, path+":"+strconv.Itoa(n+1)+": "+strings.TrimSpace(line))
				}
			}
			return nil
		})
		require.NoError(t, err)
	}
	require.Empty(t, found, "goroutines started without startstop.Go or startstop.Guard")
}
