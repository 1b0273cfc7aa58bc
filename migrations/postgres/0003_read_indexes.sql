-- Issue 10 (P4): with millions of operations in the ledger, the operations list's
-- filters, the /metrics stats and the queue depth read an index, never the whole table.
-- (`scripts/p4-explain.sh` loads N operations and prints the plans.)
CREATE INDEX operations_by_status ON operations (status, operation_id);
CREATE INDEX operations_by_tool ON operations (tool, operation_id);
CREATE INDEX operations_by_entity ON operations ((entity_type || ':' || entity_id), operation_id);
CREATE INDEX operations_by_namespace ON operations (namespace, operation_id);
CREATE INDEX operations_by_key ON operations (idempotency_key);
CREATE INDEX dispatch_queue_unfinished ON dispatch_queue (state) WHERE state <> 'done';
