package orders

import (
	"maps"
	"slices"
	"strings"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// stockDecision is what reserving a batch of orders comes to: for each
// order the reason it is rejected ("" when its stock is reserved), and the
// rows that store that.
type stockDecision struct {
	reasons      []string
	reservations dbsqlc.StockReservationInsertManyParams
	take         dbsqlc.StockTakeManyParams
	reject       dbsqlc.OrderConfirmationRejectManyParams
}

// decideStock decides, in order and all or nothing per order, which orders
// reserve their stock out of available (by SKU) and which are rejected, and
// why: an unknown SKU before a short one, each list in SKU order. Every
// order sees the stock the orders before it left. It is pure: available is
// not changed.
func decideStock(orders []OrderCreated, available map[string]int32) stockDecision {
	available = maps.Clone(available)
	d := stockDecision{reasons: make([]string, len(orders))}
	taken := map[string]int32{}
	for i, o := range orders {
		want := map[string]int32{}
		for _, it := range o.Items {
			want[it.SKU] += int32(it.Quantity)
		}
		var unknown, short []string
		for _, sku := range slices.Sorted(maps.Keys(want)) {
			have, known := available[sku]
			switch {
			case !known:
				unknown = append(unknown, sku)
			case have < want[sku]:
				short = append(short, sku)
			}
		}
		switch {
		case len(unknown) > 0:
			d.reasons[i] = "unknown sku: " + strings.Join(unknown, ",")
		case len(short) > 0:
			d.reasons[i] = "insufficient stock: " + strings.Join(short, ",")
		}
		if d.reasons[i] != "" {
			d.reject.OrderIds = append(d.reject.OrderIds, o.OrderID)
			d.reject.Reasons = append(d.reject.Reasons, d.reasons[i])
			continue
		}
		for _, sku := range slices.Sorted(maps.Keys(want)) {
			available[sku] -= want[sku]
			taken[sku] += want[sku]
			d.reservations.OrderIds = append(d.reservations.OrderIds, o.OrderID)
			d.reservations.Skus = append(d.reservations.Skus, sku)
			d.reservations.Quantities = append(d.reservations.Quantities, want[sku])
		}
	}
	for _, sku := range slices.Sorted(maps.Keys(taken)) {
		d.take.Skus = append(d.take.Skus, sku)
		d.take.Quantities = append(d.take.Quantities, taken[sku])
	}
	return d
}
