-- What the operator console reads without scanning the ledger of truth:
-- an operation's result rows (its timeline shows what was published, and when), and
-- the history events that enter or leave `unknown_outcome` (the overview's "ambiguous
-- outcomes and how they were resolved" over a window). The second index is partial:
-- only those few events are indexed, so the hot path writes it rarely.
CREATE INDEX result_outbox_operation ON result_outbox (operation_id);
CREATE INDEX operation_events_unknown ON operation_events (at)
    WHERE from_status = 'unknown_outcome' OR to_status = 'unknown_outcome';
