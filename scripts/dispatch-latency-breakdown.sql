-- Where an operation's consume -> dispatch time goes, from a `bench e2e` database
-- (namespace `bench`). Needs `track_commit_timestamp = on` on the server while the
-- benchmark runs (ALTER SYSTEM SET track_commit_timestamp = on, then a restart; it costs
-- a little on every commit, so set it back afterwards). Per operation: its ingest
-- transaction from the clock read that stamps `created_at` to its commit (the commit of
-- its 'ingested' history entry), that commit to the clock read of the claim that took
-- it (the attempt's `started_at`, which the bench's consume -> dispatch ends at), and
-- that claim's transaction to its commit (after which the call leaves). Also how many
-- operations were committed while the claim before theirs ran, so waited for it.
--   psql postgres://postgres@127.0.0.1:5432/opgate_bench -x -f scripts/dispatch-latency-breakdown.sql
WITH e AS (
  SELECT o.operation_id, o.created_at,
    (SELECT pg_xact_commit_timestamp(ev.xmin) FROM operation_events ev
      WHERE ev.operation_id = o.operation_id AND ev.reason = 'ingested') AS ingest_commit,
    (SELECT min(a.started_at) FROM attempts a WHERE a.operation_id = o.operation_id) AS claim_clock,
    (SELECT pg_xact_commit_timestamp(ev.xmin) FROM operation_events ev
      WHERE ev.operation_id = o.operation_id AND ev.reason = 'claimed' ORDER BY ev.at LIMIT 1) AS claim_commit
  FROM operations o WHERE o.namespace = 'bench'),
claims AS (SELECT DISTINCT claim_clock, claim_commit FROM e),
-- The claim that committed last before this operation's claim read its clock.
w AS (
  SELECT e.*, prev.claim_clock AS prev_clock, prev.claim_commit AS prev_commit
  FROM e LEFT JOIN LATERAL (
    SELECT c.claim_clock, c.claim_commit FROM claims c
    WHERE c.claim_commit < e.claim_clock ORDER BY c.claim_commit DESC LIMIT 1) AS prev ON true)
SELECT
  count(*) AS ops,
  (SELECT count(*) FROM claims) AS claim_txns,
  percentile_cont(array[0.5,0.9,0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM ingest_commit - created_at)*1000) AS ingest_txn_ms,
  percentile_cont(array[0.5,0.9,0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM claim_clock - ingest_commit)*1000) AS commit_to_claim_ms,
  percentile_cont(array[0.5,0.9,0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM claim_commit - claim_clock)*1000) AS claim_txn_ms,
  percentile_cont(array[0.5,0.9,0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM claim_clock - created_at)*1000) AS consume_to_dispatch_ms,
  count(*) FILTER (WHERE ingest_commit < prev_commit AND ingest_commit > prev_clock) AS committed_during_prev_claim,
  count(*) FILTER (WHERE claim_clock - created_at > interval '10 ms') AS over10,
  count(*) FILTER (WHERE claim_clock - created_at > interval '10 ms' AND ingest_commit < prev_commit AND ingest_commit > prev_clock) AS over10_during_prev_claim
FROM w;
