//! The ledger's algorithms, written once over [`Tx`], a per-backend set of statements.
//!
//! Each function runs inside one transaction the backend opened; the backend commits
//! it and retries the whole function on a transient conflict. Every state change goes
//! through [`opgate_core::transition`], appends a history event, moves the queue row and
//! writes a result-outbox row, in that one transaction.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use opgate_core::envelope::Envelope;
use opgate_core::policy::{self, Ambiguity};
use opgate_core::registry::KeyStrategy;
use opgate_core::{
    Dedupe, Delivery, ErrorInfo, Event, IngestItem, Operation, RejectedProposal, Rejection,
    ResultMessage, Status, transition,
};
use serde_json::json;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::types::{
    AttemptReport, Claim, ClaimRequest, Command, CompensationRequest, IngestDecision,
    IngestOutcome, QueueState, Recording,
};
use crate::{Error, Result};

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
    pub payload: serde_json::Value,
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

/// A new inbox row: its key (`{namespace}/{event_id}`), delivery and fingerprint.
pub(crate) type NewInbox<'a> = (&'a str, &'a Delivery, Option<&'a str>);

/// The statements a backend provides inside one open transaction.
pub(crate) trait Tx: Send {
    /// The database clock.
    fn now(&mut self) -> impl Future<Output = Result<OffsetDateTime>> + Send;
    /// Inserts an inbox row (decision `accepted`, no operation yet); false if it exists.
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
    /// Inserts or updates an operation's queue row.
    fn put_queue(
        &mut self,
        op: &Operation,
        state: QueueState,
        ready_at: OffsetDateTime,
        at: OffsetDateTime,
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
    /// Inserts queue rows for new operations.
    fn put_queue_batch(
        &mut self,
        rows: &[(&Operation, QueueState)],
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (op, state) in rows {
                self.put_queue(op, *state, at, at).await?;
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
    /// Inserts or updates queue rows, each with its own ready time.
    fn put_queue_rows(
        &mut self,
        rows: &[(&Operation, QueueState, OffsetDateTime)],
        at: OffsetDateTime,
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            for (op, state, ready_at) in rows {
                self.put_queue(op, *state, *ready_at, at).await?;
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
    /// Locks up to `limit` claimable head-of-line queue rows, skipping locked ones and
    /// those of `skip_tools`; returns each with its tool.
    fn pick_claimable(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
        skip_tools: &[String],
    ) -> impl Future<Output = Result<Vec<(Uuid, String)>>> + Send;
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

/// What a guard looks for: an operation on `entity_key` created since `since` by one of
/// `tools` (with `fingerprint`, when given) that has not failed, been refused or been
/// undone — other than the proposal's own key (a key hit is a `key` dedupe instead).
pub(crate) struct GuardProbe<'a> {
    pub entity_key: &'a str,
    pub tools: &'a [String],
    pub since: OffsetDateTime,
    pub fingerprint: Option<&'a str>,
    pub namespace: &'a str,
    pub exclude_key: &'a str,
}

/// The statuses that no longer count for a guard ([`Status::never_acts`]).
pub(crate) static GUARD_IGNORES: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| Status::sql_list(Status::never_acts));

/// For each fresh, accepted proposal whose tool has guards: the reason and the key of
/// the operation that suppresses it — an earlier proposal of this batch that becomes an
/// operation, or a recent operation in the ledger.
///
/// The key decides first: a proposal whose own key already names an operation (in the
/// ledger or earlier in the batch) is a key dedupe or conflict, never a guard hit. Each
/// guarded entity is locked for the transaction ([`Tx::lock_entity`], in sorted order) so
/// two transactions cannot both find "nothing yet" and both act.
async fn guard_hits<T: Tx>(
    tx: &mut T,
    batch: &[IngestItem],
    fresh: &[bool],
    now: OffsetDateTime,
) -> Result<Vec<Option<(&'static str, (String, String))>>> {
    let mut hits = vec![None; batch.len()];
    let guarded: Vec<(usize, &Envelope)> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, item)| match item {
            IngestItem::Accepted(env) if fresh[i] && !env.guards.is_empty() => Some((i, &**env)),
            _ => None,
        })
        .collect();
    if guarded.is_empty() {
        return Ok(hits);
    }
    let entities: std::collections::BTreeSet<&str> = guarded
        .iter()
        .map(|(_, env)| env.entity_key.as_str())
        .collect();
    for entity in entities {
        tx.lock_entity(entity).await?;
    }
    // Whether a key already names an operation in the ledger (asked at most once per key).
    let mut known: HashMap<(String, String), bool> = HashMap::new();
    for (i, env) in guarded {
        let own = (env.key.namespace.clone(), env.key.key.clone());
        let earlier_same_key = batch[..i].iter().enumerate().any(|(j, other)| {
            matches!(other, IngestItem::Accepted(o)
                if fresh[j] && o.key.namespace == own.0 && o.key.key == own.1)
        });
        if earlier_same_key || exists(tx, &mut known, &own).await? {
            continue;
        }
        for guard in &env.guards {
            // A window reaching before the epoch (or past what time can represent)
            // covers everything.
            let since = time::Duration::try_from(guard.window)
                .ok()
                .and_then(|w| now.checked_sub(w))
                .unwrap_or(OffsetDateTime::UNIX_EPOCH);
            // An earlier proposal of this batch that becomes a new operation.
            let mut found = None;
            for (j, other) in batch[..i].iter().enumerate() {
                let IngestItem::Accepted(o) = other else {
                    continue;
                };
                let candidate = fresh[j]
                    && hits[j].is_none()
                    && o.entity_key == env.entity_key
                    && o.key.key != env.key.key
                    && guard.tools.contains(&o.tool)
                    && (!guard.same_args || o.args_fingerprint == env.args_fingerprint);
                let key = (o.key.namespace.clone(), o.key.key.clone());
                if candidate && !exists(tx, &mut known, &key).await? {
                    found = Some(key);
                    break;
                }
            }
            if found.is_none() {
                found = tx
                    .lock_guarded(&GuardProbe {
                        entity_key: &env.entity_key,
                        tools: &guard.tools,
                        since,
                        fingerprint: guard.same_args.then_some(env.args_fingerprint.as_str()),
                        namespace: &env.key.namespace,
                        exclude_key: &env.key.key,
                    })
                    .await?
                    .map(|op| (op.namespace, op.idempotency_key));
            }
            if let Some(key) = found {
                hits[i] = Some((guard.reason, key));
                break;
            }
        }
    }
    Ok(hits)
}

/// Whether `key` names an operation in the ledger, remembered in `known`.
async fn exists<T: Tx>(
    tx: &mut T,
    known: &mut HashMap<(String, String), bool>,
    key: &(String, String),
) -> Result<bool> {
    if let Some(&hit) = known.get(key) {
        return Ok(hit);
    }
    let hit = tx.lock_operation_by_key(&key.0, &key.1).await?.is_some();
    known.insert(key.clone(), hit);
    Ok(hit)
}

fn add(at: OffsetDateTime, d: Duration) -> OffsetDateTime {
    at + time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

/// The result row for an operation's current state, bumping its sequence number.
fn result_row(
    op: &mut Operation,
    event_id: &str,
    dedupe: Dedupe,
    at: OffsetDateTime,
) -> Result<NewOutbox> {
    op.result_seq += 1;
    let message = ResultMessage::for_operation(op, event_id, dedupe, op.result_seq, at);
    Ok(NewOutbox {
        operation_id: Some(op.operation_id),
        seq: op.result_seq,
        status: message.status.clone(),
        kafka_key: format!("{}:{}", op.entity.kind, op.entity.id),
        payload: serde_json::to_value(&message).map_err(|e| Error::Corrupt(e.to_string()))?,
        at,
    })
}

/// The result row for a refused proposal.
fn rejection_row(rejected: &RejectedProposal, at: OffsetDateTime) -> Result<NewOutbox> {
    let message = ResultMessage::for_rejection(rejected, at);
    Ok(NewOutbox {
        operation_id: None,
        seq: 0,
        status: message.status.clone(),
        kafka_key: rejected.kafka_key(),
        payload: serde_json::to_value(&message).map_err(|e| Error::Corrupt(e.to_string()))?,
        at,
    })
}

/// Appends a result for the operation's current state (bumping its sequence number).
async fn publish<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    event_id: &str,
    dedupe: Dedupe,
    at: OffsetDateTime,
) -> Result<()> {
    let row = result_row(op, event_id, dedupe, at)?;
    tx.insert_outbox(&row).await
}

fn new_operation(env: &Envelope, at: OffsetDateTime) -> Operation {
    Operation::from_envelope(env, Uuid::now_v7(), at)
}

/// Ingests a batch (see [`crate::Ledger::ingest`]) with a fixed number of statements per
/// batch on the hot path: inbox rows, new operations, history, queue, results and inbox
/// decisions are each written in one statement. Duplicates (a minority) are resolved row
/// by row against the operations they hit.
pub(crate) async fn ingest<T: Tx>(tx: &mut T, batch: &[IngestItem]) -> Result<Vec<IngestOutcome>> {
    let now = tx.now().await?;
    let keys: Vec<String> = batch.iter().map(IngestItem::inbox_key).collect();
    let deliveries: Vec<NewInbox<'_>> = batch
        .iter()
        .zip(&keys)
        .map(|(item, key)| {
            let delivery = match item {
                IngestItem::Accepted(env) => &env.delivery,
                IngestItem::Rejected(rej) => &rej.delivery,
            };
            (key.as_str(), delivery, item.content_fingerprint())
        })
        .collect();
    // The inbox row is claimed first: a concurrent transaction ingesting the same event
    // waits here and then finds it, so an event is decided exactly once.
    let fresh = tx.insert_inbox_batch(&deliveries, now).await?;
    // Policies beside the key (dedupe window, exclusive group) decide before the key.
    let guarded = guard_hits(tx, batch, &fresh, now).await?;

    // Every other fresh, accepted proposal is a candidate operation; the unique key decides.
    let mut candidates = Vec::new();
    let mut candidate_of = vec![None; batch.len()];
    for (i, item) in batch.iter().enumerate() {
        if guarded[i].is_some() {
            continue;
        }
        if let (true, IngestItem::Accepted(env)) = (fresh[i], item) {
            let mut op = new_operation(env, now);
            op.result_seq = 1;
            candidate_of[i] = Some(candidates.len());
            candidates.push(op);
        }
    }
    let created = tx.insert_operations_batch(&candidates).await?;

    let mut events = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    let mut decisions: Vec<(usize, IngestDecision, Option<Uuid>)> = Vec::new();
    // What the duplicates need, read in a few statements rather than one or two per row:
    // the inbox rows (and operations) of redelivered events, the operations named by
    // keys that already existed.
    let redelivered: Vec<&str> = (0..batch.len())
        .filter(|&i| !fresh[i])
        .map(|i| deliveries[i].0)
        .collect();
    let inbox_rows = tx.inbox_batch(&redelivered).await?;
    let prior_ids: Vec<Uuid> = inbox_rows.values().filter_map(|r| r.operation_id).collect();
    let prior = tx.read_operations(&prior_ids).await?;
    let mut dup_keys: Vec<(String, String)> = candidates
        .iter()
        .zip(&created)
        .filter(|(_, created)| !**created)
        .map(|(op, _)| (op.namespace.clone(), op.idempotency_key.clone()))
        .collect();
    dup_keys.sort();
    dup_keys.dedup();
    let mut existing_by_key = tx.lock_operations_by_keys(&dup_keys).await?;
    // Existing operations hit by duplicates in this batch, by key, as they stand now.
    let mut hit: HashMap<(String, String), Operation> = HashMap::new();
    let mut decided: HashMap<&str, (IngestDecision, Option<Operation>, Option<&str>)> =
        HashMap::new();
    let mut outcomes = Vec::with_capacity(batch.len());
    for (i, item) in batch.iter().enumerate() {
        let inbox_key = deliveries[i].0;
        let event_id = item.event_id();
        if !fresh[i] {
            // A redelivery: of an event decided earlier in this batch, or in an earlier one.
            let (decision, operation, first) = match decided.get(inbox_key) {
                Some((decision, op, fingerprint)) => {
                    (decision.clone(), op.clone(), fingerprint.map(str::to_owned))
                }
                None => {
                    let row = inbox_rows
                        .get(inbox_key)
                        .ok_or_else(|| Error::Corrupt(format!("inbox row {inbox_key} vanished")))?;
                    let operation = row.operation_id.and_then(|id| prior.get(&id).cloned());
                    (
                        IngestDecision::from_row(&row.decision, row.reason.clone()),
                        operation,
                        row.fingerprint.clone(),
                    )
                }
            };
            if let (Some(first), Some(this)) = (first.as_deref(), item.content_fingerprint()) {
                if first != this {
                    // The same event id with other content: not a redelivery. Answered
                    // as refused; the first decision stands.
                    outbox.push(rejection_row(&event_id_conflict(item, &decision), now)?);
                    outcomes.push(IngestOutcome {
                        event_id: event_id.to_owned(),
                        decision: IngestDecision::Rejected {
                            reason: "event_id_conflict".into(),
                        },
                        inbox_hit: false,
                        operation: None,
                    });
                    continue;
                }
            }
            outcomes.push(IngestOutcome {
                event_id: event_id.to_owned(),
                decision,
                inbox_hit: true,
                operation,
            });
            continue;
        }
        let (decision, operation) = match item {
            IngestItem::Rejected(rejected) => {
                outbox.push(rejection_row(rejected, now)?);
                let reason = rejected.rejection.reason.to_owned();
                (IngestDecision::Rejected { reason }, None)
            }
            IngestItem::Accepted(env) if guarded[i].is_some() => {
                let Some((reason, key)) = guarded[i].clone() else {
                    return Err(Error::Corrupt("guard lost".into()));
                };
                let mut existing = match hit.remove(&key) {
                    Some(op) => op,
                    None => tx
                        .lock_operation_by_key(&key.0, &key.1)
                        .await?
                        .ok_or_else(|| {
                            Error::Corrupt(format!("operation for key {} vanished", key.1))
                        })?,
                };
                outbox.push(result_row(
                    &mut existing,
                    &env.event_id,
                    Dedupe::hit(reason),
                    now,
                )?);
                hit.insert(key, existing.clone());
                let reason = reason.to_owned();
                (IngestDecision::Deduplicated { reason }, Some(existing))
            }
            IngestItem::Accepted(env) => {
                let c = candidate_of[i].ok_or_else(|| Error::Corrupt("candidate lost".into()))?;
                if created[c] {
                    let mut op = candidates[c].clone();
                    op.result_seq = 0;
                    outbox.push(result_row(&mut op, &env.event_id, Dedupe::miss(), now)?);
                    events.push(c);
                    queue.push(c);
                    (IngestDecision::Accepted, Some(op))
                } else {
                    let key = (env.key.namespace.clone(), env.key.key.clone());
                    let existing = match hit.remove(&key) {
                        Some(op) => op,
                        None => existing_by_key.remove(&key).ok_or_else(|| {
                            Error::Corrupt(format!("operation for key {} vanished", key.1))
                        })?,
                    };
                    let (decision, existing) = duplicate(env, existing, now, &mut outbox)?;
                    hit.insert(key, existing.clone());
                    (decision, Some(existing))
                }
            }
        };
        decisions.push((
            i,
            decision.clone(),
            operation.as_ref().map(|o| o.operation_id),
        ));
        decided.insert(
            inbox_key,
            (
                decision.clone(),
                operation.clone(),
                item.content_fingerprint(),
            ),
        );
        outcomes.push(IngestOutcome {
            event_id: event_id.to_owned(),
            decision,
            inbox_hit: false,
            operation,
        });
    }

    let created_events: Vec<NewEvent<'_>> = events
        .iter()
        .map(|&c| NewEvent {
            operation_id: candidates[c].operation_id,
            from: None,
            to: candidates[c].status,
            reason: "ingested",
            attempt_id: None,
            epoch: 0,
            actor: None,
            at: now,
            detail: None,
        })
        .collect();
    tx.insert_events_batch(&created_events).await?;
    let queue_rows: Vec<(&Operation, QueueState)> = queue
        .iter()
        .map(|&c| (&candidates[c], QueueState::of(candidates[c].status)))
        .collect();
    tx.put_queue_batch(&queue_rows, now).await?;
    tx.insert_outbox_batch(&outbox).await?;
    for op in hit.values() {
        tx.update_operation(op).await?;
    }
    // A dedupe outcome reports the operation as it stands after the whole batch.
    for outcome in &mut outcomes {
        if let Some(op) = &mut outcome.operation {
            if let Some(latest) = hit.get(&(op.namespace.clone(), op.idempotency_key.clone())) {
                *op = latest.clone();
            }
        }
    }
    let inbox_rows: Vec<(&str, &IngestDecision, Option<Uuid>)> = decisions
        .iter()
        .map(|(i, decision, op)| (deliveries[*i].0, decision, *op))
        .collect();
    tx.set_inbox_batch(&inbox_rows).await?;
    Ok(outcomes)
}

/// The refusal of a proposal that reuses an event id with other content.
fn event_id_conflict(item: &IngestItem, first: &IngestDecision) -> RejectedProposal {
    let mut rejected = match item {
        IngestItem::Accepted(env) => RejectedProposal {
            event_id: env.event_id.clone(),
            delivery: env.delivery.clone(),
            namespace: Some(env.key.namespace.clone()),
            workflow_id: env.workflow_id.clone(),
            step: env.step,
            tool: Some(env.tool.clone()),
            entity: Some(env.entity.clone()),
            rejection: Rejection {
                reason: "event_id_conflict",
                message: String::new(),
            },
            content_fingerprint: Some(env.content_fingerprint.clone()),
        },
        IngestItem::Rejected(r) => (**r).clone(),
    };
    rejected.rejection = Rejection {
        reason: "event_id_conflict",
        message: format!(
            "event id `{}` was already used by a proposal with other content (decided {}); a new proposal needs a new event id",
            rejected.event_id,
            first.as_str()
        ),
    };
    rejected
}

/// A proposal whose key names an existing operation: a dedupe hit (a new result with the
/// next sequence number), or a key conflict when the tool differs or, for the
/// workflow_step strategy, the arguments differ.
fn duplicate(
    env: &Envelope,
    mut existing: Operation,
    now: OffsetDateTime,
    outbox: &mut Vec<NewOutbox>,
) -> Result<(IngestDecision, Operation)> {
    let conflict = if existing.tool != env.tool {
        Some(format!(
            "key `{}` already names operation {} of tool `{}`; give the tools distinct key templates",
            env.key.key, existing.operation_id, existing.tool
        ))
    } else if env.key_strategy == KeyStrategy::WorkflowStep
        && existing.args_fingerprint != env.args_fingerprint
    {
        Some(format!(
            "key `{}` already names operation {} with different arguments; a new step is needed",
            env.key.key, existing.operation_id
        ))
    } else {
        None
    };
    if let Some(message) = conflict {
        let rejected = RejectedProposal {
            event_id: env.event_id.clone(),
            delivery: env.delivery.clone(),
            namespace: Some(env.key.namespace.clone()),
            workflow_id: env.workflow_id.clone(),
            step: env.step,
            tool: Some(env.tool.clone()),
            entity: Some(env.entity.clone()),
            rejection: Rejection {
                reason: "key_conflict",
                message,
            },
            content_fingerprint: Some(env.content_fingerprint.clone()),
        };
        outbox.push(rejection_row(&rejected, now)?);
        let decision = IngestDecision::Rejected {
            reason: "key_conflict".into(),
        };
        return Ok((decision, existing));
    }
    outbox.push(result_row(
        &mut existing,
        &env.event_id,
        Dedupe::hit("key"),
        now,
    )?);
    let decision = IngestDecision::Deduplicated {
        reason: "key".into(),
    };
    Ok((decision, existing))
}

/// Claims work for a dispatcher (see [`crate::Ledger::claim`]).
pub(crate) async fn claim<T: Tx>(tx: &mut T, request: &ClaimRequest) -> Result<Vec<Claim>> {
    let now = tx.now().await?;
    let mut room = request.tool_room.clone();
    let full: Vec<String> = room
        .iter()
        .filter(|(_, free)| **free == 0)
        .map(|(tool, _)| tool.clone())
        .collect();
    let picked = tx.pick_claimable(now, request.limit, &full).await?;
    let mut chosen = Vec::with_capacity(picked.len());
    for (id, tool) in picked {
        // Sized by the tool's free permits: the rest stay queued for the next claim.
        if let Some(free) = room.get_mut(&tool) {
            if *free == 0 {
                continue;
            }
            *free -= 1;
        }
        chosen.push(id);
    }
    let mut locked = tx.try_lock_operations(&chosen).await?;
    let mut claims = Vec::with_capacity(chosen.len());
    let mut attempts = Vec::new();
    let mut events = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    for id in chosen {
        let Some(mut op) = locked.remove(&id) else {
            continue;
        };
        let from = op.status;
        let Ok(to) = transition(from, Event::Claim) else {
            // The queue row disagrees with the operation (a bug or a manual edit): repair
            // the row from the operation and keep claiming the others.
            tracing::warn!(operation_id = %id, status = %from, "queue row out of step with its operation; repaired");
            tx.put_queue(&op, QueueState::of(from), now, now).await?;
            continue;
        };
        op.status = to;
        op.attempt_count += 1;
        op.lease_epoch += 1;
        op.lease_owner = Some(request.owner.clone());
        op.lease_expires_at = Some(add(now, request.lease));
        op.first_attempt_at.get_or_insert(now);
        op.next_attempt_at = None;
        op.updated_at = now;
        let attempt_id = Uuid::now_v7();
        attempts.push(NewAttempt {
            attempt_id,
            operation_id: id,
            number: op.attempt_count,
            epoch: op.lease_epoch,
            worker: &request.owner,
            started_at: now,
        });
        events.push(NewEvent {
            operation_id: id,
            from: Some(from),
            to,
            reason: "claimed",
            attempt_id: Some(attempt_id),
            epoch: op.lease_epoch,
            actor: Some(&request.owner),
            at: now,
            detail: None,
        });
        let event_id = op.event_id.clone();
        outbox.push(result_row(&mut op, &event_id, Dedupe::miss(), now)?);
        queue.push(op.clone());
        claims.push(Claim {
            first_attempt_at: op.first_attempt_at,
            operation: op,
            attempt_id: Some(attempt_id),
            claimed_at: now,
        });
    }
    tx.insert_attempts_batch(&attempts).await?;
    tx.insert_events_batch(&events).await?;
    let queue_rows: Vec<(&Operation, QueueState, OffsetDateTime)> = queue
        .iter()
        .map(|op| (op, QueueState::Inflight, now))
        .collect();
    tx.put_queue_rows(&queue_rows, now).await?;
    tx.insert_outbox_batch(&outbox).await?;
    tx.update_operations_batch(&queue).await?;
    Ok(claims)
}

/// What a transition writes beside the state.
struct Change<'a> {
    event: Event,
    reason: &'a str,
    attempt_id: Option<Uuid>,
    actor: Option<&'a str>,
    next_in: Option<Duration>,
    detail: Option<serde_json::Value>,
    ambiguity: Ambiguity,
}

/// Applies one transition to a locked operation and writes everything that goes with it.
/// When the operation is a compensation that just settled, the operation it undoes
/// leaves `compensating` in the same transaction: `compensated` if it succeeded, back to
/// `completed_success` (its effect still stands) if it did not.
async fn change<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    c: Change<'_>,
    now: OffsetDateTime,
) -> Result<std::result::Result<(), Error>> {
    if let Err(e) = change_one(tx, op, c, now).await? {
        return Ok(Err(e));
    }
    let Some(original_id) = op.compensates else {
        return Ok(Ok(()));
    };
    if !op.status.is_terminal() {
        return Ok(Ok(()));
    }
    let Some(mut original) = tx.lock_operation(original_id).await? else {
        return Err(Error::Corrupt(format!(
            "operation {} compensates {original_id}, which is missing",
            op.operation_id
        )));
    };
    if original.status != Status::Compensating {
        return Ok(Ok(()));
    }
    let succeeded = matches!(op.status, Status::CompletedSuccess | Status::CompletedNoop);
    let (event, reason) = if succeeded {
        (Event::CompensationSucceeded, "compensation_succeeded")
    } else {
        (Event::CompensationFailed, "compensation_failed")
    };
    original.lease_epoch += 1;
    change_one(
        tx,
        &mut original,
        Change {
            event,
            reason,
            attempt_id: None,
            actor: None,
            next_in: None,
            detail: Some(json!({"compensation": op.operation_id, "status": op.status.as_str()})),
            ambiguity: Ambiguity::Keep,
        },
        now,
    )
    .await?
    .map_err(|e| Error::Corrupt(format!("settling the compensated operation: {e}")))?;
    Ok(Ok(()))
}

