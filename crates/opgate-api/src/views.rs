//! What the API answers, as types: the handlers serialize them and the CLI (and any Rust
//! client) deserializes the same types, so the two cannot drift apart.

use opgate_core::canonical::format_utc;
use opgate_core::{Entity, ErrorInfo, Operation, Status};
use opgate_store::OperationEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

/// An operation (`GET /v1/operations/{id}`, and inside other answers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperationView {
    /// Its id.
    pub operation_id: Uuid,
    /// Namespace.
    pub namespace: String,
    /// The key opgate derived (and sends to the provider).
    pub idempotency_key: String,
    /// What the key was made of.
    pub key_components: Value,
    /// SHA-256 of the canonical arguments.
    pub args_fingerprint: String,
    /// The event that created it.
    pub event_id: String,
    /// The proposing agent.
    pub agent_id: Option<String>,
    /// Workflow.
    pub workflow_id: Option<String>,
    /// Run.
    pub run_id: Option<String>,
    /// Step.
    pub step: Option<u64>,
    /// Tool.
    pub tool: String,
    /// Intent.
    pub intent: Option<String>,
    /// Entity.
    pub entity: Entity,
    /// Canonical arguments.
    pub canonical_args: Value,
    /// Side-effect class.
    pub side_effect_class: String,
    /// State.
    pub status: String,
    /// What the proposing agent should do next (`none`, `wait_for_result`,
    /// `reconcile_before_retry`, `wait_for_person`, `do_not_retry`).
    pub retry_recommendation: String,
    /// A message safe to show an end user.
    pub safe_user_message: String,
    /// Attempts so far.
    pub attempt_count: u32,
    /// When the next attempt or lookup is due.
    pub next_attempt_at: Option<String>,
    /// Lease holder.
    pub lease_owner: Option<String>,
    /// Fencing epoch.
    pub lease_epoch: i64,
    /// The provider's request id.
    pub external_request_id: Option<String>,
    /// The provider's object id (charge, order, ...).
    pub external_id: Option<String>,
    /// The provider's result.
    pub result: Option<Value>,
    /// The last error.
    pub error: Option<ErrorInfo>,
    /// The operation this one compensates.
    pub compensates: Option<Uuid>,
    /// W3C trace context.
    pub traceparent: Option<String>,
    /// Created (RFC 3339 UTC).
    pub created_at: String,
    /// Last changed (RFC 3339 UTC).
    pub updated_at: String,
}

impl From<&Operation> for OperationView {
    fn from(op: &Operation) -> Self {
        Self {
            operation_id: op.operation_id,
            namespace: op.namespace.clone(),
            idempotency_key: op.idempotency_key.clone(),
            key_components: op.key_components.clone(),
            args_fingerprint: op.args_fingerprint.clone(),
            event_id: op.event_id.clone(),
            agent_id: op.agent_id.clone(),
            workflow_id: op.workflow_id.clone(),
            run_id: op.run_id.clone(),
            step: op.step,
            tool: op.tool.clone(),
            intent: op.intent.clone(),
            entity: op.entity.clone(),
            canonical_args: op.canonical_args.clone(),
            side_effect_class: op.side_effect_class.as_str().to_owned(),
            status: op.status.as_str().to_owned(),
            retry_recommendation: opgate_core::operation::retry_recommendation(op.status)
                .to_owned(),
            safe_user_message: opgate_core::operation::safe_user_message(op.status).to_owned(),
            attempt_count: op.attempt_count,
            next_attempt_at: op.next_attempt_at.map(format_utc),
            lease_owner: op.lease_owner.clone(),
            lease_epoch: op.lease_epoch,
            external_request_id: op.external_request_id.clone(),
            external_id: op.external_object_id.clone(),
            result: op.result.clone(),
            error: op.error.clone(),
            compensates: op.compensates,
            traceparent: op.traceparent.clone(),
            created_at: format_utc(op.created_at),
            updated_at: format_utc(op.updated_at),
        }
    }
}

impl OperationView {
    /// Whether it is settled for a waiting caller: terminal, or waiting for a person.
    pub fn is_settled(&self) -> bool {
        Status::parse(&self.status).is_some_and(|s| s.is_terminal() || s == Status::NeedsAttention)
    }
}

/// A page of operations (`GET /v1/operations`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PageView {
    /// Newest first.
    pub operations: Vec<OperationView>,
    /// Pass as `cursor` for the next page.
    pub next_cursor: Option<String>,
}

