-- The hot path writes less (issue 10):
-- * A finished operation leaves the dispatch queue in the transaction that finishes it
--   (its row is deleted, not kept as 'done' until the reaper's retention). The queue
--   holds live work only, so the /metrics queue depth reads only that (it scanned every
--   finished row, a second per scrape at 5 million), and a settled operation's row is
--   one delete instead of an update plus a later delete.
-- * operations_status_created duplicates operations_by_status (operation ids are UUIDv7,
--   in creation order) and cost an index entry on every state change.
DELETE FROM dispatch_queue WHERE state = 'done';
DROP INDEX dispatch_queue_done;
ALTER TABLE dispatch_queue DROP COLUMN finished_at;
DROP INDEX operations_status_created;
