//! The operation record (a row of the ledger) and the result message published for it.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::canonical::format_utc;
use crate::envelope::RejectedProposal;
use crate::proposal::Entity;
use crate::registry::SideEffectClass;
use crate::state::Status;

/// A structured error, as stored on an operation and published in results.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Category: `not_sent`, `throttled`, `timeout_after_send`, `rejected`,
    /// `server_error`, `malformed_response`, `lease_expired`, or an ingest reason.
    pub category: String,
    /// Whether retrying (through opgate) can help.
    pub retryable: bool,
    /// The provider's Retry-After, in seconds.
    pub retry_after_seconds: Option<u64>,
    /// Detail for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One operation as the ledger holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    /// UUIDv7.
    pub operation_id: Uuid,
    /// Namespace.
    pub namespace: String,
    /// Idempotency key, unique per namespace.
    pub idempotency_key: String,
    /// The canonical, unhashed key parts.
    pub key_components: Value,
    /// sha256 of canonical args.
    pub args_fingerprint: String,
    /// The event id of the proposal that created it.
    pub event_id: String,
    /// Agent.
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
    /// `{namespace}:{type}:{id}`.
    pub entity_key: String,
    /// Canonical args.
    pub canonical_args: Value,
    /// Side-effect class.
    pub side_effect_class: SideEffectClass,
    /// Current state.
    pub status: Status,
    /// Attempts made.
    pub attempt_count: u32,
    /// When the first attempt started (the retry budget's `max_elapsed` counts from it).
    pub first_attempt_at: Option<OffsetDateTime>,
    /// Since when the outcome has been unknown (cleared when resolved).
    pub unknown_since: Option<OffsetDateTime>,
    /// When the first attempt that may have taken effect started; cleared only when a
    /// lookup proves the effect absent or a person resolves it
    /// ([`crate::policy`]).
    pub ambiguous_since: Option<OffsetDateTime>,
    /// When the next attempt (or lookup) may run.
    pub next_attempt_at: Option<OffsetDateTime>,
    /// Current lease holder.
    pub lease_owner: Option<String>,
    /// Lease expiry (database clock).
    pub lease_expires_at: Option<OffsetDateTime>,
    /// Fencing epoch, incremented on every claim.
    pub lease_epoch: i64,
    /// The provider's request id of the last attempt.
    pub external_request_id: Option<String>,
    /// The provider's object id (charge id, ticket id, ...).
    pub external_object_id: Option<String>,
    /// The normalized result.
    pub result: Option<Value>,
    /// The last error.
    pub error: Option<ErrorInfo>,
    /// The operation this one compensates.
    pub compensates: Option<Uuid>,
    /// W3C traceparent of the creating proposal.
    pub traceparent: Option<String>,
    /// Sequence number of the last result message for this operation.
    pub result_seq: i64,
    /// When it was created.
    pub created_at: OffsetDateTime,
    /// When it last changed.
    pub updated_at: OffsetDateTime,
}

/// Whether a proposal was a duplicate, and of what kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dedupe {
    /// True for a duplicate.
    pub hit: bool,
    /// `inbox` (same event id), `key` (same idempotency key), `window`.
    pub reason: Option<String>,
}

impl Dedupe {
    /// Not a duplicate.
    pub fn miss() -> Self {
        Self {
            hit: false,
            reason: None,
        }
    }

    /// A duplicate for `reason`.
    pub fn hit(reason: &str) -> Self {
        Self {
            hit: true,
            reason: Some(reason.to_owned()),
        }
    }
}

