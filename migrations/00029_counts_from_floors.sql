-- +goose Up

-- The gauges and outbox_backlog count the open rows from the claim floors,
-- and an audit of the floors finds any row left open under one.
--
-- The counts read every pending message, and every row with published_at
-- IS NULL, through inbox_pending_idx and outbox_unpublished_idx, read
-- whole. A snapshot held open keeps there the entry of every row that
-- ended since it began, so each count read all of them (1,000 orders/s
-- held ten minutes: 600,000 messages and 1.2 M outbox rows, each row
-- visited), and a scrape of /metrics during the very incident an operator
-- watches the backlog for took seconds, or timed out and reported the
-- database down. Under a floor every row has ended (migration 00022), so
-- the open rows counted from it are all of them; the outbox's dead rows
-- are few and stay until replayed, and are read through
-- outbox_dead_at_idx, by a range on dead_at that holds for every one of
-- them (see migration 00028). The columns and their meaning are as before.
--
-- The counts took no floor so that a row left open under one, which no
-- claim finds, would show as an oldest pending that kept growing. The
-- audit below does better: it finds such a row and lowers the floor to it,
-- so that the claims (and the counts) find it again; the service runs it
-- when it starts and every ten minutes, for a second at most, and logs
-- each row it finds as an error.
CREATE OR REPLACE VIEW outbox_backlog AS
WITH open AS (
    SELECT count(*) FILTER (WHERE reply_to IS NULL)                            AS events,
           count(*) FILTER (WHERE reply_to IS NULL AND last_error IS NOT NULL) AS failing,
           min(created_at) FILTER (WHERE reply_to IS NULL)                     AS oldest_created_at,
           count(*) FILTER (WHERE reply_to IS NOT NULL)                        AS replies
    FROM outbox
    WHERE published_at IS NULL AND dead_at IS NULL AND id >= outbox_claim_floor()
), dead AS (
    SELECT count(*) FILTER (WHERE reply_to IS NULL)        AS events,
           min(created_at) FILTER (WHERE reply_to IS NULL) AS oldest_created_at,
           count(*) FILTER (WHERE reply_to IS NOT NULL)    AS replies
    FROM outbox
    WHERE published_at IS NULL AND dead_at >= '-infinity'
)
SELECT (open.events + dead.events)::bigint                               AS unpublished,
       open.failing                                                      AS failing,
       least(open.oldest_created_at, dead.oldest_created_at)             AS oldest_created_at,
       now() - least(open.oldest_created_at, dead.oldest_created_at)     AS oldest_age,
       dead.events                                                       AS dead,
       open.replies                                                      AS replies_unpublished,
       dead.replies                                                      AS replies_undeliverable
FROM open, dead;

-- claim_floor_audit looks under the floor of tbl ('inbox' or 'outbox') for
-- a row still open, which no claim would find, lowers the floor to the
-- oldest such row, and returns that row's id, or NULL when there is none.
-- There should never be one: a replay lowers the floor itself. A dump
-- restored with floors past rows it restores as open (pg_dump reads
-- sequences outside its snapshot), or a fault in the floors, leaves one.
--
-- Its scan reads the ended rows' entries under the floor that vacuum has
-- not removed: under a snapshot held open, those of every row ended since
-- it began (ten minutes into a hold at 1,000 orders/s: 161,942 buffers and
-- 28 s). So the scan takes no lock, and the raises go on meanwhile; the
-- caller bounds it with a statement_timeout. A row the scan finds was
-- open under the floor as read before the scan's snapshot; only a replay
-- committed in between lowers the floor to such a row itself. So the row
-- found is checked again under the floor's lock (which a replay holds
-- until it commits), with a snapshot taken after it: still open, and
-- still under the floor.
-- +goose StatementBegin
CREATE FUNCTION claim_floor_audit(tbl text) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    seq regclass := CASE tbl WHEN 'inbox' THEN 'inbox_claim_floor_seq'::regclass
                             WHEN 'outbox' THEN 'outbox_claim_floor_seq'::regclass END;
    open text := CASE tbl WHEN 'inbox' THEN $open$status = 'pending'$open$
                          WHEN 'outbox' THEN 'published_at IS NULL AND dead_at IS NULL' END;
    floor bigint;
    stranded bigint;
    still boolean;
BEGIN
    IF seq IS NULL THEN
        RAISE EXCEPTION 'claim_floor_audit: no claim floor for %', tbl;
    END IF;
    floor := coalesce(pg_sequence_last_value(seq), 0);
    -- A new statement, so a snapshot taken after the floor was read.
    EXECUTE format('SELECT min(id) FROM %I WHERE (%s) AND id < $1', tbl, open)
        INTO stranded USING floor;
    IF stranded IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM claim_floor_lock(seq, false);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I WHERE id = $1 AND (%s))', tbl, open)
        INTO still USING stranded;
    IF NOT still OR stranded >= coalesce(pg_sequence_last_value(seq), 0) THEN
        RETURN NULL;
    END IF;
    PERFORM claim_floor_lower(tbl, stranded);
    RETURN stranded;
END;
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION claim_floor_audit(text);

CREATE OR REPLACE VIEW outbox_backlog AS
SELECT count(*) FILTER (WHERE reply_to IS NULL)                                                AS unpublished,
       count(*) FILTER (WHERE reply_to IS NULL AND last_error IS NOT NULL AND dead_at IS NULL) AS failing,
       min(created_at) FILTER (WHERE reply_to IS NULL)                                         AS oldest_created_at,
       now() - min(created_at) FILTER (WHERE reply_to IS NULL)                                 AS oldest_age,
       count(*) FILTER (WHERE reply_to IS NULL AND dead_at IS NOT NULL)                        AS dead,
       count(*) FILTER (WHERE reply_to IS NOT NULL AND dead_at IS NULL)                        AS replies_unpublished,
       count(*) FILTER (WHERE reply_to IS NOT NULL AND dead_at IS NOT NULL)                    AS replies_undeliverable
FROM outbox
WHERE published_at IS NULL;
