-- +goose Up

-- stock_lock's statements were planned once per session and kept: planned
-- while the stock table held its 1,000 rows in a few pages, they scan it
-- whole. Nothing replans them without ANALYZE, and a snapshot held open
-- keeps every version of the stock rows (each order updates some), so the
-- table grows and every scan with it: with a snapshot held 30 s at 500
-- orders/s, 8 to 15 ms per call, most of the handler's time. Planned per
-- call, they read the rows through the primary key.
ALTER FUNCTION stock_lock(text[], integer) SET plan_cache_mode = force_custom_plan;

-- +goose Down
ALTER FUNCTION stock_lock(text[], integer) RESET plan_cache_mode;
