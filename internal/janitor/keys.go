package janitor

// The key ledger's state machine: rotating its generations, sealing,
// merging and emptying its hot parts. migrations/00004_inbox_keys.sql
// describes the ledger (its slots and hot parts, what each state means and
// why), the locks every writer of keys takes, and the triggers that make
// every insert into the inbox checked and remembered; this file drives the
// states from one place, the leader's janitor (RunOnce). Each step is one
// transaction of the statements in queries/janitor.sql (JanitorKeys*), so a
// step interrupted anywhere (its connection killed, its lock wait given up)
// leaves the state rows as they were, and the next call goes on from them.
//
// Locking, in the order each step takes its locks:
//
//   - a rotation or a seal takes inbox_key_generations' SHARE ROW EXCLUSIVE
//     lock first: one of them at a time, and each reads the state after
//     the last one committed;
//   - a rotation truncates the next slot before it takes the remembering
//     lock: the TRUNCATE waits for the statements that read the slot (every
//     insert into the inbox reads every partition), so once it has the slot
//     no insert that holds the remembering lock is still running to wait
//     for the rotation in turn;
//   - then the remembering lock held exclusively (inbox_key_hot_parts'
//     SHARE lock), which waits for the transactions writing keys and holds
//     up new ones, before the part writing is sealed: no transaction still
//     writes a part that is sealed or a generation that is closed;
//   - a merge and an emptying each lock their part's row (FOR UPDATE SKIP
//     LOCKED), which a stricter inserter's check locks too (FOR SHARE), and
//     take no table lock beyond their statements' own.
//
// A rotation, a seal and an emptying give up after lockWait (the
// transaction's lock_timeout from its first statement on), to be tried
// again at the next cleanup, rather than hold up ingest behind a
// long-running reader.

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/orderconfirm/inboxd/internal/dbsqlc"
)

// Defaults of the key ledger's steps, as the janitor runs them.
const (
	// KeysLockWaitDefault is how long a rotation, a seal or an emptying
	// waits for its locks before it gives up.
	KeysLockWaitDefault = 100 * time.Millisecond
	// SealRatioDefault: the part writing is sealed once it holds an eighth
	// as many keys as its slot.
	SealRatioDefault = 8
	// SealMinBytesDefault is the least size of a part that is sealed.
	SealMinBytesDefault = 16 << 20
)

// KeysDB is what the key ledger's steps run on, each in a transaction of
// its own: a pool or a connection.
type KeysDB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// The ledger's partitions: slots 0 to 7, hot parts 8 and 9.
const (
	keySlots      = 8
	keyPartitions = 10
)

// keysPartition is the name of partition n of inbox_keys (a slot, 0 to 7,
// or a hot part, 8 or 9), quoted, for a statement that cannot take it as a
// parameter. It is not qualified: the session's search_path finds it, as it
// finds every table the service names.
func keysPartition(n int16) (string, error) {
	if n < 0 || n >= keyPartitions {
		return "", fmt.Errorf("key ledger: no partition %d", n)
	}
	return pgx.Identifier{"inbox_keys_" + strconv.Itoa(int(n))}.Sanitize(), nil
}

// truncateKeys empties partition n of the ledger, in tx. TRUNCATE waits
// for the statements reading the partition (up to the lock wait), and is
// not MVCC-safe: a stricter writer or checker that locked the state rows
// the step changes fails rather than miss the keys (see the migration).
func truncateKeys(ctx context.Context, tx pgx.Tx, n int16) error {
	name, err := keysPartition(n)
	if err != nil {
		return err
	}
	_, err = tx.Exec(ctx, "TRUNCATE "+name)
	return err
}

// lockWaitMillis is lockWait as lock_timeout takes it: 0 waits for ever,
// so a wait under a millisecond is one.
func lockWaitMillis(lockWait time.Duration) int64 {
	if lockWait > 0 && lockWait < time.Millisecond {
		return 1
	}
	return lockWait.Milliseconds()
}

// handOverKeys seals the part writing, for fromSlot, the slot of the
// generation its keys were written in, and makes the other part, which
// must be empty, write for toSlot. Only in a seal or a rotation, under the
// remembering lock held exclusively.
func handOverKeys(ctx context.Context, q *dbsqlc.Queries, tx pgx.Tx, fromSlot, toSlot int16) error {
	if err := q.JanitorKeysSealWriting(ctx, tx, fromSlot); err != nil {
		return fmt.Errorf("seal the hot part writing: %w", err)
	}
	n, err := q.JanitorKeysStartWriting(ctx, tx, toSlot)
	if err != nil {
		return fmt.Errorf("start the empty hot part writing: %w", err)
	}
	if n == 0 {
		return errors.New("key ledger: no empty hot part to write")
	}
	return nil
}