/// The message published on `opgate.results` (DESIGN.md section 5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultMessage {
    /// The operation (null for a proposal rejected before it became one).
    pub operation_id: Option<Uuid>,
    /// The proposal event this answers (the creating event for later transitions).
    pub event_id: String,
    /// Namespace.
    pub namespace: Option<String>,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Workflow.
    pub workflow_id: Option<String>,
    /// Step.
    pub step: Option<u64>,
    /// Tool.
    pub tool: Option<String>,
    /// Entity.
    pub entity: Option<Entity>,
    /// Operation state, or `rejected` for a refused proposal.
    pub status: String,
    /// Duplicate information.
    pub dedupe: Dedupe,
    /// The normalized result.
    pub result: Option<Value>,
    /// The provider's object id.
    pub external_id: Option<String>,
    /// The error, if any.
    pub error: Option<ErrorInfo>,
    /// What the agent should do next.
    pub retry_recommendation: String,
    /// A message safe to show a user.
    pub safe_user_message: String,
    /// Attempts made.
    pub attempt_count: u32,
    /// Per-operation sequence number; consumers dedupe on (operation_id, status, seq).
    pub seq: i64,
    /// When the state was reached (RFC 3339 UTC).
    pub at: String,
    /// W3C traceparent of the creating proposal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl Operation {
    /// A new operation for an accepted proposal, in its initial state.
    pub fn from_envelope(env: &crate::Envelope, operation_id: Uuid, at: OffsetDateTime) -> Self {
        Operation {
            operation_id,
            namespace: env.key.namespace.clone(),
            idempotency_key: env.key.key.clone(),
            key_components: env.key.components.clone(),
            args_fingerprint: env.args_fingerprint.clone(),
            event_id: env.event_id.clone(),
            agent_id: env.agent_id.clone(),
            workflow_id: env.workflow_id.clone(),
            run_id: env.run_id.clone(),
            step: env.step,
            tool: env.tool.clone(),
            intent: env.intent.clone(),
            entity: env.entity.clone(),
            entity_key: env.entity_key.clone(),
            canonical_args: env.canonical_args.clone(),
            side_effect_class: env.side_effect_class,
            status: env.initial_status,
            attempt_count: 0,
            first_attempt_at: None,
            unknown_since: None,
            ambiguous_since: None,
            next_attempt_at: None,
            lease_owner: None,
            lease_expires_at: None,
            lease_epoch: 0,
            external_request_id: None,
            external_object_id: None,
            result: None,
            error: None,
            compensates: None,
            traceparent: env.delivery.traceparent.clone(),
            result_seq: 0,
            created_at: at,
            updated_at: at,
        }
    }
}

/// What an agent should do next in a state.
pub fn retry_recommendation(status: Status) -> &'static str {
    match status {
        Status::CompletedSuccess | Status::CompletedNoop | Status::Compensated => "none",
        Status::AwaitingApproval
        | Status::PendingDispatch
        | Status::Dispatched
        | Status::Acknowledged
        | Status::FailedRetryable
        | Status::Compensating => "wait_for_result",
        Status::UnknownOutcome => "reconcile_before_retry",
        Status::NeedsAttention => "wait_for_person",
        Status::FailedPermanent | Status::Rejected | Status::Cancelled => "do_not_retry",
    }
}

/// A message safe to show an end user in a state.
pub fn safe_user_message(status: Status) -> &'static str {
    match status {
        Status::AwaitingApproval => "The action is waiting for approval.",
        Status::PendingDispatch | Status::Dispatched | Status::FailedRetryable => {
            "The action is in progress."
        }
        Status::Acknowledged => "The action was accepted and is being processed.",
        Status::CompletedSuccess => "The action was completed.",
        Status::CompletedNoop => "Nothing needed to be done.",
        Status::UnknownOutcome => "The action's status is being confirmed.",
        Status::NeedsAttention => "The action is being reviewed by a person.",
        Status::FailedPermanent => "The action could not be completed.",
        Status::Rejected => "The action was not accepted.",
        Status::Cancelled => "The action was cancelled.",
        Status::Compensating => "The action is being reversed.",
        Status::Compensated => "The action was reversed.",
    }
}