/// One history event (`GET /v1/operations/{id}/events`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventView {
    /// Order within the operation.
    pub seq: i64,
    /// State before (none for the first).
    pub from: Option<String>,
    /// State after.
    pub to: String,
    /// Why.
    pub reason: String,
    /// The attempt it belongs to.
    pub attempt_id: Option<Uuid>,
    /// Fencing epoch.
    pub epoch: i64,
    /// Who (a token's name, a worker), if a principal acted.
    pub actor: Option<String>,
    /// When (RFC 3339 UTC).
    pub at: String,
    /// Details.
    pub detail: Option<Value>,
}

impl From<&OperationEvent> for EventView {
    fn from(e: &OperationEvent) -> Self {
        Self {
            seq: e.event_seq,
            from: e.from.map(|s| s.as_str().to_owned()),
            to: e.to.as_str().to_owned(),
            reason: e.reason.clone(),
            attempt_id: e.attempt_id,
            epoch: e.epoch,
            actor: e.actor.clone(),
            at: format_utc(e.at),
            detail: e.detail.clone(),
        }
    }
}

/// An operation's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventsView {
    /// Oldest first.
    pub events: Vec<EventView>,
}

/// The answer to `POST /v1/proposals`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProposalAnswer {
    /// The proposal's event id.
    pub event_id: String,
    /// `accepted`, `deduplicated` or `rejected`.
    pub decision: String,
    /// Why (dedupe reason or rejection reason).
    pub reason: Option<String>,
    /// A rejection's message (names the field at fault).
    pub message: Option<String>,
    /// A redelivery of an event already decided.
    pub inbox_hit: bool,
    /// The operation it created or was merged into.
    pub operation: Option<OperationView>,
}

/// The answer to `POST /v1/operations/{id}/compensate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompensationAnswer {
    /// The original, now `compensating` (or settled).
    pub operation: OperationView,
    /// The compensating operation.
    pub compensation: OperationView,
}

/// An error answer's body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorAnswer {
    /// The error.
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// A stable code.
    pub code: String,
    /// For people.
    pub message: String,
}

/// A tool of the registry as agents see it (`GET /v1/tools`): what to call, what it
/// does, and the JSON Schema of its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolView {
    /// Name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Side-effect class.
    pub side_effect_class: String,
    /// The entity type it acts on, when declared.
    pub entity_type: Option<String>,
    /// Whether a person approves each operation before it is sent.
    pub approval_required: bool,
    /// Declared intents (a proposal must name one when present).
    pub intents: Vec<String>,
    /// `business` (the key comes from the arguments) or `workflow_step` (from the
    /// proposal's `workflow_id` and `step`, which it must carry).
    pub key_strategy: String,
    /// JSON Schema of the arguments (the tool's `args_schema`, or one built from its
    /// declared and required arguments).
    pub args_schema: Value,
    /// Whether a completed operation can be compensated (`[tools.compensation]`).
    #[serde(default)]
    pub compensable: bool,
}

impl From<&opgate_core::registry::Tool> for ToolView {
    fn from(tool: &opgate_core::registry::Tool) -> Self {
        let args_schema = match &tool.args_schema {
            Some(schema) => schema.json().clone(),
            None => {
                let mut properties = serde_json::Map::new();
                for name in tool.args.keys().chain(&tool.required) {
                    properties.insert(name.clone(), serde_json::json!({}));
                }
                serde_json::json!({
                    "type": "object",
                    "properties": properties,
                    "required": tool.required,
                })
            }
        };
        Self {
            name: tool.name.clone(),
            description: tool.description.clone(),
            side_effect_class: tool.side_effect_class.as_str().to_owned(),
            entity_type: tool.entity.clone(),
            approval_required: tool.approval == opgate_core::registry::Approval::Required,
            intents: tool.intents.clone(),
            key_strategy: match tool.key_strategy {
                opgate_core::registry::KeyStrategy::Business => "business",
                opgate_core::registry::KeyStrategy::WorkflowStep => "workflow_step",
            }
            .to_owned(),
            args_schema,
            compensable: tool.compensation.is_some(),
        }
    }
}

/// The registry (`GET /v1/tools`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolsView {
    /// By name.
    pub tools: Vec<ToolView>,
}

