-- Issue 9: the dispatch policy remembers ambiguity, and claims are sized per tool.
-- See migrations/postgres/0002_dispatch_policy.sql for what the columns mean.
ALTER TABLE operations ADD COLUMN ambiguous_since text;

ALTER TABLE dispatch_queue ADD COLUMN tool text NOT NULL DEFAULT '';
UPDATE dispatch_queue SET tool = (SELECT o.tool FROM operations o WHERE o.operation_id = dispatch_queue.operation_id);

-- Event identity is per namespace: see migrations/postgres/0002_dispatch_policy.sql.
UPDATE inbox SET source_id =
    COALESCE((SELECT o.namespace FROM operations o WHERE o.operation_id = inbox.operation_id), 'default')
    || '/' || source_id;
ALTER TABLE inbox ADD COLUMN fingerprint text;

-- The claim's head-of-line check looks up an entity's other queue rows. SQLite cannot
-- use the partial index `dispatch_queue_entity` for it (it cannot prove the subquery's
-- OR of states implies the index's predicate) and scanned the whole queue per candidate,
-- quadratic in the queue's size; a plain index on (entity_key, seq) serves it.
CREATE INDEX dispatch_queue_by_entity ON dispatch_queue (entity_key, seq);