/// [`change`] without the compensation follow-up.
async fn change_one<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    c: Change<'_>,
    now: OffsetDateTime,
) -> Result<std::result::Result<(), Error>> {
    let planned = match plan_change(op, c, now)? {
        Ok(planned) => planned,
        Err(e) => return Ok(Err(e)),
    };
    tx.insert_event(&planned.event).await?;
    tx.put_queue(op, planned.queue, planned.ready_at, now)
        .await?;
    if let Some(row) = &planned.outbox {
        tx.insert_outbox(row).await?;
    }
    tx.update_operation(op).await?;
    Ok(Ok(()))
}

/// The writes a transition makes besides the operation row itself.
struct Planned<'a> {
    event: NewEvent<'a>,
    queue: QueueState,
    ready_at: OffsetDateTime,
    outbox: Option<NewOutbox>,
}

/// Applies one transition to an operation in memory and says what to write: the history
/// event, the queue row, and a result row when the state changed.
fn plan_change<'a>(
    op: &mut Operation,
    c: Change<'a>,
    now: OffsetDateTime,
) -> Result<std::result::Result<Planned<'a>, Error>> {
    let from = op.status;
    let to = match transition(from, c.event) {
        Ok(to) => to,
        Err(source) => {
            return Ok(Err(Error::IllegalTransition {
                operation_id: op.operation_id,
                source,
            }));
        }
    };
    let mut detail = c.detail;
    if from == Status::UnknownOutcome && to != Status::UnknownOutcome {
        if let Some(since) = op.unknown_since.take() {
            let waited = (now - since).whole_milliseconds();
            let mut d = detail.unwrap_or_else(|| json!({}));
            d["unknown_for_ms"] = json!(waited);
            detail = Some(d);
        }
    }
    if to == Status::UnknownOutcome && from != Status::UnknownOutcome {
        op.unknown_since = Some(now);
    }
    op.status = to;
    op.ambiguous_since = c.ambiguity.apply(op.ambiguous_since);
    op.lease_owner = None;
    op.lease_expires_at = None;
    op.next_attempt_at = c.next_in.map(|d| add(now, d));
    if matches!(to, Status::CompletedSuccess | Status::CompletedNoop) {
        op.error = None;
    }
    op.updated_at = now;
    let event = NewEvent {
        operation_id: op.operation_id,
        from: Some(from),
        to,
        reason: c.reason,
        attempt_id: c.attempt_id,
        epoch: op.lease_epoch,
        actor: c.actor,
        at: now,
        detail,
    };
    let outbox = if from != to {
        let event_id = op.event_id.clone();
        Some(result_row(op, &event_id, Dedupe::miss(), now)?)
    } else {
        None
    };
    Ok(Ok(Planned {
        event,
        queue: QueueState::of(to),
        ready_at: op.next_attempt_at.unwrap_or(now),
        outbox,
    }))
}

