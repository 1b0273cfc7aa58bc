//! From a decoded proposal to an operation envelope: tool lookup, agent allowlist,
//! intent and entity checks, canonical args, fingerprint and idempotency key.
//!
//! This is the whole business identity of an operation, computed without I/O. The
//! ledger then decides whether it is new ([`crate::envelope::Envelope`]) or a duplicate.

use serde_json::Value;

use crate::canonical::{ArgError, canonicalize_args, with_defaults};
use crate::key::{IdempotencyKey, KeyError, KeyInput, args_fingerprint, derive_key};
use crate::proposal::{Entity, Proposal};
use crate::registry::{Approval, KeyStrategy, Registry, SideEffectClass};
use crate::state::{Status, initial_status};

/// Where a proposal came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A Kafka record.
    Kafka {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// `POST /v1/proposals`.
    Http,
}

/// Transport context carried beside the proposal (Kafka headers or HTTP headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Where it came from.
    pub source: Source,
    /// W3C traceparent, carried into spans and results.
    pub traceparent: Option<String>,
    /// The authenticated principal that sent it (an API token's name), recorded as the
    /// actor of the operation's first event; `None` over Kafka (trusted by topic ACLs).
    pub principal: Option<String>,
}

/// An accepted proposal, ready for the ledger's ingest transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The proposal's event id (inbox key).
    pub event_id: String,
    /// Transport context.
    pub delivery: Delivery,
    /// Agent.
    pub agent_id: Option<String>,
    /// Workflow.
    pub workflow_id: Option<String>,
    /// Run.
    pub run_id: Option<String>,
    /// Step.
    pub step: Option<u64>,
    /// Tool name.
    pub tool: String,
    /// Intent label as proposed.
    pub intent: Option<String>,
    /// Entity.
    pub entity: Entity,
    /// `{namespace}:{entity_type}:{entity_id}`: the unit of serialization.
    pub entity_key: String,
    /// Canonical args.
    pub canonical_args: Value,
    /// sha256 of the canonical args.
    pub args_fingerprint: String,
    /// The key and its components.
    pub key: IdempotencyKey,
    /// Key strategy (decides how a differing duplicate is treated).
    pub key_strategy: KeyStrategy,
    /// Side-effect class.
    pub side_effect_class: SideEffectClass,
    /// The state a new operation starts in.
    pub initial_status: Status,
    /// Policies beside the key (`dedupe_window`, `exclusive_group`), checked by the
    /// ledger against the entity's recent operations.
    pub guards: Vec<Guard>,
    /// [`Proposal::content_fingerprint`]: tells a redelivery from a reused event id.
    pub content_fingerprint: String,
}

/// A policy the ledger checks at ingest, beside the key: a recent operation on the same
/// entity by one of `tools` (with the same canonical args when `same_args`) that did
/// not fail suppresses the proposal as a duplicate with `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// `window` (the tool's `dedupe_window`) or `exclusive_group`.
    pub reason: &'static str,
    /// The tools whose operations count.
    pub tools: Vec<String>,
    /// How far back, from the ledger's clock.
    pub window: std::time::Duration,
    /// Only operations with the same args fingerprint count.
    pub same_args: bool,
}

/// The guards a tool's policies ask for.
fn guards(registry: &Registry, tool: &crate::Tool) -> Vec<Guard> {
    let mut guards = Vec::new();
    if let Some(window) = tool.dedupe_window {
        guards.push(Guard {
            reason: "window",
            tools: vec![tool.name.clone()],
            window,
            same_args: true,
        });
    }
    if let Some(group) = &tool.exclusive_group {
        guards.push(Guard {
            reason: "exclusive_group",
            tools: registry
                .tools()
                .filter(|t| {
                    t.exclusive_group
                        .as_ref()
                        .is_some_and(|g| g.name == group.name)
                })
                .map(|t| t.name.clone())
                .collect(),
            window: group.window,
            same_args: false,
        });
    }
    guards
}

/// Why a proposal is refused before it becomes an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Rejection {
    /// Machine-readable reason (`unknown_tool`, `invalid_args`, ...).
    pub reason: &'static str,
    /// Human-readable detail naming the field or argument.
    pub message: String,
}