// RotateKeys opens the ledger's next generation once the current one has
// lasted a seventh of window, and returns its number; else 0, to be tried
// again. The next slot is emptied first, once every key in it has been
// remembered for window since its generation closed: a key is remembered
// from its commit for at least window, and at most window plus a seventh
// of it (plus however late the rotation runs). The part the closing
// generation wrote is sealed, to be merged into its slot, and the other
// part writes for the new one; so it waits (returns 0) while that other
// part still holds keys not yet emptied.
//
// Emptying the slot waits for the statements that read it (every insert
// into the inbox reads all slots), then the remembering lock for the
// transactions writing keys; new inserts wait behind both until it
// commits. lockWait bounds that pause: a rotation that cannot have its
// locks in time fails (lock_not_available), to be tried again. Any number
// of callers may run it at once; one rotates.
//
// now is the clock the generations' ages are measured against and their
// opening and closing recorded with; nil, as the service passes it, is
// the database's (clock_timestamp()). A test sets it forward.
func RotateKeys(ctx context.Context, db KeysDB, window, lockWait time.Duration, now *time.Time) (int64, error) {
	if window <= 0 {
		return 0, fmt.Errorf("key ledger rotation: the dedupe window must be positive, got %s", window)
	}
	q := dbsqlc.New()
	var opened int64
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := q.JanitorKeysLockWait(ctx, tx, lockWaitMillis(lockWait)); err != nil {
			return err
		}
		if err := q.JanitorKeysLockGenerations(ctx, tx); err != nil {
			return err
		}
		cur, err := q.JanitorKeysCurrent(ctx, tx, dbsqlc.JanitorKeysCurrentParams{Now: now, DedupeWindowSeconds: window.Seconds()})
		if err != nil {
			return fmt.Errorf("read the current generation: %w", err)
		}
		if !cur.Due || !cur.PartEmpty || !cur.SlotFree {
			// Not yet; or the sealed part is merged and emptied first; or
			// a longer window than before still holds the next slot's keys.
			return nil
		}
		next := (cur.Slot + 1) % keySlots
		// The slot first: once it is ours, no insert that read it is still
		// running, so none holds the remembering lock and waits for us.
		if err := truncateKeys(ctx, tx, next); err != nil {
			return fmt.Errorf("empty slot %d: %w", next, err)
		}
		if err := q.JanitorKeysLockRemembering(ctx, tx); err != nil {
			return err
		}
		if err := handOverKeys(ctx, q, tx, cur.Slot, next); err != nil {
			return err
		}
		switch n, err := q.JanitorKeysClose(ctx, tx, dbsqlc.JanitorKeysCloseParams{Now: now, Generation: cur.Generation}); {
		case err != nil:
			return fmt.Errorf("close generation %d: %w", cur.Generation, err)
		case n != 1:
			return fmt.Errorf("key ledger: generation %d was not open", cur.Generation)
		}
		if err := q.JanitorKeysOpen(ctx, tx, dbsqlc.JanitorKeysOpenParams{Generation: cur.Generation + 1, Slot: next, Now: now}); err != nil {
			return fmt.Errorf("open generation %d: %w", cur.Generation+1, err)
		}
		opened = cur.Generation + 1
		return nil
	})
	if err != nil {
		return 0, err
	}
	return opened, nil
}

// SealKeys seals the part writing once it holds 1/ratio as many keys as
// its slot, and at least minBytes, if the other part is empty; it reports
// whether it did. Sizes are read from the tables' files: it counts
// nothing. A page of a slot's hash index holds about 240 keys, so a merge
// brings about 30 to each page it changes; the hot part's own index stays
// an eighth of the slot's. Like a rotation it waits for the transactions
// writing keys, holding up new inserts meanwhile, and gives up after
// lockWait.
func SealKeys(ctx context.Context, db KeysDB, ratio int, minBytes int64, lockWait time.Duration) (bool, error) {
	if ratio < 1 {
		return false, fmt.Errorf("key ledger seal: the ratio must be at least 1, got %d", ratio)
	}
	q := dbsqlc.New()
	sealed := false
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := q.JanitorKeysLockWait(ctx, tx, lockWaitMillis(lockWait)); err != nil {
			return err
		}
		// One seal or rotation at a time.
		if err := q.JanitorKeysLockGenerations(ctx, tx); err != nil {
			return err
		}
		w, err := q.JanitorKeysWriting(ctx, tx)
		if err != nil {
			return fmt.Errorf("read the hot part writing: %w", err)
		}
		if w.OtherHeld || w.PartBytes < max(minBytes, 1) || w.PartBytes*int64(ratio) < w.SlotBytes {
			return nil
		}
		if err := q.JanitorKeysLockRemembering(ctx, tx); err != nil {
			return err
		}
		if err := handOverKeys(ctx, q, tx, w.CurrentSlot, w.CurrentSlot); err != nil {
			return err
		}
		sealed = true
		return nil
	})
	if err != nil {
		return false, err
	}
	return sealed, nil
}

