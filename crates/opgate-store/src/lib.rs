//! The operation ledger: the [`Ledger`] port and its PostgreSQL and SQLite adapters.
//!
//! Every hot path is one transaction per batch:
//! - [`Ledger::ingest`] writes, per proposal, an inbox row, the operation (or finds the
//!   existing one by key), a dispatch-queue row and a result-outbox row;
//! - [`Ledger::ingest_and_claim`] does both in one transaction for a dispatcher in the
//!   same process ([`handoff`]: claim at ingest);
//! - [`Ledger::claim`] leases head-of-line operations (one write in flight per entity,
//!   enforced by a unique partial index), bumps the fencing epoch and persists
//!   `dispatched` plus an attempt row before the caller touches the tool;
//! - [`Ledger::record`] applies an outcome if the epoch still matches: history event,
//!   attempt, queue and result outbox move together;
//! - [`Ledger::claim_reconcile`] turns expired leases into `unknown_outcome` and leases
//!   ambiguous operations to a reconciler;
//! - [`Ledger::relay_round`] feeds the results relay (take, publish, mark;
//!   [`Ledger::claim_results`] and [`Ledger::mark_published`] are its two halves with a
//!   written lease);
//! - [`Ledger::changes`] wakes the dispatcher and the relay when one of the writes above
//!   commits, so they need not wait for their next poll.
//!
//! The algorithm of each path is written once ([`flow`]) over a small per-backend
//! statement set; the backends differ only in SQL dialect and column types. All times
//! come from the database clock, read once per transaction.
#![forbid(unsafe_code)]

mod common;
mod error;
mod flow;
pub mod handoff;
pub mod postgres;
mod schema;
mod signal;
pub mod sqlite;
mod types;

use std::sync::Arc;

pub use error::{Error, Result};
pub use handoff::{Handoff, Offer};
pub use postgres::PgLedger;
pub use schema::SchemaStatus;
pub use signal::Changes;
pub use sqlite::SqliteLedger;
pub use types::*;

use opgate_core::{IngestItem, Operation};
use uuid::Uuid;