/// Who a token is (`GET /v1/me`): the console signs in with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrincipalView {
    /// The token's name (recorded as the actor of what it does).
    pub name: String,
    /// `agent`, `viewer` or `operator`.
    pub role: String,
    /// An agent token's `agent_id`.
    pub agent_id: Option<String>,
    /// An agent token's namespaces.
    pub namespaces: Vec<String>,
}

/// One dispatch try (`GET /v1/operations/{id}/attempts`), written before the call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptView {
    /// Attempt id (sent to the tool).
    pub attempt_id: Uuid,
    /// 1-based number.
    pub number: u32,
    /// The lease epoch it ran under.
    pub epoch: i64,
    /// The worker that made it.
    pub worker: String,
    /// Started, before the tool was called (RFC 3339 UTC).
    pub started_at: String,
    /// Finished, once its outcome was recorded.
    pub finished_at: Option<String>,
    /// What it observed (`committed`, `timeout_after_send`, ...); none while in flight or
    /// when its worker died before recording.
    pub outcome: Option<String>,
    /// The provider's HTTP status.
    pub http_status: Option<u16>,
    /// The error category.
    pub error_category: Option<String>,
    /// How long the call took.
    pub latency_ms: Option<u64>,
    /// The provider's request id.
    pub provider_request_id: Option<String>,
}

impl From<&opgate_store::Attempt> for AttemptView {
    fn from(a: &opgate_store::Attempt) -> Self {
        let report = a.report.as_ref();
        Self {
            attempt_id: a.attempt_id,
            number: a.number,
            epoch: a.epoch,
            worker: a.worker.clone(),
            started_at: format_utc(a.started_at),
            finished_at: a.finished_at.map(format_utc),
            outcome: report.map(|r| r.outcome.clone()),
            http_status: report.and_then(|r| r.http_status),
            error_category: report.and_then(|r| r.error_category.clone()),
            latency_ms: report
                .and_then(|r| r.latency)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            provider_request_id: report.and_then(|r| r.provider_request_id.clone()),
        }
    }
}

/// An operation's attempts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptsView {
    /// Oldest first.
    pub attempts: Vec<AttemptView>,
}

/// A result message written for an operation (`GET /v1/operations/{id}/results`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecordView {
    /// The operation's result sequence number (`result_seq` on the topic).
    pub seq: i64,
    /// The state it announces.
    pub status: String,
    /// Written, with the state change (RFC 3339 UTC).
    pub created_at: String,
    /// Acknowledged by the broker; none while the relay has not published it.
    pub published_at: Option<String>,
}

/// An operation's result messages, while kept (published ones are reaped after
/// `reap_after`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecordsView {
    /// Oldest first.
    pub results: Vec<ResultRecordView>,
}

impl From<&[opgate_store::ResultRecord]> for ResultRecordsView {
    fn from(rows: &[opgate_store::ResultRecord]) -> Self {
        Self {
            results: rows
                .iter()
                .map(|r| ResultRecordView {
                    seq: r.seq,
                    status: r.status.clone(),
                    created_at: format_utc(r.created_at),
                    published_at: r.published_at.map(format_utc),
                })
                .collect(),
        }
    }
}

/// The console's overview (`GET /v1/overview?window=1h`): the ledger now, and what
/// happened in the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverviewView {
    /// The window's length in seconds.
    pub window_seconds: u64,
    /// The database clock (RFC 3339 UTC).
    pub now: String,
    /// Live (not terminal) operations per state.
    pub live: Vec<CountView>,
    /// Dispatch-queue rows per queue state (parked, waiting, inflight, held).
    pub queue: Vec<CountView>,
    /// Result messages not yet published.
    pub relay_pending: i64,
    /// Age of the oldest unpublished result message, in seconds.
    pub relay_lag_seconds: f64,
    /// Ingest decisions in the window per `decision` / `reason` (`accepted`,
    /// `deduplicated/duplicate_key`, `rejected/unknown_tool`, ...).
    pub decisions: Vec<CountView>,
    /// Ambiguous outcomes in the window.
    pub unknown: UnknownView,
}

/// A name and a count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountView {
    /// What is counted.
    pub name: String,
    /// How many.
    pub count: i64,
}

