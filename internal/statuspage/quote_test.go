package statuspage

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/testenv"
)

// The replay statements the page offers for copying read as the text they
// quote, whatever the session's standard_conforming_strings, and each
// literal is the one PostgreSQL's quote_literal builds.
func TestQuoteIsQuoteLiteral(t *testing.T) {
	t.Parallel()
	db := testenv.NewDB(t)
	conn := db.Session(t)
	ctx := context.WithoutCancel(t.Context())
	for _, s := range []string{"", "plain", "it's", `C:\path\n`, `a\'; DROP TABLE inbox; --`, `\\`, `'\`, "ünïcode ✓"} {
		var want string
		require.NoError(t, conn.QueryRow(ctx, "SELECT quote_literal($1::text)", s).Scan(&want))
		require.Equal(t, want, quote(s), "%q", s)
		for _, conforming := range []string{"on", "off"} {
			// The statement as an operator's psql sends it: text parsed under
			// the session's setting (pgx itself refuses to run with it off).
			results, err := conn.PgConn().Exec(ctx, "SET standard_conforming_strings = "+conforming+"; SELECT "+quote(s)).ReadAll()
			require.NoError(t, err)
			require.Equal(t, s, string(results[1].Rows[0][0]), "%q with standard_conforming_strings %s", s, conforming)
		}
	}
}
