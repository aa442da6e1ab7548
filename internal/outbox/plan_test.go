package outbox

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// TestPlan runs each plan round by round as publish does, with the rows in
// failed not confirmed, and checks which rows went out in which round and
// which were held back.
func TestPlan(t *testing.T) {
	type row struct {
		id    int64
		order string
	}
	for _, tc := range []struct {
		name   string
		rows   []row // as the claim returns them: in no set order
		failed []int64
		rounds [][]int64 // the ids published in each round, in order
		held   []int64
	}{{
		name: "empty batch",
	}, {
		name:   "rows of no order go out together, in id order",
		rows:   []row{{3, ""}, {1, ""}, {2, ""}},
		rounds: [][]int64{{1, 2, 3}},
	}, {
		name:   "one order with many rows: one round each, in id order",
		rows:   []row{{14, "a"}, {10, "a"}, {13, "a"}, {11, "a"}, {12, "a"}},
		rounds: [][]int64{{10}, {11}, {12}, {13}, {14}},
	}, {
		name:   "interleaved orders: each order's first rows together, then its next",
		rows:   []row{{6, "a"}, {2, "b"}, {1, "a"}, {5, "b"}, {4, "a"}, {3, "c"}, {7, ""}},
		rounds: [][]int64{{1, 2, 3, 7}, {4, 5}, {6}},
	}, {
		name:   "a row not confirmed holds back every later row of its order",
		rows:   []row{{1, "a"}, {2, "b"}, {3, "a"}, {4, "b"}, {5, "a"}, {6, "b"}},
		failed: []int64{1},
		rounds: [][]int64{{1, 2}, {4}, {6}},
		held:   []int64{3, 5},
	}, {
		name:   "a row not confirmed later in its order holds back only the rows after it",
		rows:   []row{{1, "a"}, {2, "a"}, {3, "a"}, {4, "a"}},
		failed: []int64{2},
		rounds: [][]int64{{1}, {2}, nil, nil},
		held:   []int64{3, 4},
	}, {
		name:   "a row of no order not confirmed holds back nothing",
		rows:   []row{{1, ""}, {2, "a"}, {3, ""}, {4, "a"}},
		failed: []int64{1, 3},
		rounds: [][]int64{{1, 2, 3}, {4}},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			var claimed []dbsqlc.OutboxClaimBatchRow
			for _, r := range tc.rows {
				claimed = append(claimed, dbsqlc.OutboxClaimBatchRow{ID: r.id, OrderKey: r.order})
			}
			before := append([]dbsqlc.OutboxClaimBatchRow(nil), claimed...)
			p := planBatch(claimed)
			require.Equal(t, before, claimed, "the plan leaves the claimed rows as they are")

			var rounds [][]int64
			for n := range p.rounds {
				var ids []int64
				for _, row := range p.due(n) {
					ids = append(ids, row.ID)
					row.confirmed = !slices.Contains(tc.failed, row.ID)
				}
				rounds = append(rounds, ids)
			}
			require.Equal(t, tc.rounds, rounds, "rows published in each round")

			var held, all []int64
			for _, row := range p.rows {
				all = append(all, row.ID)
				if row.heldBack() {
					held = append(held, row.ID)
				}
			}
			require.Equal(t, tc.held, held, "rows held back")
			require.IsNonDecreasing(t, all, "every row, in id order")
			require.Len(t, p.traces(), len(tc.rows))
		})
	}
}