/// Records outcomes (see [`crate::Ledger::record`]) with a fixed number of statements
/// per batch: the operations are locked in one statement, each transition is planned in
/// memory, and events, queue rows, result rows, operations and attempts are each written
/// in one statement (row by row where a backend has no batched form). A compensation
/// settles its original in the same transaction, so a batch holding one takes the
/// one-by-one path.
pub(crate) async fn record<T: Tx>(
    tx: &mut T,
    recordings: &[Recording],
) -> Result<Vec<Result<Operation>>> {
    let now = tx.now().await?;
    let ids: Vec<Uuid> = recordings.iter().map(|r| r.operation_id).collect();
    let distinct: std::collections::HashSet<&Uuid> = ids.iter().collect();
    let mut locked = tx.lock_operations(&ids).await?;
    if distinct.len() != ids.len() || locked.values().any(|op| op.compensates.is_some()) {
        return record_one_by_one(tx, recordings, locked, now).await;
    }
    let mut results = Vec::with_capacity(recordings.len());
    let mut events = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    let mut finished = Vec::new();
    let mut changed = Vec::new();
    for rec in recordings {
        let Some(mut op) = locked.remove(&rec.operation_id) else {
            results.push(Err(Error::NotFound(rec.operation_id)));
            continue;
        };
        if let Err(e) = fence_and_fill(&mut op, rec) {
            results.push(Err(e));
            continue;
        }
        match plan_change(&mut op, recording_change(rec), now)? {
            Err(e) => results.push(Err(e)),
            Ok(planned) => {
                events.push(planned.event);
                queue.push((op.clone(), planned.queue, planned.ready_at));
                outbox.extend(planned.outbox);
                if let Some((attempt_id, report)) = &rec.attempt {
                    finished.push((op.operation_id, *attempt_id, report));
                }
                changed.push(op.clone());
                results.push(Ok(op));
            }
        }
    }
    tx.insert_events_batch(&events).await?;
    let queue_rows: Vec<(&Operation, QueueState, OffsetDateTime)> =
        queue.iter().map(|(op, q, r)| (op, *q, *r)).collect();
    tx.put_queue_rows(&queue_rows, now).await?;
    tx.insert_outbox_batch(&outbox).await?;
    tx.update_operations_batch(&changed).await?;
    tx.finish_attempts_batch(&finished, now).await?;
    Ok(results)
}

