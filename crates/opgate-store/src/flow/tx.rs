//! The statements a backend provides inside one open transaction, and the rows they write.

use super::*;

/// A history entry to append.
pub(crate) struct NewEvent<'a> {
    pub operation_id: Uuid,
    pub from: Option<Status>,
    pub to: Status,
    pub reason: &'a str,
    pub attempt_id: Option<Uuid>,
    pub epoch: i64,
    pub actor: Option<&'a str>,
    pub at: OffsetDateTime,
    pub detail: Option<serde_json::Value>,
}

/// An attempt row, written before the tool is called.
pub(crate) struct NewAttempt<'a> {
    pub attempt_id: Uuid,
    pub operation_id: Uuid,
    pub number: u32,
    pub epoch: i64,
    pub worker: &'a str,
    pub started_at: OffsetDateTime,
}

/// A result-outbox row.
pub(crate) struct NewOutbox {
    pub operation_id: Option<Uuid>,
    pub seq: i64,
    pub status: String,
    pub kafka_key: String,
    /// The message as the JSON text the relay publishes (serialized once, here).
    pub payload: String,
    /// The message's W3C trace context, which the relay sends as a header.
    pub traceparent: Option<String>,
    pub at: OffsetDateTime,
}

/// An existing inbox row.
pub(crate) struct InboxRow {
    pub decision: String,
    pub reason: Option<String>,
    pub operation_id: Option<Uuid>,
    /// The content fingerprint of the proposal that made it (`None` for rows written
    /// before fingerprints were kept, and for proposals that could not be decoded).
    pub fingerprint: Option<String>,
}

/// A new inbox row: its key (`{namespace}/{event_id}`), delivery and fingerprint, and the
/// decision it is written with: the one ingest expects (accepted with the operation it is
/// about to create, or the refusal it already knows). Ingest rewrites the rows whose
/// proposals end otherwise (duplicates, key conflicts), so most rows are written once.
#[derive(Clone, Copy)]
pub(crate) struct NewInbox<'a> {
    pub key: &'a str,
    pub delivery: &'a Delivery,
    pub fingerprint: Option<&'a str>,
    pub decision: &'a IngestDecision,
    pub operation_id: Option<Uuid>,
}

/// Every row a claim, a record or an ingest transaction writes once its transitions are
/// planned in memory; [`Tx::write_rows`] writes them. PostgreSQL writes them in one
/// statement of the kinds there are (measured: fewer statements and less CPU per operation
/// than one statement per kind; an earlier one statement that ran all seven kinds, empty
/// or not, cost more than it saved: BENCHMARKS.md).
pub(crate) struct Rows<'a> {
    /// New attempt rows (a claim), written before the tool is called.
    pub attempts: &'a [NewAttempt<'a>],
    /// History entries.
    pub events: &'a [NewEvent<'a>],
    /// Queue rows with each one's ready time; a `Done` row is deleted.
    pub queue: &'a [(&'a Operation, QueueState, OffsetDateTime)],
    /// Result-outbox rows, in order.
    pub outbox: &'a [NewOutbox],
    /// Operations whose mutable columns changed.
    pub operations: &'a [Operation],
    /// Attempts that ended (a record): (operation, attempt, what it observed). Never an
    /// attempt inserted by the same call.
    pub finished: &'a [(Uuid, Uuid, &'a AttemptReport)],
}