// keyBuckets returns the mask of hashtext(message_id) a part is merged by:
// as many buckets as the slot's index has pages (slotIndexPages), rounded
// down to a power of two, so that the copy visits the index's buckets in
// one pass, each page changed once; and at least as many as the part has
// ranges; between 2 and 2^30.
func keyBuckets(slotIndexPages, ranges int64) int32 {
	byPages := bits.Len64(uint64(max(slotIndexPages, 2))) - 1 // floor(log2)
	byRanges := bits.Len64(uint64(max(ranges, 1) - 1))        // ceil(log2)
	return int32(1)<<min(30, max(1, byPages, byRanges)) - 1
}

// MergeKeys copies the keys of the next range of hash buckets of a sealed
// part into their slot, in bucket order, and marks the part merged once
// the last range is copied. It returns how many keys it copied, and false
// if no part is sealed (or another session is merging it); the caller
// calls it until then, each call its own transaction.
//
// A bucket is the low bits of the key's hash (hashtext), as many as the
// slot's index has pages when the merge starts (keyBuckets). The mask is
// chosen at the first call and kept (merge_mask), and how far the merge
// has gone with it (merged_buckets): a range holds about maxBytes of the
// part's heap (64 MB: some 900,000 keys, seconds). In ranges because a
// whole part at the end of a generation (4.8 M keys, 20 to 35 s) would
// outlast the service's 30 s statement_timeout: the part would stay
// sealed, and no seal or rotation could follow. Each call reads the whole
// part to find its range. A range's copy and the record of it commit
// together: a merge interrupted goes on from the last range committed.
//
// It holds up no one but a stricter inserter, whose check waits for the
// range in progress and then fails, to be tried again.
func MergeKeys(ctx context.Context, db KeysDB, maxBytes int64) (copied int64, merging bool, err error) {
	if maxBytes < 1 {
		return 0, false, fmt.Errorf("key ledger merge: maxBytes must be at least 1, got %d", maxBytes)
	}
	q := dbsqlc.New()
	err = pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		p, err := q.JanitorKeysTakeSealed(ctx, tx)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("take the sealed hot part: %w", err)
		}
		// The part no longer changes: the same ranges at every call.
		ranges := max(1, (p.PartBytes+maxBytes-1)/maxBytes)
		mask := p.MergeMask.Int32
		if !p.MergeMask.Valid {
			mask = keyBuckets(p.SlotIndexPages, ranges)
		}
		buckets := int64(mask) + 1
		lo := int64(p.MergedBuckets)
		hi := min(buckets, lo+(buckets+ranges-1)/ranges)
		if err := q.JanitorKeysMergeMemory(ctx, tx); err != nil {
			return err
		}
		n, err := q.JanitorKeysMergeRange(ctx, tx, dbsqlc.JanitorKeysMergeRangeParams{
			Slot: p.Slot, Part: p.Part, Mask: mask, Lo: lo, Hi: hi,
		})
		if err != nil {
			return fmt.Errorf("copy buckets %d to %d of part %d into slot %d: %w", lo, hi, p.Part, p.Slot, err)
		}
		if hi >= buckets {
			err = q.JanitorKeysMergedAll(ctx, tx, p.Part)
		} else {
			err = q.JanitorKeysMerged(ctx, tx, dbsqlc.JanitorKeysMergedParams{Part: p.Part, Mask: mask, MergedBuckets: int32(hi)})
		}
		if err != nil {
			return fmt.Errorf("record the merge of part %d: %w", p.Part, err)
		}
		copied, merging = n, true
		return nil
	})
	if err != nil {
		return 0, false, err
	}
	return copied, merging, nil
}

// EmptyKeys truncates a merged part, whose keys are in their slot, and
// reports whether it did. TRUNCATE waits for the statements reading the
// part; it gives up after lockWait, to be tried again.
func EmptyKeys(ctx context.Context, db KeysDB, lockWait time.Duration) (bool, error) {
	q := dbsqlc.New()
	emptied := false
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if err := q.JanitorKeysLockWait(ctx, tx, lockWaitMillis(lockWait)); err != nil {
			return err
		}
		part, err := q.JanitorKeysEmptyMerged(ctx, tx)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("take the merged hot part: %w", err)
		}
		if err := truncateKeys(ctx, tx, part); err != nil {
			return fmt.Errorf("empty part %d: %w", part, err)
		}
		emptied = true
		return nil
	})
	if err != nil {
		return false, err
	}
	return emptied, nil
}