/// A proposal refused at ingest; it still gets an inbox row and a result message.
#[derive(Debug, Clone, PartialEq)]
pub struct RejectedProposal {
    /// Event id (best effort from the raw message; required for an inbox row).
    pub event_id: String,
    /// Transport context.
    pub delivery: Delivery,
    /// Namespace, when known.
    pub namespace: Option<String>,
    /// Workflow id, when known.
    pub workflow_id: Option<String>,
    /// Step, when known.
    pub step: Option<u64>,
    /// Tool, when known.
    pub tool: Option<String>,
    /// Entity, when known.
    pub entity: Option<Entity>,
    /// Why.
    pub rejection: Rejection,
    /// The content fingerprint, when the proposal could be decoded.
    pub content_fingerprint: Option<String>,
}

impl RejectedProposal {
    /// A rejection of a decoded proposal.
    pub fn of(proposal: &Proposal, delivery: Delivery, rejection: Rejection) -> Self {
        Self {
            event_id: proposal.event_id.clone(),
            delivery,
            namespace: Some(proposal.namespace.clone()),
            workflow_id: proposal.workflow_id.clone(),
            step: proposal.step,
            tool: Some(proposal.tool.clone()),
            entity: Some(proposal.entity.clone()),
            rejection,
            content_fingerprint: Some(proposal.content_fingerprint()),
        }
    }

    /// The Kafka key its result is published under.
    pub fn kafka_key(&self) -> String {
        self.entity
            .as_ref()
            .map(|e| format!("{}:{}", e.kind, e.id))
            .unwrap_or_else(|| self.event_id.clone())
    }
}

/// One item of an ingest batch.
#[derive(Debug, Clone, PartialEq)]
pub enum IngestItem {
    /// A valid proposal.
    Accepted(Box<Envelope>),
    /// A refused proposal.
    Rejected(Box<RejectedProposal>),
}

impl IngestItem {
    /// The proposal's event id.
    pub fn event_id(&self) -> &str {
        match self {
            Self::Accepted(e) => &e.event_id,
            Self::Rejected(r) => &r.event_id,
        }
    }

    /// The inbox key: `{namespace}/{event_id}` (DESIGN.md section 9: event identity is
    /// per namespace; a namespace cannot contain `/`, so the key is unambiguous). A
    /// proposal whose namespace could not be read counts as the default namespace.
    pub fn inbox_key(&self) -> String {
        let namespace = match self {
            Self::Accepted(e) => Some(e.key.namespace.as_str()),
            Self::Rejected(r) => r.namespace.as_deref(),
        };
        format!(
            "{}/{}",
            namespace.unwrap_or(crate::proposal::DEFAULT_NAMESPACE),
            self.event_id()
        )
    }

    /// The proposal's content fingerprint, when it could be decoded.
    pub fn content_fingerprint(&self) -> Option<&str> {
        match self {
            Self::Accepted(e) => Some(&e.content_fingerprint),
            Self::Rejected(r) => r.content_fingerprint.as_deref(),
        }
    }

    /// Builds the item for a decoded proposal: an envelope, or a rejection.
    pub fn from_proposal(registry: &Registry, proposal: &Proposal, delivery: Delivery) -> Self {
        match prepare(registry, proposal, delivery.clone()) {
            Ok(envelope) => Self::Accepted(Box::new(envelope)),
            Err(rejection) => Self::Rejected(Box::new(RejectedProposal::of(
                proposal, delivery, rejection,
            ))),
        }
    }
}

/// The entity key: `{namespace}:{entity_type}:{entity_id}`, with `%` and `:` escaped in
/// the type and id so two different entities never share a key.
pub fn entity_key(namespace: &str, entity: &Entity) -> String {
    use crate::key::escape;
    format!(
        "{namespace}:{}:{}",
        escape(&entity.kind),
        escape(&entity.id)
    )
}

/// Validates a proposal against the registry and computes its identity.
pub fn prepare(
    registry: &Registry,
    proposal: &Proposal,
    delivery: Delivery,
) -> Result<Envelope, Rejection> {
    prepare_checked(registry, proposal, delivery, true)
}

