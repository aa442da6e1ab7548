package orders

import (
	"slices"
	"sync"
	"time"
)

// heldRows remembers rows found held by another session past
// StockLockWait, for StockHeldMemory, by key (a SKU). A batch
// only probes them instead of waiting for them again: a batch that waited
// would hold its other rows meanwhile, delay the other messages of its
// batch by the wait each time it is retried, and make the batches of the
// other workers wait in turn.
type heldRows struct {
	mu    sync.Mutex
	found map[string]time.Time // when each was found held
}

// split splits keys into those found held within StockHeldMemory, to
// probe, and the rest, to wait for.
func (r *heldRows) split(keys []string) (probe, wait []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, k := range keys {
		if found, ok := r.found[k]; ok && time.Since(found) < StockHeldMemory {
			probe = append(probe, k)
		} else {
			wait = append(wait, k)
		}
	}
	return probe, wait
}

// remember records the outcome of locking keys, of which wait were waited
// for: those in held that were waited for are remembered as found held
// now (a probe that finds a row held again does not extend its memory, so
// it is waited for again soon), and the others forgotten.
func (r *heldRows) remember(keys, wait []string, held map[string]bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.found == nil {
		r.found = map[string]time.Time{}
	}
	for _, k := range keys {
		switch {
		case !held[k]:
			delete(r.found, k)
		case slices.Contains(wait, k):
			r.found[k] = time.Now()
		}
	}
}
