-- The relay marks a result row published in place (issue 10). That update used to write
-- a new entry into every index of the table, because two indexes named `published_at`
-- (the pending rows' partial index and the published rows' for the reaper): a mark was
-- the most expensive row write of the hot path (1.5 s of PostgreSQL's ~13 s per 20,000
-- operations). With no index naming `published_at` and room left on each page, a mark is
-- a heap-only (HOT) update: a replay of the 62,857 marks of one such run took 449 ms
-- against 1,506 (BENCHMARKS.md, 2026-12-04).
--
-- The relay finds unpublished rows from a floor instead of the partial index: every
-- result row with an id below `result_relay_floor.floor` is published, and no
-- transaction still running can commit one there. The relay raises the floor (postgres.rs,
-- `PgTx::raise_relay_floor`) only past ids every writer of which has ended, which it
-- knows from a fence: the highest id handed out (`fence_id`, read first) and an xid
-- taken after it (`fence_xid`); once no transaction older than that xid runs, every row
-- up to the fence is visible or never will be. This holds because a writer has its xid
-- before it takes an id (the outbox insert asks for its xid first) and because the
-- sequence hands ids out one at a time (CACHE 1, its default, pinned below).

-- Old processes must be stopped (docs/production.md); the lock also waits for any
-- transaction still inserting result rows, so the floor below is exact.
LOCK TABLE result_outbox IN EXCLUSIVE MODE;

CREATE TABLE result_relay_floor (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    floor bigint NOT NULL,
    fence_id bigint,
    fence_xid xid8
);
INSERT INTO result_relay_floor (floor)
SELECT COALESCE(
    (SELECT min(id) FROM result_outbox WHERE published_at IS NULL),
    (SELECT max(id) + 1 FROM result_outbox),
    1);

ALTER SEQUENCE result_outbox_id_seq CACHE 1;

DROP INDEX result_outbox_pending;
-- The reaper deletes rows published before the retention cut. Rows are appended in id
-- order as time goes, so it walks the primary key from the oldest row up to the first
-- one written after the cut (postgres.rs, `reap`): no index on a time at all. (An index on
-- `created_at` costs an entry per row; a block-range one degrades once the reaper has
-- freed space in old pages, where new rows then land.)
DROP INDEX result_outbox_published;

-- Half of each new page left free: a row's mark (and a lease's) fits beside it.
ALTER TABLE result_outbox SET (fillfactor = 50);
