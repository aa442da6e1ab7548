package main

import "runtime/debug"

// version names this build of inboxd. Release builds set it at link time:
//
//	go build -ldflags "-X main.version=v1.4.0" ./cmd/inboxd
var version string

// buildName returns the name of this build, recorded with every handling
// attempt (inbox_attempts.build) and exported as inboxd_build_info: the
// link-time version, else what Go stamped into the binary (see
// buildNameFrom).
func buildName() string {
	if version != "" {
		return version
	}
	bi, _ := debug.ReadBuildInfo()
	return buildNameFrom(bi)
}

// revisionLength is how much of a commit hash a build name keeps: as much as
// git's short hashes in a large repository, and enough to be unique.
const revisionLength = 12

// buildNameFrom names the build bi describes: the commit it was built from
// (vcs.revision, shortened, with "-dirty" when the tree had changes), else
// the module's version unless it is "(devel)", else "unknown". bi may be
// nil (a binary built without module support).
func buildNameFrom(bi *debug.BuildInfo) string {
	if bi == nil {
		return "unknown"
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
	if revision != "" {
		revision = revision[:min(len(revision), revisionLength)]
		if modified == "true" {
			revision += "-dirty"
		}
		return revision
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	return "unknown"
}
