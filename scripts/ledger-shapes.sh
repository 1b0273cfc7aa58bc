#!/usr/bin/env bash
# Issue 10: what two schema changes would save on PostgreSQL, measured before either is
# built. Replays the writes of the operations and result rows a `bench e2e` run left in a
# database, in the current shape and in the proposed one, in batches of 64 (the claim's
# batch), with the hot path's `enable_seqscan = off`, and prints each variant's time and
# WAL volume three times over:
#
#  1. operations: one wide row inserted, then locked and updated twice (claim, outcome),
#     against an identity table written once plus a narrow `operation_state` table that
#     carries every column a transition writes and the indexes that name the status (the
#     per-entity invariant on an `exclusive_entity` column: the entity key, NULL for reads
#     and compensations).
#  2. result rows: marked published in place (`published_at`, in two partial indexes'
#     predicates, so never a HOT update), against a pending set kept in a table of its
#     own (a row's id deleted on publish, `published_at` in no index).
#
#   ./target/release/opgate bench e2e --operations 20000 \
#     --database-url postgres://postgres@127.0.0.1:5432/opgate_bench
#   scripts/ledger-shapes.sh postgres://postgres@127.0.0.1:5432/opgate_bench
#
# The schemas it makes (shape_*) and its copies of the rows are dropped at the end; the
# bench's own tables are only read.
#
# Change 1 was built afterwards (migration 0009, with foreign keys that keep the state
# row's entity true to its identity, which this replay does not model). Since then
# `public.operations` is a view, so the wide variant's table gets its CHECK constraints
# written out below instead of copied.
set -euo pipefail
url="${1:?postgres://user@host:port/database where bench e2e ran}"
P=(psql -q -X -v ON_ERROR_STOP=1 "$url")

"${P[@]}" <<'SQL'
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS shape_src CASCADE; DROP SCHEMA IF EXISTS shape_wide CASCADE;
DROP SCHEMA IF EXISTS shape_split CASCADE; DROP SCHEMA IF EXISTS shape_mark CASCADE;
DROP SCHEMA IF EXISTS shape_pending CASCADE;
CREATE SCHEMA shape_src; CREATE SCHEMA shape_wide; CREATE SCHEMA shape_split;
CREATE SCHEMA shape_mark; CREATE SCHEMA shape_pending;

-- The bench's operations as ingest wrote them, numbered for the batches.
CREATE TABLE shape_src.ops AS SELECT row_number() OVER (ORDER BY operation_id) AS n, o.*
  FROM public.operations o;
UPDATE shape_src.ops SET status = 'pending_dispatch', attempt_count = 0, lease_owner = NULL,
  lease_expires_at = NULL, result = NULL, result_seq = 0, first_attempt_at = NULL;
CREATE INDEX ON shape_src.ops (n); CREATE INDEX ON shape_src.ops (operation_id);
CREATE TABLE shape_src.results AS SELECT row_number() OVER (ORDER BY id) AS n, operation_id,
  seq, status, kafka_key, payload, traceparent, created_at FROM public.result_outbox;
CREATE INDEX ON shape_src.results (n);
ANALYZE shape_src.ops; ANALYZE shape_src.results;

