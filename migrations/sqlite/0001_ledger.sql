-- opgate ledger, SQLite (the embedded default). Timestamps are TEXT in one fixed
-- RFC 3339 UTC format with milliseconds (YYYY-MM-DDTHH:MM:SS.sssZ), so they compare as text.
-- Mirrors migrations/postgres; The schema enforces the invariants itself (DESIGN.md section 2):
-- one operation per (namespace, idempotency_key), at most one write in flight per entity,
-- and only the states of the state machine.

CREATE TABLE operations (
    operation_id        text PRIMARY KEY,
    namespace           text NOT NULL,
    idempotency_key     text NOT NULL,
    key_components      text NOT NULL,
    args_fingerprint    text NOT NULL,
    event_id            text NOT NULL,
    agent_id            text,
    workflow_id         text,
    run_id              text,
    step                bigint,
    tool                text NOT NULL,
    intent              text,
    entity_type         text NOT NULL,
    entity_id           text NOT NULL,
    entity_key          text NOT NULL,
    canonical_args      text NOT NULL,
    side_effect_class   text NOT NULL CHECK (side_effect_class IN
        ('read', 'internal_write', 'external_idempotent', 'external_non_idempotent', 'irreversible')),
    status              text NOT NULL CHECK (status IN
        ('awaiting_approval', 'pending_dispatch', 'dispatched', 'acknowledged', 'completed_success',
         'completed_noop', 'failed_retryable', 'failed_permanent', 'unknown_outcome',
         'needs_attention', 'rejected', 'cancelled', 'compensating', 'compensated')),
    attempt_count       integer NOT NULL DEFAULT 0,
    first_attempt_at    text,
    next_attempt_at     text,
    unknown_since       text,
    lease_owner         text,
    lease_expires_at    text,
    lease_epoch         bigint NOT NULL DEFAULT 0,
    external_request_id text,
    external_object_id  text,
    result              text,
    error               text,
    compensates         text REFERENCES operations (operation_id),
    traceparent         text,
    result_seq          bigint NOT NULL DEFAULT 0,
    created_at          text NOT NULL,
    updated_at          text NOT NULL
);

-- One operation per business identity.
CREATE UNIQUE INDEX operations_namespace_key ON operations (namespace, idempotency_key);

-- At most one write in flight per entity; an unresolved ambiguity holds the entity too.
-- A compensation runs while the operation it undoes holds the entity in `compensating`.
CREATE UNIQUE INDEX operations_one_write_in_flight ON operations (entity_key)
    WHERE side_effect_class <> 'read' AND compensates IS NULL
      AND status IN ('dispatched', 'acknowledged', 'unknown_outcome', 'needs_attention', 'compensating');

CREATE INDEX operations_lease ON operations (lease_expires_at)
    WHERE status = 'dispatched';
CREATE INDEX operations_reconcile ON operations (next_attempt_at)
    WHERE status IN ('unknown_outcome', 'acknowledged');
CREATE INDEX operations_status_created ON operations (status, created_at);
CREATE INDEX operations_entity ON operations (entity_key, created_at);
CREATE INDEX operations_workflow ON operations (workflow_id, step) WHERE workflow_id IS NOT NULL;

-- One row per consumed proposal; a redelivery hits the primary key and changes nothing.
CREATE TABLE inbox (
    source_id    text PRIMARY KEY,
    topic        text,
    "partition"  integer,
    "offset"     bigint,
    operation_id text REFERENCES operations (operation_id),
    decision     text NOT NULL CHECK (decision IN ('accepted', 'deduplicated', 'rejected')),
    reason       text,
    received_at  text NOT NULL
);
CREATE INDEX inbox_received ON inbox (received_at);

-- Append-only history; operations.status is its materialized view.
CREATE TABLE operation_events (
    event_seq    integer PRIMARY KEY AUTOINCREMENT,
    operation_id text NOT NULL REFERENCES operations (operation_id),
    from_status  text,
    to_status    text NOT NULL,
    reason       text NOT NULL,
    attempt_id   text,
    epoch        bigint NOT NULL,
    actor        text,
    at           text NOT NULL,
    detail       text
);
CREATE INDEX operation_events_operation ON operation_events (operation_id, event_seq);

-- One row per dispatch try, written before the tool is called.
CREATE TABLE attempts (
    attempt_id          text PRIMARY KEY,
    operation_id        text NOT NULL REFERENCES operations (operation_id),
    number              integer NOT NULL,
    epoch               bigint NOT NULL,
    worker              text NOT NULL,
    started_at          text NOT NULL,
    finished_at         text,
    outcome             text,
    http_status         integer,
    error_category      text,
    latency_ms          bigint,
    provider_request_id text,
    UNIQUE (operation_id, number)
);

-- The small hot table of work; `seq` orders one entity's operations (ingest order).
CREATE TABLE dispatch_queue (
    operation_id text PRIMARY KEY REFERENCES operations (operation_id),
    entity_key   text NOT NULL,
    seq          integer NOT NULL,
    is_read      integer NOT NULL,
    -- A compensation may run while the operation it undoes holds the entity.
    compensates  text,
    state        text NOT NULL CHECK (state IN ('parked', 'waiting', 'inflight', 'held', 'done')),
    ready_at     text NOT NULL,
    finished_at  text
);
CREATE INDEX dispatch_queue_ready ON dispatch_queue (ready_at, seq) WHERE state = 'waiting';
CREATE INDEX dispatch_queue_entity ON dispatch_queue (entity_key, seq)
    WHERE state IN ('waiting', 'inflight', 'held') AND is_read = 0;
CREATE INDEX dispatch_queue_done ON dispatch_queue (finished_at) WHERE state = 'done';
-- seq is MAX(seq) + 1 at insert (SQLite has no identity for a non-key column).
CREATE UNIQUE INDEX dispatch_queue_seq ON dispatch_queue (seq);

-- Result events not yet published to Kafka (transactional outbox).
CREATE TABLE result_outbox (
    id            integer PRIMARY KEY AUTOINCREMENT,
    operation_id  text,
    seq           bigint NOT NULL,
    status        text NOT NULL,
    kafka_key     text NOT NULL,
    payload       text NOT NULL,
    created_at    text NOT NULL,
    claimed_by    text,
    claimed_until text,
    published_at  text
);
CREATE INDEX result_outbox_pending ON result_outbox (id) WHERE published_at IS NULL;
CREATE INDEX result_outbox_published ON result_outbox (published_at) WHERE published_at IS NOT NULL;
