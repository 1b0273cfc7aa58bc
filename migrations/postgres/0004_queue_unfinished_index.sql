-- Migration 0003's queue-depth index, `(state) WHERE state <> 'done'`, misled the
-- dispatcher's head-of-line probe: with statistics gone stale in a burst (the queue
-- grows from nothing to thousands of rows between two autoanalyze runs) the planner took
-- it for tiny and read all of it for each candidate, filtering by entity (45-62 ms a
-- claim at 15,000 unfinished rows beside a million finished ones, against 0.4 ms through
-- `dispatch_queue_entity`). It goes: the queue depth in /metrics scans the queue again
-- (36 ms at a million finished rows; finished rows are reaped after `reap_after`).
DROP INDEX dispatch_queue_unfinished;