/// The epoch check and the fields a recording carries besides the transition.
fn fence_and_fill(op: &mut Operation, rec: &Recording) -> Result<()> {
    if op.lease_epoch != rec.epoch {
        return Err(Error::StaleEpoch {
            operation_id: rec.operation_id,
            presented: rec.epoch,
            current: op.lease_epoch,
        });
    }
    if let Some(result) = &rec.result {
        op.result = Some(result.clone());
    }
    if rec.external_object_id.is_some() {
        op.external_object_id.clone_from(&rec.external_object_id);
    }
    if rec.external_request_id.is_some() {
        op.external_request_id.clone_from(&rec.external_request_id);
    }
    if rec.error.is_some() {
        op.error.clone_from(&rec.error);
    }
    Ok(())
}

fn recording_change(rec: &Recording) -> Change<'_> {
    Change {
        event: rec.event,
        reason: &rec.reason,
        attempt_id: rec.attempt.as_ref().map(|(id, _)| *id),
        actor: None,
        next_in: rec.next_in,
        detail: None,
        ambiguity: rec.ambiguity,
    }
}

/// [`record`] one recording at a time (a compensation among them, or an operation
/// twice): each change goes through [`change`], which settles a compensation's original.
async fn record_one_by_one<T: Tx>(
    tx: &mut T,
    recordings: &[Recording],
    mut locked: HashMap<Uuid, Operation>,
    now: OffsetDateTime,
) -> Result<Vec<Result<Operation>>> {
    let mut results = Vec::with_capacity(recordings.len());
    for rec in recordings {
        // An operation recorded twice in one batch: its second recording sees the first.
        let op = match locked.remove(&rec.operation_id) {
            Some(op) => Some(op),
            None => tx.read_operation(rec.operation_id).await?,
        };
        let Some(mut op) = op else {
            results.push(Err(Error::NotFound(rec.operation_id)));
            continue;
        };
        if let Err(e) = fence_and_fill(&mut op, rec) {
            results.push(Err(e));
            continue;
        }
        if let Err(e) = change(tx, &mut op, recording_change(rec), now).await? {
            results.push(Err(e));
            continue;
        }
        if let Some((attempt_id, report)) = &rec.attempt {
            tx.finish_attempt(op.operation_id, *attempt_id, report, now)
                .await?;
        }
        results.push(Ok(op));
    }
    Ok(results)
}

