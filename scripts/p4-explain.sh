#!/usr/bin/env bash
# P4 of issue 10: the ledger's read paths with N operations already in it. Fills a fresh
# PostgreSQL database with N settled operations (1% still live, spread over 8 tools and
# N/10 entities in 10 namespaces; a finished operation has no dispatch-queue row since
# migration 0006), N published results, then prints EXPLAIN ANALYZE of the statements the operations list, /metrics
# stats and the dispatcher's claim run.
#
#   scripts/p4-explain.sh postgres://postgres@127.0.0.1:5432 1000000 [path/to/opgate]
#   P4_BEFORE=1 ...   drop the operations indexes of migration 0003 first (the plans before
#                     it, as near as the current tables allow: they are two since 0009)
#   P4_SETTLE=1 ...   afterwards settle every operation, leaving history for bench e2e
set -euo pipefail
server="${1:?postgres://user@host:port}"
n="${2:-1000000}"
opgate="${3:-target/release/opgate}"
db=opgate_p4
psql -q "$server/postgres" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
url="$server/$db"
"$opgate" migrate --database-url "$url" >/dev/null
started=$(date +%s)
psql -q "$url" <<SQL
SET synchronous_commit = off;  -- loading only; the measured statements run as usual
-- An operation's identity and its state are two tables since migration 0009 (the
-- operations view joins them); the status follows from the generated number i. One
-- transaction: every identity row must have its state row by commit.
BEGIN;
INSERT INTO operation_identity (operation_id, namespace, idempotency_key, key_components,
  args_fingerprint, event_id, tool, entity_type, entity_id, entity_key, canonical_args,
  side_effect_class, created_at)
SELECT gen_random_uuid(), 'ns' || (i % 10), 'key:' || i, '{}', 'fp' || i, 'ev-' || i,
  'tool_' || (i % 8), 'order', e, 'ns' || (i % 10) || '/order:' || e,
  '{}', 'irreversible', now() - (($n - i) || ' seconds')::interval
FROM generate_series(1, $n) AS i,
  -- An operation that holds its entity (unknown, needs_attention) gets one of its own.
  LATERAL (SELECT CASE WHEN i % 100 IN (0, 1) THEN 'live' || i ELSE 'o' || (i % ($n / 10)) END AS e) AS entity;
INSERT INTO operation_state (operation_id, exclusive_entity, tool, side_effect_class, status,
  attempt_count, updated_at)
SELECT operation_id, holds, tool, side_effect_class,
  CASE WHEN i % 100 = 0 THEN 'unknown_outcome' WHEN i % 100 = 1 THEN 'needs_attention'
       WHEN i % 100 = 2 THEN 'failed_retryable' ELSE 'completed_success' END,
  1, now()
FROM operation_identity, LATERAL (SELECT split_part(idempotency_key, ':', 2)::bigint AS i) AS n;
COMMIT;
INSERT INTO dispatch_queue (operation_id, entity_key, is_read, state, ready_at, tool)
SELECT operation_id, entity_key, false, 'waiting', now(), tool
FROM operations WHERE status = 'failed_retryable';
INSERT INTO result_outbox (operation_id, seq, status, kafka_key, payload, created_at, published_at)
SELECT operation_id, 1, status, entity_key, '{}', created_at, updated_at FROM operations;
-- Every result is published: the relay floor (migration 0010) stands where a relay that
-- kept up would have raised it, past the last row.
UPDATE result_relay_floor SET floor = (SELECT max(id) + 1 FROM result_outbox);
-- The console's reads: an inbox row per operation (1% of them duplicates), its first
-- history event, and for each unknown_outcome operation, the event that made it so; a
-- settled 1% also left unknown_outcome (half by the reconciler, half by a person).
INSERT INTO inbox (source_id, operation_id, decision, reason, received_at)
SELECT event_id, operation_id, 'accepted', NULL, created_at FROM operations;
INSERT INTO inbox (source_id, operation_id, decision, reason, received_at)
SELECT event_id || '-dup', operation_id, 'deduplicated', 'key', created_at FROM operations
WHERE idempotency_key LIKE '%00';
INSERT INTO operation_events (operation_id, from_status, to_status, reason, epoch, at)
SELECT operation_id, NULL, 'pending_dispatch', 'ingested', 0, created_at FROM operations;
INSERT INTO operation_events (operation_id, from_status, to_status, reason, epoch, at)
SELECT operation_id, 'dispatched', 'unknown_outcome', 'timeout_after_send', 1, updated_at
FROM operations WHERE status = 'unknown_outcome';
INSERT INTO operation_events (operation_id, from_status, to_status, reason, epoch, actor, at, detail)
SELECT operation_id, 'unknown_outcome', 'completed_success', 'lookup_found', 1,
  CASE WHEN idempotency_key LIKE '%3' THEN 'ops' END, updated_at, '{"unknown_for_ms": 1500}'
FROM operations WHERE status = 'completed_success' AND idempotency_key LIKE '%03';
ANALYZE;
SQL
echo "loaded $(psql -tAq "$url" -c 'SELECT COUNT(*) FROM operations') operations in $(( $(date +%s) - started )) s"
if [ "${P4_BEFORE:-}" = 1 ]; then
  # The plans before migration 0003: its indexes dropped.
  psql -q "$url" -c "DROP INDEX operations_by_status, operations_by_tool, operations_by_entity, operations_by_namespace, operations_by_key" -c ANALYZE
  echo "(without the indexes of migration 0003)"
