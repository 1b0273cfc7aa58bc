-- The hot path writes less (issue 10): ingest writes a proposal's inbox row once, with
-- the decision it expects (accepted, naming the operation it is about to create; or the
-- refusal it already knows), and rewrites only the rows that end otherwise (a duplicate,
-- a key conflict). The operation is inserted after its inbox row (the inbox row is the
-- event's claim, so a concurrent ingest of the same event waits there), so the inbox's
-- reference to it is checked at commit instead of at once.
ALTER TABLE inbox ALTER CONSTRAINT inbox_operation_id_fkey DEFERRABLE INITIALLY DEFERRED;