-- 1a. The current shape (migrations 0001-0008).
CREATE TABLE shape_wide.operations (LIKE public.operations INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE shape_wide.operations ADD PRIMARY KEY (operation_id),
  ADD CHECK (status IN ('awaiting_approval', 'pending_dispatch', 'dispatched', 'acknowledged',
    'completed_success', 'completed_noop', 'failed_retryable', 'failed_permanent',
    'unknown_outcome', 'needs_attention', 'rejected', 'cancelled', 'compensating', 'compensated')),
  ADD CHECK (side_effect_class IN ('read', 'internal_write', 'external_idempotent',
    'external_non_idempotent', 'irreversible'));
CREATE UNIQUE INDEX ON shape_wide.operations (namespace, idempotency_key);
CREATE UNIQUE INDEX ON shape_wide.operations (entity_key)
  WHERE side_effect_class <> 'read' AND compensates IS NULL
    AND status IN ('dispatched', 'acknowledged', 'unknown_outcome', 'needs_attention', 'compensating');
CREATE INDEX ON shape_wide.operations (lease_expires_at) WHERE status = 'dispatched';
CREATE INDEX ON shape_wide.operations (next_attempt_at) WHERE status IN ('unknown_outcome', 'acknowledged');
CREATE INDEX ON shape_wide.operations (entity_key, created_at);
CREATE INDEX ON shape_wide.operations (workflow_id, step) WHERE workflow_id IS NOT NULL;
CREATE INDEX ON shape_wide.operations (status, operation_id);
CREATE INDEX ON shape_wide.operations (tool, operation_id);
CREATE INDEX ON shape_wide.operations ((entity_type || ':' || entity_id), operation_id);
CREATE INDEX ON shape_wide.operations (namespace, operation_id);
CREATE INDEX ON shape_wide.operations (idempotency_key);

-- 1b. Identity written once, state in a narrow table.
CREATE TABLE shape_split.operations AS SELECT operation_id, namespace, idempotency_key,
  key_components, args_fingerprint, event_id, agent_id, workflow_id, run_id, step, tool, intent,
  entity_type, entity_id, entity_key, canonical_args, side_effect_class, compensates,
  traceparent, created_at FROM public.operations WHERE false;
ALTER TABLE shape_split.operations ADD PRIMARY KEY (operation_id);
CREATE UNIQUE INDEX ON shape_split.operations (namespace, idempotency_key);
CREATE INDEX ON shape_split.operations (entity_key, created_at);
CREATE INDEX ON shape_split.operations (workflow_id, step) WHERE workflow_id IS NOT NULL;
CREATE INDEX ON shape_split.operations (tool, operation_id);
CREATE INDEX ON shape_split.operations ((entity_type || ':' || entity_id), operation_id);
CREATE INDEX ON shape_split.operations (namespace, operation_id);
CREATE INDEX ON shape_split.operations (idempotency_key);
CREATE TABLE shape_split.operation_state AS SELECT operation_id, entity_key AS exclusive_entity,
  status, attempt_count, first_attempt_at, next_attempt_at, unknown_since, lease_owner,
  lease_expires_at, lease_epoch, external_request_id, external_object_id, result, error,
  result_seq, updated_at, ambiguous_since FROM public.operations WHERE false;
ALTER TABLE shape_split.operation_state ADD PRIMARY KEY (operation_id);
ALTER TABLE shape_split.operation_state ADD FOREIGN KEY (operation_id) REFERENCES shape_split.operations;
CREATE UNIQUE INDEX ON shape_split.operation_state (exclusive_entity)
  WHERE status IN ('dispatched', 'acknowledged', 'unknown_outcome', 'needs_attention', 'compensating');
CREATE INDEX ON shape_split.operation_state (lease_expires_at) WHERE status = 'dispatched';
CREATE INDEX ON shape_split.operation_state (next_attempt_at) WHERE status IN ('unknown_outcome', 'acknowledged');
CREATE INDEX ON shape_split.operation_state (status, operation_id);

-- 2a. Result rows marked in place (migrations 0001-0008).
CREATE TABLE shape_mark.result_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  operation_id uuid, seq bigint NOT NULL, status text NOT NULL, kafka_key text NOT NULL,
  payload json NOT NULL, traceparent text, created_at timestamptz NOT NULL, claimed_by text,
  claimed_until timestamptz, published_at timestamptz);
CREATE INDEX ON shape_mark.result_outbox (id) WHERE published_at IS NULL;
CREATE INDEX ON shape_mark.result_outbox (published_at) WHERE published_at IS NOT NULL;
CREATE INDEX ON shape_mark.result_outbox (operation_id);

-- 2b. The pending set in a table of its own.
CREATE TABLE shape_pending.result_outbox (LIKE shape_mark.result_outbox INCLUDING ALL)
  WITH (fillfactor = 90);
DROP INDEX shape_pending.result_outbox_id_idx, shape_pending.result_outbox_published_at_idx;
CREATE TABLE shape_pending.result_pending (id bigint PRIMARY KEY);
SQL

# The two transitions each operation goes through, the same in both shapes: locked and
# updated by the claim, locked and updated by the outcome (table: where the state is).
transitions() {
  local table=$1
  cat <<SQL
  PERFORM 1 FROM $table WHERE operation_id = ANY(ids) FOR UPDATE;
  UPDATE $table SET status = \$q\$dispatched\$q\$, attempt_count = 1, lease_owner = \$q\$w\$q\$,
    lease_expires_at = now() + interval \$q\$1 min\$q\$, lease_epoch = lease_epoch + 1, updated_at = now()
    WHERE operation_id = ANY(ids);
  PERFORM 1 FROM $table WHERE operation_id = ANY(ids) FOR UPDATE;
  UPDATE $table SET status = \$q\$completed_success\$q\$, lease_owner = NULL,
    lease_expires_at = NULL, result = \$q\${"ok": true}\$q\$, result_seq = 2, updated_at = now()
    WHERE operation_id = ANY(ids);
SQL
}

wide_sql='DO $$ DECLARE ids uuid[]; b int; BEGIN
FOR b IN 0..(SELECT max(n) / 64 FROM shape_src.ops) LOOP
  SELECT array_agg(operation_id) INTO ids FROM shape_src.ops s WHERE s.n > b * 64 AND s.n <= b * 64 + 64;
  INSERT INTO shape_wide.operations SELECT operation_id, namespace, idempotency_key, key_components,
    args_fingerprint, event_id, agent_id, workflow_id, run_id, step, tool, intent, entity_type,
    entity_id, entity_key, canonical_args, side_effect_class, status, attempt_count,
    first_attempt_at, next_attempt_at, unknown_since, lease_owner, lease_expires_at, lease_epoch,
    external_request_id, external_object_id, result, error, compensates, traceparent, result_seq,
    created_at, updated_at, ambiguous_since
    FROM shape_src.ops WHERE operation_id = ANY(ids);