/// [`prepare`] for a proposal a person made through the admin API (a compensation): the
/// `[[agents]]` allowlists govern agents, not operators, so they are not applied.
pub fn prepare_for_operator(
    registry: &Registry,
    proposal: &Proposal,
    delivery: Delivery,
) -> Result<Envelope, Rejection> {
    prepare_checked(registry, proposal, delivery, false)
}

fn prepare_checked(
    registry: &Registry,
    proposal: &Proposal,
    delivery: Delivery,
    check_agent: bool,
) -> Result<Envelope, Rejection> {
    let reject = |reason, message: String| Rejection { reason, message };
    let tool = registry.tool(&proposal.tool).ok_or_else(|| {
        reject(
            "unknown_tool",
            format!("tool `{}` is not registered", proposal.tool),
        )
    })?;
    let allowed = if check_agent {
        registry.allows(proposal.agent_id.as_deref(), &tool.name)
    } else {
        Ok(())
    };
    allowed.map_err(|reason| {
        let message = match (reason, proposal.agent_id.as_deref()) {
            ("unknown_agent", None) => "field `agent_id` is missing: this config declares \
                [[agents]], and only a declared agent may propose"
                .to_owned(),
            ("unknown_agent", Some(agent)) => format!(
                "field `agent_id`: agent `{agent}` is not declared in this config's [[agents]], \
                 and only a declared agent may propose"
            ),
            (_, agent) => format!(
                "agent `{}` may not propose tool `{}` (not in its [[agents]] tools)",
                agent.unwrap_or_default(),
                tool.name
            ),
        };
        reject(reason, message)
    })?;
    if !tool.intents.is_empty() {
        let declared = tool.intents.join(", ");
        match proposal.intent.as_deref() {
            Some(intent) if tool.intents.iter().any(|i| i == intent) => {}
            Some(intent) => {
                return Err(reject(
                    "unknown_intent",
                    format!(
                        "field `intent`: `{intent}` is not declared by tool `{}` (declared: {declared})",
                        tool.name
                    ),
                ));
            }
            None => {
                return Err(reject(
                    "unknown_intent",
                    format!(
                        "field `intent` is missing: tool `{}` declares intents, so a proposal must name one (declared: {declared})",
                        tool.name
                    ),
                ));
            }
        }
    }
    if let Some(kind) = &tool.entity
        && *kind != proposal.entity.kind
    {
        return Err(reject(
            "entity_type_mismatch",
            format!(
                "tool `{}` acts on `{kind}`, not `{}`",
                tool.name, proposal.entity.kind
            ),
        ));
    }
    if let Some(schema) = &tool.args_schema {
        schema
            .check(&with_defaults(tool, &proposal.args))
            .map_err(|m| reject("args_schema", m))?;
    }
    let canonical_args = canonicalize_args(tool, &proposal.args)
        .map_err(|e: ArgError| reject("invalid_args", e.to_string()))?;
    let key = derive_key(&KeyInput {
        namespace: &proposal.namespace,
        tool,
        intent: proposal.intent.as_deref(),
        entity: &proposal.entity,
        workflow_id: proposal.workflow_id.as_deref(),
        step: proposal.step,
        canonical_args: &canonical_args,
    })
    .map_err(|e: KeyError| reject("invalid_args", e.to_string()))?;
    crate::input::check_key(&key.key).map_err(|message| reject("invalid_key", message))?;
    Ok(Envelope {
        event_id: proposal.event_id.clone(),
        delivery,
        agent_id: proposal.agent_id.clone(),
        workflow_id: proposal.workflow_id.clone(),
        run_id: proposal.run_id.clone(),
        step: proposal.step,
        tool: tool.name.clone(),
        intent: proposal.intent.clone(),
        entity: proposal.entity.clone(),
        entity_key: entity_key(&proposal.namespace, &proposal.entity),
        args_fingerprint: args_fingerprint(&canonical_args),
        canonical_args,
        key,
        key_strategy: tool.key_strategy,
        side_effect_class: tool.side_effect_class,
        initial_status: initial_status(tool.approval == Approval::Required),
        guards: guards(registry, tool),
        content_fingerprint: proposal.content_fingerprint(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proposal::Limits;
    use serde_json::json;

    const TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
intents = ["collect_payment_for_order"]
approval = "required"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"

[[tools]]
name = "note"
side_effect_class = "internal_write"
key = "note:{entity}:{args.text}"
required = ["text"]
"#;

    fn proposal(patch: Value) -> Proposal {
        let mut base = json!({"event_id": "evt-1", "namespace": "acme", "tool": "capture_payment",
            "intent": "collect_payment_for_order", "entity": {"type": "order", "id": "order_123"},
            "args": {"amount": "49.00", "currency": "usd"}});
        for (k, v) in patch.as_object().expect("object") {
            base[k] = v.clone();
        }
        Proposal::from_value(base, &Limits::default()).expect("valid proposal")
    }

    fn delivery() -> Delivery {
        Delivery {
            principal: None,
            source: Source::Http,
            traceparent: None,
        }
    }

    #[test]
    fn accepted_envelope() {
        let registry = Registry::from_toml(TOOLS).expect("valid");
        let env = prepare(&registry, &proposal(json!({})), delivery()).expect("accepted");
        assert_eq!(env.key.key, "payment:order_123:capture:4900:USD:v1");
        assert_eq!(env.entity_key, "acme:order:order_123");
        assert_eq!(env.initial_status, Status::AwaitingApproval);
        assert_eq!(env.args_fingerprint.len(), 64);
    }

    #[test]
    fn rejections_carry_a_reason_and_the_field() {
        let registry = Registry::from_toml(TOOLS).expect("valid");
        let cases = [
            (json!({"tool": "refund"}), "unknown_tool", "refund"),
            (
                json!({"intent": "make_money"}),
                "unknown_intent",
                "make_money",
            ),
            (
                json!({"intent": null}),
                "unknown_intent",
                "field `intent` is missing",
            ),
            (
                json!({"entity": {"type": "user", "id": "u"}}),
                "entity_type_mismatch",
                "user",
            ),
            (
                json!({"args": {"amount": "4.999", "currency": "usd"}}),
                "invalid_args",
                "amount",
            ),
            (
                json!({"args": {"currency": "usd"}}),
                "invalid_args",
                "amount",
            ),
        ];
        for (patch, reason, fragment) in cases {
            let err =
                prepare(&registry, &proposal(patch.clone()), delivery()).expect_err("rejected");
            assert_eq!(err.reason, reason, "{patch}");
            assert!(err.message.contains(fragment), "{patch}: {}", err.message);
        }
        // A config with an [[agents]] allowlist: a proposal without a declared agent is
        // told which field to send.
        let strict = Registry::from_toml(&format!(
            "{TOOLS}\n[[agents]]\nid = \"support-bot\"\ntools = [\"capture_payment\"]\n"
        ))
        .expect("valid");
        for (agent, says) in [
            (json!(null), "field `agent_id` is missing"),
            (
                json!("stranger"),
                "field `agent_id`: agent `stranger` is not declared",
            ),
        ] {
            let err = prepare(&strict, &proposal(json!({"agent_id": agent})), delivery())
                .expect_err("unknown agent");
            assert_eq!(err.reason, "unknown_agent");
            assert!(err.message.contains(says), "{}", err.message);
        }
        let item =
            IngestItem::from_proposal(&registry, &proposal(json!({"tool": "x"})), delivery());
        assert!(matches!(item, IngestItem::Rejected(r) if r.rejection.reason == "unknown_tool"));
    }

    /// What lands in a key must be sendable: no control characters, at most 1,024 bytes.
    #[test]
    fn a_key_that_cannot_be_sent_is_refused() {
        let registry = Registry::from_toml(TOOLS).expect("valid");
        let note = |text: &str| {
            proposal(
                json!({"tool": "note", "intent": null, "entity": {"type": "order", "id": "o1"},
                "args": {"text": text}}),
            )
        };
        let ok = prepare(&registry, &note("hello"), delivery()).expect("fine");
        assert_eq!(ok.key.key, "note:o1:hello:v1");
        for (text, fragment) in [
            ("line\nbreak", "U+000A"),
            ("tab\there", "U+0009"),
            (&"x".repeat(1100), "more than the limit of 1024"),
        ] {
            let err = prepare(&registry, &note(text), delivery()).expect_err("refused");
            assert_eq!(err.reason, "invalid_key");
            assert!(err.message.contains(fragment), "{}", err.message);
        }
    }
}