/// Expires leases and claims ambiguous operations (see [`crate::Ledger::claim_reconcile`]).
pub(crate) async fn claim_reconcile<T: Tx>(
    tx: &mut T,
    request: &ClaimRequest,
) -> Result<Vec<Claim>> {
    let now = tx.now().await?;
    for id in tx.pick_expired(now, request.limit).await? {
        let Some(mut op) = tx.try_lock_operation(id).await? else {
            continue;
        };
        let lost_by = op.lease_owner.clone();
        // The lost attempt started when it was claimed (the last update before now): an
        // effect may exist from then on.
        let claimed_at = op.updated_at;
        // The lease holder lost it: fence it off before anyone acts on the operation.
        op.lease_epoch += 1;
        op.error = Some(ErrorInfo {
            category: "lease_expired".into(),
            retryable: false,
            retry_after_seconds: None,
            message: Some(format!(
                "the lease of {} expired before an outcome was recorded",
                lost_by.as_deref().unwrap_or("a worker")
            )),
        });
        let changed = change(
            tx,
            &mut op,
            Change {
                event: Event::OutcomeUnknown,
                reason: "lease_expired",
                attempt_id: None,
                actor: None,
                next_in: None,
                detail: Some(json!({ "lease_owner": lost_by })),
                ambiguity: Ambiguity::Since(claimed_at),
            },
            now,
        )
        .await?;
        changed?;
    }
    let mut claims = Vec::new();
    for id in tx.pick_reconcilable(now, request.limit).await? {
        let Some(mut op) = tx.try_lock_operation(id).await? else {
            continue;
        };
        op.lease_epoch += 1;
        op.lease_owner = Some(request.owner.clone());
        op.lease_expires_at = Some(add(now, request.lease));
        op.updated_at = now;
        tx.update_operation(&op).await?;
        claims.push(Claim {
            first_attempt_at: op.first_attempt_at,
            operation: op,
            attempt_id: None,
            claimed_at: now,
        });
    }
    Ok(claims)
}