fi
explain() {
  echo
  echo "-- $1"
  psql -q "$url" -c "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY ON) $2" \
    | grep -E "Scan|Index Cond|Filter|Execution Time|Sort|Limit|Aggregate" | sed 's/^ *//'
}
# The statements as the store runs them (crates/opgate-store: common.rs list_sql and
# live_sql, postgres.rs claim), with literal values for their parameters.
cursor=$(psql -tAq "$url" -c "SELECT operation_id FROM operations ORDER BY operation_id DESC OFFSET 5000 LIMIT 1")
list="SELECT operation_id, status FROM operations"
explain "ops list, newest first" "$list ORDER BY operation_id DESC LIMIT 51"
explain "ops list --status needs_attention" "$list WHERE status = 'needs_attention' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --status needs_attention, second page" "$list WHERE status = 'needs_attention' AND operation_id < '$cursor' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --tool tool_3" "$list WHERE tool = 'tool_3' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --entity order:o42" "$list WHERE (entity_type || ':' || entity_id) = 'order:o42' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --namespace ns3" "$list WHERE namespace = 'ns3' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --key key:4242" "$list WHERE idempotency_key = 'key:4242' ORDER BY operation_id DESC LIMIT 51"
explain "ops list --status unknown_outcome --tool tool_0" "$list WHERE status = 'unknown_outcome' AND tool = 'tool_0' ORDER BY operation_id DESC LIMIT 51"
live=$(psql -tAq "$url" -c "SELECT string_agg(quote_literal(s), ', ') FROM unnest(ARRAY['awaiting_approval','pending_dispatch','dispatched','acknowledged','failed_retryable','unknown_outcome','needs_attention','compensating']) s")
explain "/metrics stats: live operations" "SELECT tool, side_effect_class, status, COUNT(*) AS n, MIN(CASE WHEN status = 'unknown_outcome' THEN COALESCE(unknown_since, updated_at) ELSE updated_at END) AS oldest FROM operation_state WHERE status IN ($live) GROUP BY 1, 2, 3"
explain "/metrics stats: queue depth" "SELECT state, COUNT(*) FROM dispatch_queue GROUP BY state"
# The relay backlog reads from the relay floor with sequential scans and JIT off (postgres.rs, stats).
PGOPTIONS="-c enable_seqscan=off -c jit=off" explain "/metrics stats: relay backlog" "SELECT COUNT(*), MIN(created_at), now() FROM result_outbox WHERE id >= COALESCE((SELECT floor FROM result_relay_floor), 0) AND published_at IS NULL"
# The reaper's walk (postgres.rs, reap) as a count, with its transaction's settings.
PGOPTIONS="-c enable_seqscan=off -c jit=off" explain "reaper: results published before the retention cut (7 days)" "SELECT count(*) FROM result_outbox WHERE id < COALESCE((SELECT id FROM result_outbox WHERE created_at >= now() - interval '7 days' ORDER BY id LIMIT 1), 9223372036854775807) AND published_at < now() - interval '7 days'"
# The claim runs with sequential scans and sorts off for its transaction (postgres.rs, Planner::Claim).
PGOPTIONS="-c enable_seqscan=off -c enable_sort=off" explain "dispatcher claim" "SELECT q.operation_id, q.tool FROM dispatch_queue q WHERE q.state = 'waiting' AND q.ready_at <= now() AND NOT (q.tool = ANY('{}'::text[])) AND (q.is_read OR NOT EXISTS (SELECT 1 FROM dispatch_queue p WHERE p.entity_key = q.entity_key AND NOT p.is_read AND p.state IN ('waiting', 'inflight', 'held') AND p.operation_id <> q.operation_id AND (q.compensates IS NULL OR p.operation_id <> q.compensates) AND (p.state <> 'waiting' OR (p.seq < q.seq AND q.compensates IS NULL)))) ORDER BY q.ready_at, q.seq LIMIT 16 FOR UPDATE OF q SKIP LOCKED"
# The console (crates/opgate-store common.rs: DECISIONS_SQL, unknown_*_sql, RESULTS_SQL;
# ids_between), over the last hour of this history (created over the last N seconds).
since="now() - interval '1 hour'"
explain "console overview: ingest decisions, last hour" "SELECT decision, reason, COUNT(*) AS n FROM inbox WHERE received_at >= $since GROUP BY decision, reason ORDER BY n DESC, decision, reason"
unknown="(from_status = 'unknown_outcome' OR to_status = 'unknown_outcome')"
explain "console overview: became unknown, last hour" "SELECT COUNT(*) FROM operation_events WHERE $unknown AND at >= $since AND to_status = 'unknown_outcome' AND COALESCE(from_status, '') <> 'unknown_outcome'"
explain "console overview: left unknown, last hour" "SELECT to_status, actor IS NOT NULL AS by_person, detail FROM operation_events WHERE $unknown AND at >= $since AND from_status = 'unknown_outcome' AND to_status <> 'unknown_outcome' ORDER BY at DESC LIMIT 100000"
one=$(psql -tAq "$url" -c "SELECT operation_id FROM operations OFFSET 4242 LIMIT 1")
explain "console: an operation's result messages" "SELECT seq, status, created_at, published_at FROM result_outbox WHERE operation_id = '$one' ORDER BY id"
explain "console: an id prefix (13 characters)" "SELECT operation_id FROM operation_identity WHERE operation_id BETWEEN '${one:0:13}-0000-0000-000000000000' AND '${one:0:13}-ffff-ffff-ffffffffffff' ORDER BY operation_id LIMIT 2"

if [ "${P4_SETTLE:-}" = 1 ]; then
  # Leave pure history for `opgate bench e2e --database-url $url` (its own operations
  # then run beside a million settled ones): every live operation settled, the queue empty.
  psql -q "$url" -c "UPDATE operation_state SET status = 'completed_success', next_attempt_at = NULL WHERE status <> 'completed_success'" \
    -c "DELETE FROM dispatch_queue" -c ANALYZE
  echo "settled every operation (P4_SETTLE=1)"
fi
