//! The values that cross the [`crate::Ledger`] port.

use std::time::Duration;

use opgate_core::{ErrorInfo, Event, Operation, Status};
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

/// The ledger's decision for one proposal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestDecision {
    /// A new operation.
    Accepted,
    /// A duplicate: `inbox` (same event id redelivered) or `key` (same business identity).
    Deduplicated {
        /// `inbox` or `key`.
        reason: String,
    },
    /// Refused: an ingest reason such as `unknown_tool`, or `key_conflict`.
    Rejected {
        /// Machine-readable reason.
        reason: String,
    },
}

impl IngestDecision {
    /// The inbox column spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Deduplicated { .. } => "deduplicated",
            Self::Rejected { .. } => "rejected",
        }
    }

    /// The reason, for dedupes and rejections.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Self::Accepted => None,
            Self::Deduplicated { reason } | Self::Rejected { reason } => Some(reason),
        }
    }

    pub(crate) fn from_row(decision: &str, reason: Option<String>) -> Self {
        let reason = reason.unwrap_or_default();
        match decision {
            "accepted" => Self::Accepted,
            "deduplicated" => Self::Deduplicated { reason },
            _ => Self::Rejected { reason },
        }
    }
}

/// What ingest did with one proposal.
#[derive(Debug, Clone, PartialEq)]
pub struct IngestOutcome {
    /// The proposal's event id.
    pub event_id: String,
    /// The decision.
    pub decision: IngestDecision,
    /// Whether this call only found an earlier inbox row (a redelivery).
    pub inbox_hit: bool,
    /// The operation the proposal maps to, as it stands after the batch.
    pub operation: Option<Operation>,
}

/// A request for leased work.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClaimRequest {
    /// Who holds the lease (process id, host).
    pub owner: String,
    /// Lease length on the database clock.
    pub lease: Duration,
    /// Most items to return.
    pub limit: usize,
    /// Dispatch claims only: at most this many operations of each tool listed (its free
    /// per-tool permits), none of a tool listed with 0; tools not listed are bounded by
    /// `limit` alone. A claimed operation then never waits for a permit in-process.
    pub tool_room: std::collections::BTreeMap<String, usize>,
}

/// A leased operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Claim {
    /// The operation after the claim (epoch bumped, lease set).
    pub operation: Operation,
    /// The attempt row persisted for a dispatch claim (`None` for reconcile claims).
    pub attempt_id: Option<Uuid>,
    /// When the first attempt started (for the retry budget's `max_elapsed`).
    pub first_attempt_at: Option<OffsetDateTime>,
    /// The database clock at claim time.
    pub claimed_at: OffsetDateTime,
}

impl Claim {
    /// The fencing epoch to present when recording.
    pub fn epoch(&self) -> i64 {
        self.operation.lease_epoch
    }
}

/// What a dispatch attempt observed, for the attempts table.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AttemptReport {
    /// Outcome label (`committed`, `not_sent`, `timeout_after_send`, ...).
    pub outcome: String,
    /// HTTP status, if any.
    pub http_status: Option<u16>,
    /// Error category, if any.
    pub error_category: Option<String>,
    /// Call latency.
    pub latency: Option<Duration>,
    /// The provider's request id.
    pub provider_request_id: Option<String>,
}

/// An outcome to record for a leased operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Recording {
    /// The operation.
    pub operation_id: Uuid,
    /// The epoch of the caller's lease; a newer epoch in the ledger rejects the recording.
    pub epoch: i64,
    /// The event to apply.
    pub event: Event,
    /// Why, for the history (`committed`, `timeout_after_send`, `lookup_found`, ...).
    pub reason: String,
    /// The attempt this finishes, with what it observed.
    pub attempt: Option<(Uuid, AttemptReport)>,
    /// Delay before the next attempt or lookup (retries, acknowledged, still unknown).
    pub next_in: Option<Duration>,
    /// The normalized result.
    pub result: Option<Value>,
    /// The provider's object id.
    pub external_object_id: Option<String>,
    /// The provider's request id.
    pub external_request_id: Option<String>,
    /// The error, if any (cleared on success when `None`).
    pub error: Option<ErrorInfo>,
    /// What the operation's ambiguity becomes ([`opgate_core::policy`]).
    pub ambiguity: opgate_core::policy::Ambiguity,
}

