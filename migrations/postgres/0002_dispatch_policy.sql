-- Issue 9: the dispatch policy remembers ambiguity, and claims are sized per tool.
--
-- `ambiguous_since`: when the first attempt that may have taken effect started (timeout
-- after send, unknown 5xx, unreadable answer, crash after dispatch). Set once, cleared
-- only when a lookup proves the effect absent or a person resolves the operation; while
-- set, the operation never ends failed, cancelled or rejected, and a resend is allowed
-- only within the provider's key retention counted from it.
ALTER TABLE operations ADD COLUMN ambiguous_since timestamptz;

-- The tool of each queued operation, so a claim can skip tools with no free permits.
ALTER TABLE dispatch_queue ADD COLUMN tool text NOT NULL DEFAULT '';
UPDATE dispatch_queue q SET tool = o.tool FROM operations o WHERE o.operation_id = q.operation_id;

-- Event identity is per namespace (DESIGN.md section 9): the inbox key becomes
-- `{namespace}/{event_id}` (a namespace cannot contain `/`), and each row keeps the
-- content fingerprint of the proposal that made it, so the same event id with other
-- content is refused as `event_id_conflict` instead of being mapped to the first.
UPDATE inbox i SET source_id =
    COALESCE((SELECT o.namespace FROM operations o WHERE o.operation_id = i.operation_id), 'default')
    || '/' || i.source_id;
ALTER TABLE inbox ADD COLUMN fingerprint text;
