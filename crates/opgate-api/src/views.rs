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
        }
    }
}

/// The registry (`GET /v1/tools`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolsView {
    /// By name.
    pub tools: Vec<ToolView>,
}