/// Ambiguous outcomes in a window and how they were resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnknownView {
    /// Operations that entered `unknown_outcome`.
    pub entered: i64,
    /// Those that left it, per `by/state` (`reconciler/completed_success`,
    /// `person/completed_noop`, `reconciler/needs_attention` for an escalation, ...).
    pub resolved: Vec<CountView>,
    /// Those the reconciler handed to a person (`needs_attention`): they are not resolved.
    #[serde(default)]
    pub escalated: i64,
    /// Share of those that left it that the reconciler settled, without a person and
    /// without escalating (none when none left).
    pub resolved_without_person: Option<f64>,
    /// Mean time unknown, for those that left it.
    pub mean_ms: Option<f64>,
    /// 99th percentile of the time unknown (nearest rank).
    pub p99_ms: Option<i64>,
}

impl OverviewView {
    /// The overview from the ledger's gauges and a window's activity.
    pub fn new(
        stats: &opgate_store::LedgerStats,
        activity: &opgate_store::Activity,
        window: std::time::Duration,
    ) -> Self {
        use std::collections::BTreeMap;
        let tally = |pairs: &mut dyn Iterator<Item = (String, i64)>| {
            let mut by: BTreeMap<String, i64> = BTreeMap::new();
            for (name, n) in pairs {
                *by.entry(name).or_default() += n;
            }
            by.into_iter()
                .map(|(name, count)| CountView { name, count })
                .collect::<Vec<_>>()
        };
        let live = tally(&mut stats.live.iter().map(|l| (l.status.clone(), l.count)));
        let queue = tally(&mut stats.queue.iter().cloned());
        let decisions = tally(&mut activity.decisions.iter().map(|d| {
            let name = match &d.reason {
                Some(r) => format!("{}/{r}", d.decision),
                None => d.decision.clone(),
            };
            (name, d.count)
        }));
        let exits = &activity.unknown_exits;
        let escalation = Status::NeedsAttention.as_str();
        let resolved = tally(&mut exits.iter().map(|e| {
            let by = if e.by_person { "person" } else { "reconciler" };
            (format!("{by}/{}", e.to), 1)
        }));
        let mut waits: Vec<i64> = exits.iter().filter_map(|e| e.waited_ms).collect();
        waits.sort_unstable();
        let relay_lag_seconds = stats
            .relay_oldest
            .map_or(0.0, |at| (stats.now - at).as_seconds_f64().max(0.0));
        Self {
            window_seconds: window.as_secs(),
            now: format_utc(activity.now),
            live,
            queue,
            relay_pending: stats.relay_pending,
            relay_lag_seconds,
            decisions,
            unknown: UnknownView {
                entered: activity.unknown_entered,
                resolved,
                escalated: exits.iter().filter(|e| e.to == escalation).count() as i64,
                resolved_without_person: (!exits.is_empty()).then(|| {
                    exits
                        .iter()
                        .filter(|e| !e.by_person && e.to != escalation)
                        .count() as f64
                        / exits.len() as f64
                }),
                mean_ms: (!waits.is_empty())
                    .then(|| waits.iter().sum::<i64>() as f64 / waits.len() as f64),
                p99_ms: nearest_rank(&waits, 0.99),
            },
        }
    }
}

/// The nearest-rank percentile of sorted values.
fn nearest_rank(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_escalation_is_not_resolved_without_a_person() {
        use opgate_store::{Activity, LedgerStats, UnknownExit};
        let now = time::OffsetDateTime::now_utc();
        let exit = |to: &str, by_person| UnknownExit {
            to: to.into(),
            by_person,
            waited_ms: Some(10),
        };
        let activity = Activity {
            since: now,
            now,
            decisions: Vec::new(),
            unknown_entered: 4,
            unknown_exits: vec![
                exit("completed_success", false),
                exit("needs_attention", false),
                exit("completed_noop", true),
                exit("completed_success", false),
            ],
        };
        let stats = LedgerStats {
            live: Vec::new(),
            queue: Vec::new(),
            relay_pending: 0,
            relay_oldest: None,
            relay_window: 0,
            now,
        };
        let o = OverviewView::new(&stats, &activity, std::time::Duration::from_secs(60));
        assert_eq!(o.unknown.escalated, 1);
        assert_eq!(o.unknown.resolved_without_person, Some(0.5));
    }

    #[test]
    fn nearest_rank_percentiles() {
        assert_eq!(nearest_rank(&[], 0.99), None);
        assert_eq!(nearest_rank(&[7], 0.99), Some(7));
        let hundred: Vec<i64> = (1..=100).collect();
        assert_eq!(nearest_rank(&hundred, 0.99), Some(99));
        assert_eq!(nearest_rank(&hundred, 0.5), Some(50));
    }
}