impl ResultMessage {
    /// The result for an operation's current state, answering `event_id`.
    pub fn for_operation(
        op: &Operation,
        event_id: &str,
        dedupe: Dedupe,
        seq: i64,
        at: OffsetDateTime,
    ) -> Self {
        Self {
            operation_id: Some(op.operation_id),
            event_id: event_id.to_owned(),
            namespace: Some(op.namespace.clone()),
            idempotency_key: Some(op.idempotency_key.clone()),
            workflow_id: op.workflow_id.clone(),
            step: op.step,
            tool: Some(op.tool.clone()),
            entity: Some(op.entity.clone()),
            status: op.status.as_str().to_owned(),
            dedupe,
            result: op.result.clone(),
            external_id: op.external_object_id.clone(),
            error: op.error.clone(),
            retry_recommendation: retry_recommendation(op.status).to_owned(),
            safe_user_message: safe_user_message(op.status).to_owned(),
            attempt_count: op.attempt_count,
            seq,
            at: format_utc(at),
            traceparent: op.traceparent.clone(),
        }
    }

    /// The result for a proposal refused at ingest.
    pub fn for_rejection(rejected: &RejectedProposal, at: OffsetDateTime) -> Self {
        Self {
            operation_id: None,
            event_id: rejected.event_id.clone(),
            namespace: rejected.namespace.clone(),
            idempotency_key: None,
            workflow_id: rejected.workflow_id.clone(),
            step: rejected.step,
            tool: rejected.tool.clone(),
            entity: rejected.entity.clone(),
            status: Status::Rejected.as_str().to_owned(),
            dedupe: Dedupe::miss(),
            result: None,
            external_id: None,
            error: Some(ErrorInfo {
                category: rejected.rejection.reason.to_owned(),
                retryable: false,
                retry_after_seconds: None,
                message: Some(rejected.rejection.message.clone()),
            }),
            retry_recommendation: retry_recommendation(Status::Rejected).to_owned(),
            safe_user_message: safe_user_message(Status::Rejected).to_owned(),
            attempt_count: 0,
            seq: 0,
            at: format_utc(at),
            traceparent: rejected.delivery.traceparent.clone(),
        }
    }
}

/// The operation ids an id prefix stands for, as the lowest and highest id it covers: a
/// prefix of an id's hex digits as printed (hyphens anywhere are ignored, case too), so an
/// operator can type the first characters of an id as `git` allows for commits. Refused:
/// an empty prefix, a character that is not a hex digit, more than 32 digits.
pub fn id_prefix_range(prefix: &str) -> Result<(Uuid, Uuid), String> {
    let digits: String = prefix.chars().filter(|c| *c != '-').collect();
    if digits.is_empty() {
        return Err("an operation id (or the start of one) is needed".into());
    }
    if let Some(bad) = digits.chars().find(|c| !c.is_ascii_hexdigit()) {
        return Err(format!(
            "`{prefix}` is not an operation id or the start of one: {bad:?} is not a hex digit"
        ));
    }
    if digits.len() > 32 {
        return Err(format!("`{prefix}` is longer than an operation id"));
    }
    let pad = |fill: char| {
        let mut hex = digits.to_ascii_lowercase();
        hex.extend(std::iter::repeat_n(fill, 32 - digits.len()));
        Uuid::parse_str(&hex).map_err(|e| format!("`{prefix}`: {e}"))
    };
    Ok((pad('0')?, pad('f')?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_prefix_covers_exactly_the_ids_that_start_with_it() {
        let (lo, hi) = id_prefix_range("3F2A-9").expect("a prefix");
        assert_eq!(lo.to_string(), "3f2a9000-0000-0000-0000-000000000000");
        assert_eq!(hi.to_string(), "3f2a9fff-ffff-ffff-ffff-ffffffffffff");
        let id = Uuid::parse_str("3f2a9c1e-0000-4000-8000-000000000001").expect("an id");
        assert!(lo <= id && id <= hi);
        let full = "3f2a9c1e-0000-4000-8000-000000000001";
        assert_eq!(id_prefix_range(full).expect("a whole id"), (id, id));
    }

    #[test]
    fn an_id_prefix_refuses_what_is_not_hex() {
        for bad in [
            "",
            "-",
            "3f2g",
            "3f2a\u{0}",
            "é",
            &"a".repeat(33),
            "' OR 1=1",
        ] {
            let err = id_prefix_range(bad).expect_err("refused");
            assert!(!err.is_empty(), "{bad:?}");
        }
    }
}
