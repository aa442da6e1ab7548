-- +goose Up

-- stock holds what can be sold, per SKU. Operators fill it with SQL, e.g.
--   INSERT INTO stock (sku, available) VALUES ('BOOK-1', 100)
--   ON CONFLICT (sku) DO UPDATE SET available = stock.available + EXCLUDED.available;
-- The handler takes from it only by a conditional update, never below zero.
CREATE TABLE stock (
    sku        text        PRIMARY KEY,
    available  integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT stock_available_check CHECK (available >= 0)
);

-- stock_reservations records what each confirmed order took, once per
-- (order, sku): the key is the domain's defence against reserving twice.
-- A cancellation gives the quantity back and sets released_at, once.
CREATE TABLE stock_reservations (
    order_id    text        NOT NULL,
    sku         text        NOT NULL REFERENCES stock (sku),
    quantity    integer     NOT NULL,
    reserved_at timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,

    PRIMARY KEY (order_id, sku),
    CONSTRAINT stock_reservations_quantity_check CHECK (quantity > 0)
);

CREATE INDEX stock_reservations_sku_idx ON stock_reservations (sku) WHERE released_at IS NULL;

-- stock_overview shows, per SKU, what is available and what is reserved.
CREATE VIEW stock_overview AS
SELECT s.sku,
       s.available,
       coalesce(sum(r.quantity) FILTER (WHERE r.released_at IS NULL), 0)::integer AS reserved,
       count(r.order_id) FILTER (WHERE r.released_at IS NULL)                   AS orders,
       s.updated_at
FROM stock s
LEFT JOIN stock_reservations r USING (sku)
GROUP BY s.sku, s.available, s.updated_at;

-- +goose Down
DROP VIEW stock_overview;
DROP TABLE stock_reservations;
DROP TABLE stock;
