package main

import "runtime/debug"

// version names this build of inboxd. Release builds set it at link time:
//
//	go build -ldflags "-X main.version=v1.4.0" ./cmd/inboxd
var version string

// buildName returns the name of this build, recorded with every handling
// attempt (inbox_attempts.build) and exported as inboxd_build_info: the
// link-time version, else the version Go stamped from version control, else
// the commit, else "unknown".
func buildName() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var revision, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			revision = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if revision == "" {
		return "unknown"
	}
	if len(revision) > 12 {
		revision = revision[:12]
	}
	if modified == "true" {
		revision += "+dirty"
	}
	return revision
}