impl Recording {
    /// A recording with only the required parts.
    pub fn new(operation_id: Uuid, epoch: i64, event: Event, reason: impl Into<String>) -> Self {
        Self {
            operation_id,
            epoch,
            event,
            reason: reason.into(),
            attempt: None,
            next_in: None,
            result: None,
            external_object_id: None,
            external_request_id: None,
            error: None,
            ambiguity: opgate_core::policy::Ambiguity::Keep,
        }
    }
}

/// A command from a person or the admin API.
#[derive(Debug, Clone, PartialEq)]
pub struct Command {
    /// The operation.
    pub operation_id: Uuid,
    /// The event (approve, reject, cancel, resolve, compensation events).
    pub event: Event,
    /// Who (token name or user).
    pub actor: String,
    /// Why.
    pub reason: String,
    /// A result to set (e.g. when resolving as succeeded).
    pub result: Option<Value>,
}

/// What one relay round did ([`crate::Ledger::relay_round`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayRound {
    /// Rows taken and handed to the publish.
    pub taken: usize,
    /// Rows marked published (those the broker acknowledged).
    pub marked: usize,
    /// Another relay held the turn (PostgreSQL), so this round took nothing: the relay
    /// stands by rather than trying again on every commit.
    pub standby: bool,
}

/// One row of the result outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    /// Row id (publication order).
    pub id: i64,
    /// Operation, if any.
    pub operation_id: Option<Uuid>,
    /// Per-operation sequence number.
    pub seq: i64,
    /// Status carried.
    pub status: String,
    /// Kafka key (`{entity_type}:{entity_id}`).
    pub kafka_key: String,
    /// The result message, as the JSON text the relay publishes (not parsed on the way).
    pub payload: String,
    /// The message's `traceparent`, carried as a Kafka header.
    pub traceparent: Option<String>,
}

impl OutboxRow {
    /// The result message, parsed.
    pub fn message(&self) -> serde_json::Result<Value> {
        serde_json::from_str(&self.payload)
    }
}

/// One history entry.
#[derive(Debug, Clone, PartialEq)]
pub struct OperationEvent {
    /// Global order.
    pub event_seq: i64,
    /// Previous state (`None` at creation).
    pub from: Option<Status>,
    /// New state.
    pub to: Status,
    /// Why.
    pub reason: String,
    /// The attempt involved.
    pub attempt_id: Option<Uuid>,
    /// Epoch at the time.
    pub epoch: i64,
    /// Who, for commands.
    pub actor: Option<String>,
    /// When (database clock).
    pub at: OffsetDateTime,
    /// Extra detail.
    pub detail: Option<Value>,
}

/// One dispatch attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    /// Attempt id (sent to the tool).
    pub attempt_id: Uuid,
    /// 1-based number.
    pub number: u32,
    /// Epoch of the claim that made it.
    pub epoch: i64,
    /// Worker.
    pub worker: String,
    /// Started (before the tool was called).
    pub started_at: OffsetDateTime,
    /// Finished, once recorded.
    pub finished_at: Option<OffsetDateTime>,
    /// What it observed.
    pub report: Option<AttemptReport>,
}

/// Filter and page for [`crate::Ledger::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Status.
    pub status: Option<Status>,
    /// Tool.
    pub tool: Option<String>,
    /// Entity, as `{type}:{id}`.
    pub entity: Option<String>,
    /// Namespace.
    pub namespace: Option<String>,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// The proposing agent (an agent token sees only its own operations).
    pub agent_id: Option<String>,
    /// Page size (default 50, at most 500).
    pub limit: Option<usize>,
    /// Cursor from the previous page.
    pub cursor: Option<String>,
}

/// A request to compensate a completed operation.
#[derive(Debug, Clone)]
pub struct CompensationRequest {
    /// The operation to undo (must be `completed_success`).
    pub operation_id: Uuid,
    /// The compensating proposal, prepared by the caller from the tool's
    /// `[tools.compensation]` (`opgate_core::compensation::proposal`).
    pub envelope: opgate_core::Envelope,
    /// Who asked.
    pub actor: String,
    /// Why.
    pub reason: String,
}

/// A result row written for an operation (one per state change; published rows are
/// reaped after the retention).
#[derive(Debug, Clone, PartialEq)]
pub struct ResultRecord {
    /// The operation's result sequence number.
    pub seq: i64,
    /// The state it announces.
    pub status: String,
    /// Written (with the state change, in its transaction).
    pub created_at: OffsetDateTime,
    /// Acknowledged by the broker, once the relay published it.
    pub published_at: Option<OffsetDateTime>,
}

