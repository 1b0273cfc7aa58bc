-- The relay floor (0010) may pass a result id only once every transaction that could
-- still commit a row there has ended, which it knows from transaction ids: it holds only
-- if a writer has its xid before it takes a result id. Until now the outbox insert of the
-- store asked for its xid first (a one-time filter in its plan); an insert written
-- otherwise (by hand, by a script, by another tool) takes its id first, and a relay round
-- in between could move the floor past a row not yet committed: a result never
-- published. The schema now holds it for every insert statement: a statement-level
-- trigger, which fires before the statement draws any row's default, gives the
-- transaction its xid. One call per statement, not per row. (It cannot cover a script
-- that calls nextval on the sequence itself, or writes ids of its own with OVERRIDING
-- SYSTEM VALUE or COPY: docs/production.md says not to.)
CREATE FUNCTION result_outbox_xid_first() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN NULL;
END
$$;

CREATE TRIGGER result_outbox_xid_first BEFORE INSERT ON result_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION result_outbox_xid_first();
-- Also in sessions with session_replication_role = replica (bulk loaders, replication
-- tools), which skip ordinary triggers.
ALTER TABLE result_outbox ENABLE ALWAYS TRIGGER result_outbox_xid_first;
