-- The hot path writes less (issue 10): ingest writes a proposal's inbox row once, with
-- the decision it expects (accepted, naming the operation it is about to create; or the
-- refusal it already knows), and rewrites only the rows that end otherwise (a duplicate,
-- a key conflict). The operation is inserted after its inbox row, so the inbox's
-- reference to it is checked at commit instead of at once. SQLite cannot alter a
-- constraint: the table is rebuilt (nothing references it).
CREATE TABLE inbox_new (
    source_id    text PRIMARY KEY,
    topic        text,
    "partition"  integer,
    "offset"     bigint,
    operation_id text REFERENCES operations (operation_id) DEFERRABLE INITIALLY DEFERRED,
    decision     text NOT NULL CHECK (decision IN ('accepted', 'deduplicated', 'rejected')),
    reason       text,
    received_at  text NOT NULL,
    fingerprint  text
);
INSERT INTO inbox_new (source_id, topic, "partition", "offset", operation_id, decision, reason,
                       received_at, fingerprint)
    SELECT source_id, topic, "partition", "offset", operation_id, decision, reason,
           received_at, fingerprint
    FROM inbox;
DROP TABLE inbox;
ALTER TABLE inbox_new RENAME TO inbox;
CREATE INDEX inbox_received ON inbox (received_at);
