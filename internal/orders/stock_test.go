package orders

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

func TestDecideStock(t *testing.T) {
	t.Parallel()
	order := func(id string, items ...Item) OrderCreated { return OrderCreated{OrderID: id, Items: items} }

	t.Run("InOrderAllOrNothing", func(t *testing.T) {
		t.Parallel()
		available := map[string]int32{"A": 5, "B": 1}
		d := decideStock([]OrderCreated{
			order("o-1", Item{SKU: "B", Quantity: 1}, Item{SKU: "A", Quantity: 2}, Item{SKU: "A", Quantity: 1}),
			order("o-2", Item{SKU: "A", Quantity: 2}, Item{SKU: "B", Quantity: 1}), // B is gone: takes no A either
			order("o-3", Item{SKU: "A", Quantity: 2}),
			order("o-4", Item{SKU: "Z", Quantity: 1}, Item{SKU: "A", Quantity: 9}, Item{SKU: "Y", Quantity: 1}),
		}, available)
		require.Equal(t, []string{"", "insufficient stock: B", "", "unknown sku: Y,Z"}, d.reasons)
		require.Equal(t, dbsqlc.StockReservationInsertManyParams{
			OrderIds: []string{"o-1", "o-1", "o-3"}, Skus: []string{"A", "B", "A"}, Quantities: []int32{3, 1, 2},
		}, d.reservations)
		require.Equal(t, dbsqlc.StockTakeManyParams{Skus: []string{"A", "B"}, Quantities: []int32{5, 1}}, d.take)
		require.Equal(t, dbsqlc.OrderConfirmationRejectManyParams{
			OrderIds: []string{"o-2", "o-4"}, Reasons: []string{"insufficient stock: B", "unknown sku: Y,Z"},
		}, d.reject)
		require.Equal(t, map[string]int32{"A": 5, "B": 1}, available, "the levels it was given are left as they were")
	})

	t.Run("NothingReserved", func(t *testing.T) {
		t.Parallel()
		d := decideStock([]OrderCreated{order("o-1", Item{SKU: "A", Quantity: 1})}, map[string]int32{"A": 0})
		require.Equal(t, []string{"insufficient stock: A"}, d.reasons)
		require.Empty(t, d.reservations.OrderIds)
		require.Empty(t, d.take.Skus)
	})
}