'"$(transitions shape_wide.operations)"'
END LOOP; END $$;'

split_sql='DO $$ DECLARE ids uuid[]; b int; BEGIN
FOR b IN 0..(SELECT max(n) / 64 FROM shape_src.ops) LOOP
  SELECT array_agg(operation_id) INTO ids FROM shape_src.ops s WHERE s.n > b * 64 AND s.n <= b * 64 + 64;
  INSERT INTO shape_split.operations SELECT operation_id, namespace, idempotency_key, key_components,
    args_fingerprint, event_id, agent_id, workflow_id, run_id, step, tool, intent, entity_type,
    entity_id, entity_key, canonical_args, side_effect_class, compensates, traceparent, created_at
    FROM shape_src.ops WHERE operation_id = ANY(ids);
  INSERT INTO shape_split.operation_state SELECT operation_id,
    CASE WHEN side_effect_class <> $q$read$q$ AND compensates IS NULL THEN entity_key END,
    status, attempt_count, first_attempt_at, next_attempt_at, unknown_since, lease_owner,
    lease_expires_at, lease_epoch, external_request_id, external_object_id, result, error,
    result_seq, updated_at, ambiguous_since
    FROM shape_src.ops WHERE operation_id = ANY(ids);
'"$(transitions shape_split.operation_state)"'
END LOOP; END $$;'

# A round per batch: insert 64 results, read the oldest unpublished 128 (the relay's
# read), mark the 64 published.
mark_sql='DO $$ DECLARE ids bigint[]; b int; BEGIN
FOR b IN 0..(SELECT max(n) / 64 FROM shape_src.results) LOOP
  WITH ins AS (INSERT INTO shape_mark.result_outbox (operation_id, seq, status, kafka_key, payload, traceparent, created_at)
    SELECT operation_id, seq, status, kafka_key, payload, traceparent, created_at
    FROM shape_src.results s WHERE s.n > b * 64 AND s.n <= b * 64 + 64 RETURNING id)
  SELECT array_agg(id) INTO ids FROM ins;
  PERFORM id, payload::text FROM shape_mark.result_outbox WHERE published_at IS NULL ORDER BY id LIMIT 128;
  UPDATE shape_mark.result_outbox SET published_at = now() WHERE id = ANY(ids) AND published_at IS NULL;
END LOOP; END $$;'

pending_sql='DO $$ DECLARE ids bigint[]; b int; BEGIN
FOR b IN 0..(SELECT max(n) / 64 FROM shape_src.results) LOOP
  WITH ins AS (INSERT INTO shape_pending.result_outbox (operation_id, seq, status, kafka_key, payload, traceparent, created_at)
    SELECT operation_id, seq, status, kafka_key, payload, traceparent, created_at
    FROM shape_src.results s WHERE s.n > b * 64 AND s.n <= b * 64 + 64 RETURNING id),
  p AS (INSERT INTO shape_pending.result_pending SELECT id FROM ins RETURNING id)
  SELECT array_agg(id) INTO ids FROM p;
  PERFORM r.id, r.payload::text FROM shape_pending.result_pending p JOIN shape_pending.result_outbox r USING (id)
    ORDER BY p.id LIMIT 128;
  DELETE FROM shape_pending.result_pending WHERE id = ANY(ids);
  UPDATE shape_pending.result_outbox SET published_at = now() WHERE id = ANY(ids) AND published_at IS NULL;
END LOOP; END $$;'

run() {
  local name=$1 sql=$2 lsn0 lsn1 t0 t1
  "${P[@]}" -c CHECKPOINT
  lsn0=$("${P[@]}" -tAc 'SELECT pg_current_wal_lsn()')
  t0=$(date +%s%N)
  "${P[@]}" -c 'SET enable_seqscan = off' -c "$sql"
  t1=$(date +%s%N)
  lsn1=$("${P[@]}" -tAc 'SELECT pg_current_wal_lsn()')
  printf '%-28s %6d ms  WAL %s\n' "$name" $(((t1 - t0) / 1000000)) \
    "$("${P[@]}" -tAc "SELECT pg_size_pretty(pg_wal_lsn_diff('$lsn1', '$lsn0'))")"
}

echo "operations: $("${P[@]}" -tAc 'SELECT count(*) FROM shape_src.ops'), result rows: $("${P[@]}" -tAc 'SELECT count(*) FROM shape_src.results')"
for _ in 1 2 3; do
  "${P[@]}" -c 'TRUNCATE shape_wide.operations, shape_split.operations, shape_split.operation_state, shape_mark.result_outbox, shape_pending.result_outbox, shape_pending.result_pending'
  run "operations, wide row" "$wide_sql"
  run "operations, identity+state" "$split_sql"
  run "results, marked in place" "$mark_sql"
  run "results, pending table" "$pending_sql"
done
"${P[@]}" -c 'SET client_min_messages = warning' \
  -c 'DROP SCHEMA shape_src, shape_wide, shape_split, shape_mark, shape_pending CASCADE'