/// Applies a command (see [`crate::Ledger::apply`]).
pub(crate) async fn apply<T: Tx>(tx: &mut T, command: &Command) -> Result<Operation> {
    let now = tx.now().await?;
    let mut op = tx
        .lock_operation(command.operation_id)
        .await?
        .ok_or(Error::NotFound(command.operation_id))?;
    if let Some(message) = policy::command_refusal(command.event, op.ambiguous_since) {
        return Err(Error::Conflict(message));
    }
    // Fence whoever holds a lease: their late recording must not overwrite a person.
    op.lease_epoch += 1;
    if let Some(result) = &command.result {
        op.result = Some(result.clone());
    }
    change(
        tx,
        &mut op,
        Change {
            event: command.event,
            reason: &command.reason,
            attempt_id: None,
            actor: Some(&command.actor),
            next_in: None,
            detail: None,
            // A person's resolution settles the ambiguity (they checked the provider).
            ambiguity: match command.event {
                Event::Resolve(_) => Ambiguity::Clear,
                _ => Ambiguity::Keep,
            },
        },
        now,
    )
    .await??;
    Ok(op)
}

/// Starts a compensation (see [`crate::Ledger::compensate`]).
pub(crate) async fn compensate<T: Tx>(
    tx: &mut T,
    request: &CompensationRequest,
) -> Result<(Operation, Operation)> {
    let now = tx.now().await?;
    let mut original = tx
        .lock_operation(request.operation_id)
        .await?
        .ok_or(Error::NotFound(request.operation_id))?;
    // The compensation's key: the tool's own, or — when an earlier compensation of this
    // operation failed — the same with `:retry{n}`, a new identity for a deliberate new
    // attempt (the failed one stays in the ledger as it ended).
    let mut envelope = request.envelope.clone();
    let base = envelope.key.key.clone();
    for attempt in 1.. {
        let Some(existing) = tx
            .lock_operation_by_key(&envelope.key.namespace, &envelope.key.key)
            .await?
        else {
            break;
        };
        let ours = existing.compensates == Some(original.operation_id);
        let failed = matches!(
            existing.status,
            Status::FailedPermanent | Status::Cancelled | Status::Rejected
        );
        if ours && !failed {
            // Asked again while (or after) the compensation runs: the same compensation.
            return Ok((original, existing));
        }
        if !ours || attempt >= 100 {
            return Err(Error::Conflict(format!(
                "the compensation's key `{}` already names operation {} ({}); resolve it by hand",
                envelope.key.key,
                existing.operation_id,
                existing.status.as_str()
            )));
        }
        envelope.key.key = format!("{base}:retry{}", attempt + 1);
        if let Some(components) = envelope.key.components.as_object_mut() {
            components.insert("compensation_attempt".into(), json!(attempt + 1));
        }
    }
    let key = &envelope.key;
    original.lease_epoch += 1;
    change(
        tx,
        &mut original,
        Change {
            event: Event::StartCompensation,
            reason: &request.reason,
            attempt_id: None,
            actor: Some(&request.actor),
            next_in: None,
            detail: None,
            ambiguity: Ambiguity::Keep,
        },
        now,
    )
    .await??;
    let mut compensation = new_operation(&envelope, now);
    compensation.compensates = Some(original.operation_id);
    compensation.result_seq = 1;
    let created = tx
        .insert_operations_batch(std::slice::from_ref(&compensation))
        .await?;
    if created.first() != Some(&true) {
        return Err(Error::Conflict(format!(
            "the compensation's key `{}` was taken concurrently",
            key.key
        )));
    }
    tx.insert_event(&NewEvent {
        operation_id: compensation.operation_id,
        from: None,
        to: compensation.status,
        reason: "compensation",
        attempt_id: None,
        epoch: 0,
        actor: Some(&request.actor),
        at: now,
        detail: Some(json!({"compensates": original.operation_id})),
    })
    .await?;
    tx.put_queue(&compensation, QueueState::of(compensation.status), now, now)
        .await?;
    compensation.result_seq = 0;
    let event_id = compensation.event_id.clone();
    publish(tx, &mut compensation, &event_id, Dedupe::miss(), now).await?;
    tx.update_operation(&compensation).await?;
    Ok((original, compensation))
}
