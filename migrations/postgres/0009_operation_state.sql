-- The hot path writes less (issue 10): an operation's hot state moves to a narrow table
-- of its own. Every transition updated the wide `operations` row, and since its status
-- is indexed none of those updates could be HOT: each one wrote a new entry into every
-- one of the row's ~10 indexes (BENCHMARKS.md: 23.5 WAL records per operation for the
-- two updates, a third of PostgreSQL's time in index insertion).
--
-- * `operation_identity` is the old table renamed: what an operation is, written once at
--   ingest and never updated (the foreign keys of inbox, events, attempts, queue and
--   compensations follow the rename).
-- * `operation_state` holds what a transition writes, one row per operation, with the
--   indexes that name the status. The one-write-in-flight invariant stays a unique index
--   the schema enforces: `operation_identity.holds` (generated) is the entity key of an
--   operation that holds its entity while in flight (a write that is not a
--   compensation), '' for reads and compensations; the state row carries it as
--   `exclusive_entity` under a foreign key to (operation_id, holds, ...), so a state
--   row can neither claim another entity nor hold none while its identity says it
--   must, and an identity row cannot change what it holds underneath its state. The
--   same key holds the state row's copies of `tool` and `side_effect_class`, which let
--   the live-operation gauges (/metrics) read the live state rows alone: joined to the
--   identity rows they cost a walk of the whole history (a hash join over a million
--   rows, 175 ms; a nested loop, 146-178 ms; 77 ms on the state rows alone). Every
--   identity row has its state row (a deferred foreign key, checked at commit: the two
--   are inserted by one statement). The indexes keep their names (the store maps a violation of
--   `operations_one_write_in_flight` to "entity busy").
-- * `operations` is a view joining the two with the old columns in the old order: the
--   table DESIGN.md names reads as before. opgate writes the two tables; locking reads
--   lock the state row only.
--
-- Rewrites `operation_identity` once (the generated column, added after the state
-- columns are dropped, so the rewrite also frees their bytes) under an exclusive lock;
-- stop the processes of the previous version first (they write columns that are no
-- longer there).
ALTER TABLE operations RENAME TO operation_identity;

CREATE TABLE operation_state (
    operation_id        uuid PRIMARY KEY,
    exclusive_entity    text NOT NULL,
    tool                text NOT NULL,
    side_effect_class   text NOT NULL,
    status              text NOT NULL CHECK (status IN
        ('awaiting_approval', 'pending_dispatch', 'dispatched', 'acknowledged', 'completed_success',
         'completed_noop', 'failed_retryable', 'failed_permanent', 'unknown_outcome',
         'needs_attention', 'rejected', 'cancelled', 'compensating', 'compensated')),
    attempt_count       integer NOT NULL DEFAULT 0,
    first_attempt_at    timestamptz,
    next_attempt_at     timestamptz,
    unknown_since       timestamptz,
    ambiguous_since     timestamptz,
    lease_owner         text,
    lease_expires_at    timestamptz,
    lease_epoch         bigint NOT NULL DEFAULT 0,
    external_request_id text,
    external_object_id  text,
    result              jsonb,
    error               jsonb,
    result_seq          bigint NOT NULL DEFAULT 0,
    updated_at          timestamptz NOT NULL
);

INSERT INTO operation_state (operation_id, exclusive_entity, tool, side_effect_class, status, attempt_count,
    first_attempt_at, next_attempt_at, unknown_since, ambiguous_since, lease_owner,
    lease_expires_at, lease_epoch, external_request_id, external_object_id, result, error,
    result_seq, updated_at)
SELECT operation_id,
    CASE WHEN side_effect_class <> 'read' AND compensates IS NULL THEN entity_key ELSE '' END,
    tool, side_effect_class, status, attempt_count, first_attempt_at, next_attempt_at, unknown_since, ambiguous_since,
    lease_owner, lease_expires_at, lease_epoch, external_request_id, external_object_id,
    result, error, result_seq, updated_at
FROM operation_identity;

-- Dropping the columns drops the indexes that named them (the per-entity, lease,
-- reconcile and by-status indexes), rebuilt on the state table below.
ALTER TABLE operation_identity
    DROP COLUMN status, DROP COLUMN attempt_count, DROP COLUMN first_attempt_at,
    DROP COLUMN next_attempt_at, DROP COLUMN unknown_since, DROP COLUMN ambiguous_since,
    DROP COLUMN lease_owner, DROP COLUMN lease_expires_at, DROP COLUMN lease_epoch,
    DROP COLUMN external_request_id, DROP COLUMN external_object_id, DROP COLUMN result,
    DROP COLUMN error, DROP COLUMN result_seq, DROP COLUMN updated_at;

-- The same expression as the copy above, from now on the identity's own.
ALTER TABLE operation_identity ADD COLUMN holds text NOT NULL GENERATED ALWAYS AS (
    CASE WHEN side_effect_class <> 'read' AND compensates IS NULL THEN entity_key ELSE '' END
) STORED;
ALTER TABLE operation_identity ADD CONSTRAINT operation_identity_holds
    UNIQUE (operation_id, holds, tool, side_effect_class);
ALTER TABLE operation_state ADD CONSTRAINT operation_state_identity
    FOREIGN KEY (operation_id, exclusive_entity, tool, side_effect_class)
    REFERENCES operation_identity (operation_id, holds, tool, side_effect_class);
ALTER TABLE operation_identity ADD CONSTRAINT operation_identity_has_state
    FOREIGN KEY (operation_id) REFERENCES operation_state (operation_id)
    DEFERRABLE INITIALLY DEFERRED;

-- At most one write in flight per entity; an unresolved ambiguity holds the entity too.
CREATE UNIQUE INDEX operations_one_write_in_flight ON operation_state (exclusive_entity)
    WHERE exclusive_entity <> '' AND status IN ('dispatched', 'acknowledged', 'unknown_outcome', 'needs_attention', 'compensating');
CREATE INDEX operations_lease ON operation_state (lease_expires_at)
    WHERE status = 'dispatched';
CREATE INDEX operations_reconcile ON operation_state (next_attempt_at)
    WHERE status IN ('unknown_outcome', 'acknowledged');
CREATE INDEX operations_by_status ON operation_state (status, operation_id);

CREATE VIEW operations AS
SELECT i.operation_id, i.namespace, i.idempotency_key, i.key_components, i.args_fingerprint,
    i.event_id, i.agent_id, i.workflow_id, i.run_id, i.step, i.tool, i.intent, i.entity_type,
    i.entity_id, i.entity_key, i.canonical_args, i.side_effect_class, s.status,
    s.attempt_count, s.first_attempt_at, s.next_attempt_at, s.unknown_since, s.lease_owner,
    s.lease_expires_at, s.lease_epoch, s.external_request_id, s.external_object_id, s.result,
    s.error, i.compensates, i.traceparent, s.result_seq, i.created_at, s.updated_at,
    s.ambiguous_since
FROM operation_identity i JOIN operation_state s ON s.operation_id = i.operation_id;