/// The ledger port. Kafka ingest, dispatchers, reconcilers, the relay and the admin API
/// all talk to the ledger through this trait only.
#[async_trait::async_trait]
pub trait Ledger: Send + Sync + 'static {
    /// Ingests a batch of proposals in one transaction, in order. A redelivered event
    /// id is an inbox hit and changes nothing; an existing key is a dedupe hit.
    async fn ingest(&self, batch: &[IngestItem]) -> Result<Vec<IngestOutcome>>;

    /// As [`Self::ingest`], except that waiting longer than `lock_wait` for a lock another
    /// transaction holds ends the ingest with an error (neither transient nor
    /// deterministic) and nothing written. For the ingest group commit, whose transaction
    /// carries several partitions' batches: one batch waiting on a lock must not hold up
    /// the others for long (they are then ingested each on its own). The default ingests as usual
    /// (SQLite's single writer makes others wait for the write lock, a busy error that is
    /// retried; PostgreSQL sets `lock_timeout`).
    async fn ingest_waiting_at_most(
        &self,
        batch: &[IngestItem],
        lock_wait: std::time::Duration,
    ) -> Result<Vec<IngestOutcome>> {
        let _ = lock_wait;
        self.ingest(batch).await
    }

    /// As [`Self::ingest_waiting_at_most`], and in the same transaction a claim, as
    /// [`Self::claim`] makes one within `request`'s limit and room, of the operations the
    /// batch created that are ready and head of line on their entity: for a dispatcher in
    /// the same process, which then sends them without a claim of its own. Their lease
    /// runs from the ingest's clock read. Returns the outcomes (a claimed operation's as
    /// claimed) and the claims; the batch's other operations wait for a dispatcher's claim.
    async fn ingest_and_claim(
        &self,
        batch: &[IngestItem],
        lock_wait: std::time::Duration,
        request: &ClaimRequest,
    ) -> Result<(Vec<IngestOutcome>, Vec<Claim>)>;

    /// Leases ready, head-of-line operations and persists `dispatched` and an attempt
    /// for each, before the caller sends anything.
    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claim>>;

    /// Records outcomes in one transaction. Each item succeeds or fails on its own
    /// (stale epoch, illegal transition); a database error fails the batch.
    async fn record(&self, recordings: &[Recording]) -> Result<Vec<Result<Operation>>>;

    /// Moves `dispatched` operations whose lease expired to `unknown_outcome`, then
    /// leases `unknown_outcome` and `acknowledged` operations that are due to a reconciler.
    async fn claim_reconcile(&self, request: &ClaimRequest) -> Result<Vec<Claim>>;

    /// Applies a person's or the admin API's command (approve, reject, cancel, resolve,
    /// start or finish a compensation). Fences any lease holder by bumping the epoch.
    async fn apply(&self, command: &Command) -> Result<Operation>;

    /// Starts compensating a completed operation: it moves to `compensating` and the
    /// compensating operation (`compensates` = the original) is recorded and queued, in
    /// one transaction. Asked again while it runs, it returns the same compensation; after
    /// a failed one, it starts a new attempt keyed `{key}:retry{n}`. Returns the
    /// original and the compensation.
    async fn compensate(&self, request: &CompensationRequest) -> Result<(Operation, Operation)>;

    /// Leases unpublished result rows to a relay, oldest first.
    async fn claim_results(&self, request: &ClaimRequest) -> Result<Vec<OutboxRow>>;

    /// Marks result rows published (after the broker acknowledged them).
    async fn mark_published(&self, ids: &[i64]) -> Result<()>;

    /// One round of the results relay: takes unpublished rows as [`Ledger::claim_results`]
    /// does (oldest first, an operation's rows only with every earlier unpublished one),
    /// hands them to `publish`, and marks the ids it returns published. Returns how many
    /// rows were taken and how many were marked, and whether it stood by for another
    /// relay's turn.
    ///
    /// The default leases the rows, publishes and marks: three steps. On PostgreSQL the
    /// relays take turns instead: a round holds the relay's turn (a transaction-scoped
    /// advisory lock) across the publish, so it writes no lease and locks no row (one
    /// row version fewer per result row), and a round that finds the turn taken takes
    /// nothing. The lease is the transaction's `idle_in_transaction_session_timeout`: a
    /// relay that hangs loses its turn and its rows after the lease, as with a written one.
    async fn relay_round(
        &self,
        request: &ClaimRequest,
        publish: Publish<'_>,
    ) -> Result<RelayRound> {
        let rows = self.claim_results(request).await?;
        if rows.is_empty() {
            return Ok(RelayRound::default());
        }
        let taken = rows.len();
        let acked = publish(rows).await;
        self.mark_published(&acked).await?;
        Ok(RelayRound {
            taken,
            marked: acked.len(),
            standby: false,
        })
    }

    /// One operation.
    async fn operation(&self, id: Uuid) -> Result<Option<Operation>>;

    /// One operation by its key.
    async fn operation_by_key(&self, namespace: &str, key: &str) -> Result<Option<Operation>>;

    /// An operation's history, oldest first.
    async fn events(&self, id: Uuid) -> Result<Vec<OperationEvent>>;

    /// An operation's attempts, oldest first.
    async fn attempts(&self, id: Uuid) -> Result<Vec<Attempt>>;

    /// The result rows written for an operation, oldest first (while kept).
    async fn results(&self, id: Uuid) -> Result<Vec<ResultRecord>>;

    /// Ingest decisions and unknown outcomes since `since` (indexed reads only).
    async fn activity(&self, since: time::OffsetDateTime) -> Result<Activity>;

    /// Up to `limit` operation ids from `low` to `high` inclusive, in order: the ids an id
    /// prefix stands for (`opgate_core::operation::id_prefix_range`), through the primary key.
    async fn ids_between(&self, low: Uuid, high: Uuid, limit: i64) -> Result<Vec<Uuid>>;

    /// Operations matching a filter, newest first, paginated.
    async fn list(&self, filter: &ListFilter) -> Result<Page>;

    /// Deletes inbox rows, finished queue rows and published results older than the
    /// retention. Operations, events and attempts are the ledger of truth and are kept.
    async fn reap(&self, retention: std::time::Duration) -> Result<ReapStats>;

    /// Live operations, queue depth and relay backlog, for gauges.
    async fn stats(&self) -> Result<LedgerStats>;

    /// Whether the schema is the one this build knows.
    async fn schema_status(&self) -> Result<SchemaStatus>;

    /// Wakes the caller when a write transaction (ingest, record, reconcile claim,
    /// command, compensation) has committed, in this process or, on PostgreSQL, in any
    /// process on the same database. Call it inside a Tokio runtime.
    fn changes(&self) -> Changes;

    /// As [`Self::changes`], for a dispatcher: this process's commits wake it only when
    /// they may have left an operation claimable now (an ingest that claimed everything
    /// it created does not; a recording that freed an entity others wait for does).
    /// Another process's commit always wakes it.
    fn claimable_changes(&self) -> Changes;
}

