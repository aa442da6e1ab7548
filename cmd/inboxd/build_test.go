package main

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestBuildNameFrom(t *testing.T) {
	const commit = "0123456789abcdef0123456789abcdef01234567"
	vcs := func(modified string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: commit}, {Key: "vcs.modified", Value: modified}}
	}
	for _, tc := range []struct {
		name string
		bi   *debug.BuildInfo
		want string
	}{
		{"no build info", nil, "unknown"},
		{"a clean tree", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs("false")}, "0123456789ab"},
		{"a tree with changes", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: vcs("true")}, "0123456789ab-dirty"},
		{"the commit before the module version", &debug.BuildInfo{Main: debug.Module{Version: "v1.4.0"}, Settings: vcs("false")}, "0123456789ab"},
		{"a short revision", &debug.BuildInfo{Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}}}, "abc"},
		{"go install of a version", &debug.BuildInfo{Main: debug.Module{Version: "v1.4.0"}}, "v1.4.0"},
		{"no version control", &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}, "unknown"},
		{"no version at all", &debug.BuildInfo{}, "unknown"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, buildNameFrom(tc.bi))
		})
	}
}