/// What happened in a window, for the console's overview: read from the inbox and the
/// history, so every process's work counts (not one process's counters).
#[derive(Debug, Clone, PartialEq)]
pub struct Activity {
    /// Start of the window.
    pub since: OffsetDateTime,
    /// The database clock when this was read.
    pub now: OffsetDateTime,
    /// Ingest decisions of the event ids first received in the window, per
    /// (decision, reason). A redelivered event id is not counted again: it changes nothing.
    pub decisions: Vec<DecisionCount>,
    /// Operations that entered `unknown_outcome` in the window.
    pub unknown_entered: i64,
    /// Operations that left `unknown_outcome` in the window (at most
    /// [`ACTIVITY_EXITS_MAX`], newest kept).
    pub unknown_exits: Vec<UnknownExit>,
}

/// The most `unknown_outcome` exits [`Activity`] carries.
pub const ACTIVITY_EXITS_MAX: i64 = 100_000;

/// Inbox rows of one decision and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionCount {
    /// `accepted`, `deduplicated` or `rejected`.
    pub decision: String,
    /// The dedupe or rejection reason.
    pub reason: Option<String>,
    /// How many.
    pub count: i64,
}

/// An operation leaving `unknown_outcome`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownExit {
    /// The state it went to.
    pub to: String,
    /// Whether a person's command settled it (else the reconciler did).
    pub by_person: bool,
    /// How long it had been unknown.
    pub waited_ms: Option<i64>,
}

/// The ledger's current shape, for gauges: read when metrics are scraped.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerStats {
    /// Live (non-terminal) operations per (tool, class, status).
    pub live: Vec<LiveCount>,
    /// Dispatch-queue rows per queue state, without finished rows.
    pub queue: Vec<(String, i64)>,
    /// Result rows not yet published.
    pub relay_pending: i64,
    /// When the oldest unpublished result was written.
    pub relay_oldest: Option<OffsetDateTime>,
    /// Result rows a relay round reads among, at most: on PostgreSQL the ids from the relay
    /// floor to the last one, published or not (a transaction held open anywhere on the
    /// server holds the floor back, and this grows); on SQLite the unpublished rows.
    pub relay_window: i64,
    /// The database clock when this was read.
    pub now: OffsetDateTime,
}

/// Live operations of one tool in one state.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveCount {
    /// Tool.
    pub tool: String,
    /// Side-effect class.
    pub class: String,
    /// State.
    pub status: String,
    /// How many.
    pub count: i64,
    /// The oldest last change among them.
    pub oldest_change: OffsetDateTime,
}

/// The live (not terminal) states as an SQL list: `status IN (...)` reads the status
/// index, where `NOT IN (terminal)` would scan every settled operation.
pub(crate) static LIVE_SQL: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| Status::sql_list(|s| !s.is_terminal()));

/// A page of operations.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// Operations, newest first.
    pub operations: Vec<Operation>,
    /// Cursor for the next page, if there is one.
    pub next_cursor: Option<String>,
}

/// What the reaper deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReapStats {
    /// Inbox rows.
    pub inbox: u64,
    /// Published result rows.
    pub results: u64,
}

/// The dispatch-queue state that goes with an operation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueState {
    /// Awaiting approval: neither claimable nor blocking.
    Parked,
    /// Claimable when ready and at the head of its entity.
    Waiting,
    /// Leased to a dispatcher.
    Inflight,
    /// Ambiguous or with a person: blocks its entity, not claimable.
    Held,
    /// Finished: the operation leaves the queue (its row is deleted).
    Done,
}

impl QueueState {
    pub(crate) fn of(status: Status) -> Self {
        match status {
            Status::AwaitingApproval => Self::Parked,
            Status::PendingDispatch | Status::FailedRetryable => Self::Waiting,
            Status::Dispatched => Self::Inflight,
            Status::Acknowledged
            | Status::UnknownOutcome
            | Status::NeedsAttention
            | Status::Compensating => Self::Held,
            Status::CompletedSuccess
            | Status::CompletedNoop
            | Status::FailedPermanent
            | Status::Rejected
            | Status::Cancelled
            | Status::Compensated => Self::Done,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Parked => "parked",
            Self::Waiting => "waiting",
            Self::Inflight => "inflight",
            Self::Held => "held",
            Self::Done => "done",
        }
    }
}
