-- name: StockLock :many
-- StockLock locks the stock rows of skus in SKU order (so that batches
-- cannot deadlock), waiting for each as lock_timeout says, and returns
-- their SKUs. The handler runs it with a short lock_timeout, in a
-- savepoint (orders.LockStock).
SELECT s.sku FROM stock s WHERE s.sku = ANY(@skus::text[]) ORDER BY s.sku FOR UPDATE;

-- name: StockLockAvailable :many
-- StockLockAvailable locks, in SKU order, the stock rows of skus that no
-- other transaction holds, and returns their SKUs. It never waits.
SELECT s.sku FROM stock s WHERE s.sku = ANY(@skus::text[]) ORDER BY s.sku FOR UPDATE SKIP LOCKED;

-- name: StockGetMany :many
-- StockGetMany returns the levels of skus, locked or not.
SELECT sku::text AS sku, available::integer AS available FROM stock_levels WHERE sku = ANY(@skus::text[]);

-- name: StockTakeMany :execrows
-- StockTakeMany takes quantities from stock, one move per SKU, and returns
-- the number of moves it wrote. The stock_moves_chain trigger refuses a
-- take that would leave a level below zero (check_violation): the handler
-- decided on stale levels.
INSERT INTO stock_moves (sku, quantity)
SELECT t.sku, -t.quantity
FROM (SELECT unnest(@skus::text[]) AS sku, unnest(@quantities::integer[]) AS quantity) AS t;

-- name: StockReservationInsertMany :execrows
-- StockReservationInsertMany records reservations and returns how many it
-- wrote. An (order, sku) reserved already fails it (unique_violation): only
-- an order recorded in the calling transaction reserves, so its
-- reservations cannot exist yet, and its stock is never taken twice.
INSERT INTO stock_reservations (order_id, sku, quantity)
SELECT unnest(@order_ids::text[]), unnest(@skus::text[]), unnest(@quantities::integer[]);

-- name: StockRelease :one
-- StockRelease gives back the stock an order reserved, once: it marks the
-- reservations released, writes a move giving each SKU's quantity back,
-- and returns how many SKUs it gave back to.
WITH released AS (
    UPDATE stock_reservations
    SET released_at = now()
    WHERE order_id = @order_id AND released_at IS NULL
    RETURNING sku, quantity
), given AS (
    INSERT INTO stock_moves (sku, quantity)
    SELECT released.sku, sum(released.quantity)::integer
    FROM released
    GROUP BY released.sku
    ORDER BY released.sku
    RETURNING sku
)
SELECT count(*)::integer FROM given;

-- name: StockFoldLock :many
-- StockFoldLock locks, in SKU order from from_sku on, the stock rows of at
-- most max_skus SKUs that have moves to fold and that no other transaction
-- holds, and returns their SKUs. A fold passes the last SKU of one batch
-- as the next batch's from_sku ('' first: no SKU sorts before it), so
-- that each batch reads the stock rows past the last, not those every
-- batch before it has folded. A SKU's moves past its fold are found by one
-- index probe: as a semi-join the planner merged stock with the whole of
-- stock_moves' index, and read every folded move a held snapshot keeps,
-- at every fold.
SELECT s.sku FROM stock s
CROSS JOIN LATERAL (SELECT 1 FROM stock_moves m
                    WHERE m.sku = s.sku AND m.id > s.folded_through
                    LIMIT 1) m
WHERE s.sku >= @from_sku::text
ORDER BY s.sku LIMIT @max_skus::integer
FOR UPDATE OF s SKIP LOCKED;

-- name: StockFoldMany :many
-- StockFoldMany folds the moves of skus, stock rows the transaction has
-- locked, into stock.available and moves folded_through to the newest; the
-- levels stay as they were. It returns, for each SKU it folded, the range
-- of the moves it folded: past previous, up to through. Run after the
-- locks, in a statement of its own: every move of these SKUs is committed,
-- and none can be added until the transaction ends.
WITH due AS (
    SELECT l.sku, s.folded_through AS previous, l.last_move, l.unfolded
    FROM stock_levels l JOIN stock s USING (sku)
    WHERE l.sku = ANY(@skus::text[]) AND l.last_move > s.folded_through
)
UPDATE stock s
SET available = s.available + due.unfolded, folded_through = due.last_move, updated_at = now()
FROM due
WHERE s.sku = due.sku
RETURNING s.sku::text AS sku, due.previous::bigint AS previous, due.last_move::bigint AS through;

-- name: StockMovesDeleteFolded :exec
-- StockMovesDeleteFolded deletes one SKU's folded moves, past previous up
-- to through: one range of the primary key, so that it reads the moves it
-- deletes and not those a held snapshot keeps below them (joined to a list
-- of SKUs, the planner merged the delete with the whole index).
DELETE FROM stock_moves
WHERE sku = @sku AND id > @previous::bigint AND id <= @through::bigint;

-- name: StockMovesDeleteFoldedUnlocked :exec
-- StockMovesDeleteFoldedUnlocked is StockMovesDeleteFolded for the moves
-- no other transaction has locked: it waits for none.
DELETE FROM stock_moves m
WHERE m.ctid = ANY (ARRAY(
    SELECT x.ctid FROM stock_moves x
    WHERE x.sku = @sku AND x.id > @previous::bigint AND x.id <= @through::bigint
    FOR UPDATE SKIP LOCKED));

-- name: StockReservedSkus :many
-- StockReservedSkus returns the SKUs that each of the orders holds
-- reservations on. Each order's rows are one probe of the primary key: a
-- subquery the planner may not merge into a join (OFFSET 0), run once per
-- order. As "order_id = ANY(@order_ids)", without statistics the planner
-- takes each id to match 1 in 200 rows (order_id alone is not unique), so
-- a batch of 40 cancellations read the whole table whatever its size;
-- with statistics, a table of a few thousand rows. The lookups of
-- OrderReservationsLock and OrderLockAvailable are written the same way,
-- their FOR UPDATE keeping the subquery apart.
SELECT r.order_id, r.sku
FROM (SELECT DISTINCT unnest(@order_ids::text[]) AS id) AS o
CROSS JOIN LATERAL (SELECT r.order_id, r.sku FROM stock_reservations r
                    WHERE r.order_id = o.id AND r.released_at IS NULL OFFSET 0) AS r;