/// The statements a backend provides inside one open transaction.
pub(crate) trait Tx: Send {
    /// Says this transaction leaves no operation claimable now that was not before (it
    /// claimed what it created, or made no queue row ready): its commit need not wake
    /// this process's dispatcher ([`crate::Ledger::claimable_changes`]). A transaction
    /// that does not say so wakes it.
    fn leaves_nothing_claimable(&mut self);
    /// The database clock.
    fn now(&mut self) -> impl Future<Output = Result<OffsetDateTime>> + Send;
    /// Inserts an inbox row; false if it exists.
    fn insert_inbox(
        &mut self,
        row: NewInbox<'_>,
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<bool>> + Send;
    /// An existing inbox row: decision, reason, operation.
    fn inbox(&mut self, event_id: &str) -> impl Future<Output = Result<Option<InboxRow>>> + Send;
    /// Sets an inbox row's decision.
    fn set_inbox(
        &mut self,
        event_id: &str,
        decision: &IngestDecision,
        operation_id: Option<Uuid>,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Inserts an operation unless its (namespace, key) exists; false if it did.
    fn insert_operation(&mut self, op: &Operation) -> impl Future<Output = Result<bool>> + Send;
    /// Reads an operation without locking it.
    fn read_operation(
        &mut self,
        id: Uuid,
    ) -> impl Future<Output = Result<Option<Operation>>> + Send;
    /// Row-locks an operation unless another transaction holds it (then `None`): the
    /// claim paths lock queue rows first, so they must never wait on an operation lock.
    fn try_lock_operation(
        &mut self,
        id: Uuid,
    ) -> impl Future<Output = Result<Option<Operation>>> + Send;
    /// Reads and row-locks an operation.
    fn lock_operation(
        &mut self,
        id: Uuid,
    ) -> impl Future<Output = Result<Option<Operation>>> + Send;
    /// Reads and row-locks an operation by key.
    fn lock_operation_by_key(
        &mut self,
        namespace: &str,
        key: &str,
    ) -> impl Future<Output = Result<Option<Operation>>> + Send;
    /// Inbox rows of these event ids (absent ones are left out). The default runs one
    /// statement per id; a backend with costly round trips overrides it.
    fn inbox_batch(
        &mut self,
        event_ids: &[&str],
    ) -> impl Future<Output = Result<HashMap<String, InboxRow>>> + Send {
        async move {
            let mut rows = HashMap::new();
            for id in event_ids {
                if let Some(row) = self.inbox(id).await? {
                    rows.insert((*id).to_owned(), row);
                }
            }
            Ok(rows)
        }
    }
    /// Reads operations by id, without locking (absent ones are left out).
    fn read_operations(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<HashMap<Uuid, Operation>>> + Send {
        async move {
            let mut ops = HashMap::new();
            for id in ids {
                if let Some(op) = self.read_operation(*id).await? {
                    ops.insert(*id, op);
                }
            }
            Ok(ops)
        }
    }
    /// Reads and row-locks operations by (namespace, key) (absent ones are left out).
    fn lock_operations_by_keys(
        &mut self,
        keys: &[(String, String)],
    ) -> impl Future<Output = Result<HashMap<(String, String), Operation>>> + Send {
        async move {
            let mut ops = HashMap::new();
            for key in keys {
                if let Some(op) = self.lock_operation_by_key(&key.0, &key.1).await? {
                    ops.insert(key.clone(), op);
                }
            }
            Ok(ops)
        }
    }
    /// Serializes policy checks on one entity until the transaction ends (PostgreSQL: a
    /// transaction-scoped advisory lock; SQLite has a single writer already).
    fn lock_entity(&mut self, entity_key: &str) -> impl Future<Output = Result<()>> + Send;
    /// Reads and row-locks the oldest operation a guard finds (see [`GuardProbe`]).
    fn lock_guarded(
        &mut self,
        probe: &GuardProbe<'_>,
    ) -> impl Future<Output = Result<Option<Operation>>> + Send;
    /// Writes an operation's mutable columns.
    fn update_operation(&mut self, op: &Operation) -> impl Future<Output = Result<()>> + Send;
    /// Appends a history entry.
    fn insert_event(&mut self, event: &NewEvent<'_>) -> impl Future<Output = Result<()>> + Send;
    /// Inserts an attempt row.
    fn insert_attempt(
        &mut self,
        attempt: &NewAttempt<'_>,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Finishes an attempt row (only one of this operation's).
    fn finish_attempt(
        &mut self,
        operation_id: Uuid,
        attempt_id: Uuid,
        report: &AttemptReport,
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Inserts or updates an operation's queue row; deletes it when the operation is
    /// done (a finished operation has no queue row).
    fn put_queue(
        &mut self,
        op: &Operation,
        state: QueueState,
        ready_at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Appends a result-outbox row.
    fn insert_outbox(&mut self, row: &NewOutbox) -> impl Future<Output = Result<()>> + Send;
    /// Inserts inbox rows for a batch; per row, whether it was inserted (false for an
    /// event id that exists, or repeats an earlier row of the batch). The default runs one
    /// statement per row; a backend with costly round trips overrides it.
    fn insert_inbox_batch(
        &mut self,
        rows: &[NewInbox<'_>],
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<Vec<bool>>> + Send {
        async move {
            let mut inserted = Vec::with_capacity(rows.len());
            for row in rows {
                inserted.push(self.insert_inbox(*row, at).await?);
            }
            Ok(inserted)
        }
    }
    /// Inserts operations unless their (namespace, key) exists; per row, whether it was
    /// inserted.
    fn insert_operations_batch(
        &mut self,
        ops: &[Operation],
    ) -> impl Future<Output = Result<Vec<bool>>> + Send {
        async move {
            let mut inserted = Vec::with_capacity(ops.len());
            for op in ops {
                inserted.push(self.insert_operation(op).await?);
            }
            Ok(inserted)
        }
    }
    /// Appends history entries.
    fn insert_events_batch(
        &mut self,
        events: &[NewEvent<'_>],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for e in events {
                self.insert_event(e).await?;
            }
            Ok(())
        }
    }
    /// Appends result-outbox rows, in order.
    fn insert_outbox_batch(
        &mut self,
        rows: &[NewOutbox],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for row in rows {
                self.insert_outbox(row).await?;
            }
            Ok(())
        }
    }
    /// Sets inbox decisions.
    fn set_inbox_batch(
        &mut self,
        rows: &[(&str, &IngestDecision, Option<Uuid>)],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (event_id, decision, op) in rows {
                self.set_inbox(event_id, decision, *op).await?;
            }
            Ok(())
        }
    }
    /// Reads and row-locks operations by id, in id order (absent ones are left out).
    fn lock_operations(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<HashMap<Uuid, Operation>>> + Send {
        async move {
            let mut sorted = ids.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            let mut ops = HashMap::new();
            for id in sorted {
                if let Some(op) = self.lock_operation(id).await? {
                    ops.insert(id, op);
                }
            }
            Ok(ops)
        }
    }
    /// Row-locks the operations no other transaction holds (the others are left out).
    fn try_lock_operations(
        &mut self,
        ids: &[Uuid],
    ) -> impl Future<Output = Result<HashMap<Uuid, Operation>>> + Send {
        async move {
            let mut ops = HashMap::new();
            for id in ids {
                if let Some(op) = self.try_lock_operation(*id).await? {
                    ops.insert(*id, op);
                }
            }
            Ok(ops)
        }
    }
    /// Writes operations' mutable columns.
    fn update_operations_batch(
        &mut self,
        ops: &[Operation],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for op in ops {
                self.update_operation(op).await?;
            }
            Ok(())
        }
    }
    /// Inserts or updates queue rows, each with its own ready time (deletes `Done` ones).
    fn put_queue_rows(
        &mut self,
        rows: &[(&Operation, QueueState, OffsetDateTime)],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (op, state, ready_at) in rows {
                self.put_queue(op, *state, *ready_at).await?;
            }
            Ok(())
        }
    }
    /// Inserts attempt rows.
    fn insert_attempts_batch(
        &mut self,
        attempts: &[NewAttempt<'_>],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for a in attempts {
                self.insert_attempt(a).await?;
            }
            Ok(())
        }
    }
    /// Finishes attempt rows: (operation, attempt, what it observed).
    fn finish_attempts_batch(
        &mut self,
        attempts: &[(Uuid, Uuid, &AttemptReport)],
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (op, attempt, report) in attempts {
                self.finish_attempt(*op, *attempt, report, at).await?;
            }
            Ok(())
        }
    }
    /// Writes every row of a planned claim, record or ingest (attempts that ended, at
    /// `at`): by default one batched statement per kind of row ([`write_rows_in_turn`]).
    fn write_rows(
        &mut self,
        rows: &Rows<'_>,
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send {
        write_rows_in_turn(self, rows, at)
    }
    /// Whether a write operation of one of these entities waits in the queue (one
    /// that an operation leaving the entity may have put at the head of the line).
    fn waiting_on_entities(
        &mut self,
        entity_keys: &[&str],
    ) -> impl Future<Output = Result<bool>> + Send;
    /// Locks up to `limit` claimable head-of-line queue rows, oldest first, skipping
    /// locked ones and those of `skip_tools`. Returns each with its tool.
    fn pick_claimable(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
        skip_tools: &[String],
    ) -> impl Future<Output = Result<Vec<(Uuid, String)>>> + Send;
    /// Those of these entities on which a write operation waits, is in flight or is held
    /// in the queue: a new write operation of one of them is not at the head of its line
    /// (what an ingest that claims reads before it writes).
    fn busy_entities(
        &mut self,
        entity_keys: &[&str],
    ) -> impl Future<Output = Result<std::collections::HashSet<String>>> + Send;
    /// Locks up to `limit` dispatched operations whose lease expired.
    fn pick_expired(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
    /// Locks up to `limit` unleased, due unknown_outcome / acknowledged operations.
    fn pick_reconcilable(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<Uuid>>> + Send;
}

/// [`Tx::write_rows`] one batched statement per kind of row, each after the one before.
pub(crate) async fn write_rows_in_turn<T: Tx + ?Sized>(
    tx: &mut T,
    rows: &Rows<'_>,
    at: OffsetDateTime,
) -> Result<()> {
    tx.insert_attempts_batch(rows.attempts).await?;
    tx.insert_events_batch(rows.events).await?;
    tx.put_queue_rows(rows.queue).await?;
    tx.insert_outbox_batch(rows.outbox).await?;
    tx.update_operations_batch(rows.operations).await?;
    tx.finish_attempts_batch(rows.finished, at).await?;
    Ok(())
}
