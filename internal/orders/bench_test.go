package orders_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/inbox"
	"github.com/orderconfirm/inboxd/internal/loadgen"
	"github.com/orderconfirm/inboxd/internal/orders"
	"github.com/orderconfirm/inboxd/internal/testenv"
)

// BenchmarkWorkerBatch times one work batch of the orders handler, as a
// worker claim goroutine runs it: the claim, the transaction that locks the
// rows, reserves two SKUs' stock per order, writes the outbox and records
// the outcomes, and its commit. The messages are stored outside the timer.
// At 1,000 orders/s the batches hold about ten orders; one is the batch of
// a quiet hour. Its figure is the latency a batch adds once it is
// claimed, most of it round trips at small batches.
//
//	go test -run '^$' -bench BenchmarkWorkerBatch -benchtime 2000x ./internal/orders/
func BenchmarkWorkerBatch(b *testing.B) {
	for _, size := range []int{1, 10} {
		b.Run(fmt.Sprintf("orders=%d", size), func(b *testing.B) {
			db := testenv.NewDB(b)
			(&handlerBundle{db: db}).setStock(b, map[string]int{"SKU-1": 1 << 30, "SKU-2": 1 << 30})
			w, err := inbox.NewWorker(db.Pool, &inbox.WorkerConfig{
				Handler: orders.NewHandler(testenv.Logger(b)), Logger: testenv.Logger(b), BatchSize: size,
			})
			require.NoError(b, err)
			ids, types, payloads, keys := make([]string, size), make([]string, size), make([][]byte, size), make([]string, size)
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				for j := range size {
					order := fmt.Sprintf("o-%d-%d", i, j)
					ids[j], types[j], payloads[j], keys[j] = "m-"+order, orders.TypeOrderCreated, loadgen.OrderCreatedBody(order, 2), order
				}
				_, err := db.Pool.Exec(b.Context(), `
					INSERT INTO inbox (message_id, message_type, payload, order_key)
					SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[])`, ids, types, payloads, keys)
				require.NoError(b, err)
				b.StartTimer()
				n, err := w.RunOnce(b.Context())
				require.NoError(b, err)
				require.Equal(b, size, n)
			}
		})
	}
}