/// A shared ledger handle.
pub type SharedLedger = Arc<dyn Ledger>;

/// What a relay does with one round's rows ([`Ledger::relay_round`]): publishes them, in
/// id order, and returns the ids the broker acknowledged.
pub type Publish<'a> = Box<
    dyn FnOnce(Vec<OutboxRow>) -> std::pin::Pin<Box<dyn Future<Output = Vec<i64>> + Send + 'a>>
        + Send
        + 'a,
>;

/// Opens the ledger a URL names: `postgres://...` or `sqlite://PATH` / `sqlite:PATH`.
/// It refuses a schema newer than this build knows, and one that is not migrated.
pub async fn open(url: &str) -> Result<SharedLedger> {
    let ledger: SharedLedger = if is_postgres(check_scheme(url)?) {
        Arc::new(PgLedger::connect(url).await?)
    } else {
        Arc::new(SqliteLedger::open(url).await?)
    };
    ledger.schema_status().await?.require_current()?;
    Ok(ledger)
}

/// Applies pending migrations to the database a URL names and reports the version.
pub async fn migrate(url: &str) -> Result<SchemaStatus> {
    if is_postgres(check_scheme(url)?) {
        let ledger = PgLedger::connect(url).await?;
        ledger.migrate().await?;
        ledger.schema_status().await
    } else {
        let ledger = SqliteLedger::open(url).await?;
        ledger.migrate().await?;
        ledger.schema_status().await
    }
}

/// Refuses a URL of another database (`mysql://...` is not a SQLite file name).
fn check_scheme(url: &str) -> Result<&str> {
    match url.split_once("://") {
        Some(("postgres" | "postgresql" | "sqlite", _)) | None => Ok(url),
        Some((scheme, _)) => Err(Error::Url(format!(
            "unsupported database URL scheme `{scheme}://`: the ledger is PostgreSQL (postgres://user@host/db) or SQLite (sqlite://PATH)"
        ))),
    }
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// The in-process retry for transient transaction conflicts (deadlock, serialization
/// failure, a lost race on a unique index, a busy SQLite file): a few quick, jittered
/// attempts. Durable retries of operations are a different thing (`opgate_core::retry`).
pub(crate) fn retry_policy() -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(5))
        .with_max_delay(std::time::Duration::from_millis(500))
        .with_max_times(8)
        .with_jitter()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn another_database_s_url_is_refused_naming_the_scheme() {
        for url in ["mysql://root@127.0.0.1/test", "redis://x"] {
            let err = match open(url).await {
                Ok(_) => panic!("{url} opened"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains("unsupported database URL scheme"), "{err}");
            let err = migrate(url).await.expect_err(url).to_string();
            assert!(err.contains(&url[..url.find(':').unwrap_or(0)]), "{err}");
        }
        assert!(check_scheme("sqlite://a.db").is_ok());
        assert!(check_scheme("postgresql://h/db").is_ok());
        assert!(check_scheme("plain/file.db").is_ok());
    }
}
