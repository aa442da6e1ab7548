// Package migrations embeds the goose SQL migrations that define the service's schema.
//
// The files live here, next to the embed directive, because go:embed cannot reach
// parent directories. sqlc reads the same files (see sqlc.yaml) and ignores the
// goose Down sections.
package migrations

import "embed"

// FS holds every migration file, applied in version order by goose.
//
//go:embed *.sql
var FS embed.FS
