//! Compensation: the proposal that undoes a completed operation, built from the tool's
//! `[tools.compensation]` (e.g. `refund_payment` with `charge_id = "{result.charge_id}"`).
//!
//! The compensating proposal goes through the same registry checks, canonicalization
//! and key derivation as any other ([`crate::envelope::prepare_for_operator`]: a person
//! asked for it, so the agents' allowlists do not apply); the ledger then
//! records it with `compensates` pointing at the original, which moves to `compensating`
//! until the compensation settles.

use serde_json::{Map, Value};

use crate::envelope::Rejection;
use crate::template::{Placeholder, Template};
use crate::{Operation, Proposal, Registry};

/// The event id of an operation's compensation (one per operation: a second request
/// while the first is pending or done is a duplicate, not a second refund).
pub fn event_id(operation: &Operation) -> String {
    format!("compensate:{}", operation.operation_id)
}

/// Builds the compensating proposal for a completed operation, on behalf of `actor`.
pub fn proposal(
    registry: &Registry,
    operation: &Operation,
    actor: &str,
) -> Result<Proposal, Rejection> {
    let tool = registry.tool(&operation.tool).ok_or_else(|| Rejection {
        reason: "unknown_tool",
        message: format!("tool `{}` is no longer registered", operation.tool),
    })?;
    let compensation = tool.compensation.as_ref().ok_or_else(|| Rejection {
        reason: "no_compensation",
        message: format!(
            "tool `{}` declares no [tools.compensation]; resolve the operation by hand",
            operation.tool
        ),
    })?;
    let mut args = Map::new();
    for (name, value) in &compensation.args {
        let rendered = match value {
            Value::String(source) => {
                let template = Template::parse(source).map_err(|e| Rejection {
                    reason: "compensation_args",
                    message: format!("compensation.args.{name}: {e}"),
                })?;
                Value::String(template.render(|p| placeholder(operation, p)).map_err(
                    |missing| Rejection {
                        reason: "compensation_args",
                        message: format!("compensation.args.{name}: {missing}"),
                    },
                )?)
            }
            literal => literal.clone(),
        };
        args.insert(name.clone(), rendered);
    }
    // A compensating tool that declares intents gets its first one: the intent is the
    // configuration's, not a model's.
    let intent = registry
        .tool(&compensation.tool)
        .and_then(|t| t.intents.first().cloned());
    Ok(Proposal {
        event_id: event_id(operation),
        namespace: operation.namespace.clone(),
        agent_id: Some(actor.to_owned()),
        workflow_id: operation.workflow_id.clone(),
        run_id: operation.run_id.clone(),
        step: operation.step,
        tool: compensation.tool.clone(),
        intent,
        entity: operation.entity.clone(),
        args,
    })
}

fn placeholder(op: &Operation, p: &Placeholder) -> Result<String, String> {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let present = |v: Option<&Value>, what: String| {
        v.filter(|v| !v.is_null())
            .map(text)
            .ok_or_else(|| format!("{what} is absent"))
    };
    Ok(match p {
        Placeholder::Entity => op.entity.id.clone(),
        Placeholder::EntityType => op.entity.kind.clone(),
        Placeholder::Tool => op.tool.clone(),
        Placeholder::Namespace => op.namespace.clone(),
        Placeholder::Key => op.idempotency_key.clone(),
        Placeholder::Intent => present(
            op.intent
                .as_ref()
                .map(|i| Value::String(i.clone()))
                .as_ref(),
            "{intent}".into(),
        )?,
        Placeholder::WorkflowId => present(
            op.workflow_id
                .as_ref()
                .map(|w| Value::String(w.clone()))
                .as_ref(),
            "{workflow_id}".into(),
        )?,
        Placeholder::Step => present(op.step.map(Value::from).as_ref(), "{step}".into())?,
        Placeholder::Arg(name) => present(op.canonical_args.get(name), format!("{{args.{name}}}"))?,
        Placeholder::Result(name) => present(
            op.result.as_ref().and_then(|r| r.get(name)),
            format!("{{result.{name}}} (the operation's result)"),
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Delivery, IngestItem, Limits, Source};
    use serde_json::json;

    const TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:{args.amount}"
[tools.args]
amount = "money_minor"
[tools.compensation]
tool = "refund_payment"
args = { charge_id = "{result.charge_id}", amount = "{args.amount}", note = 7 }

[[tools]]
name = "refund_payment"
side_effect_class = "irreversible"
entity = "order"
key = "refund:{entity}:{args.charge_id}"
required = ["charge_id"]

[[tools]]
name = "note"
side_effect_class = "internal_write"
"#;

    fn completed(registry: &Registry, tool: &str, result: Value) -> Operation {
        let p = Proposal::from_value(
            json!({"event_id": "e1", "tool": tool, "entity": {"type": "order", "id": "o1"},
                "args": {"amount": "12.50"}}),
            &Limits::default(),
        )
        .expect("proposal");
        let IngestItem::Accepted(env) = IngestItem::from_proposal(
            registry,
            &p,
            Delivery {
                principal: None,
                source: Source::Http,
                traceparent: None,
            },
        ) else {
            panic!("accepted")
        };
        let mut op =
            Operation::from_envelope(&env, uuid::Uuid::nil(), time::OffsetDateTime::UNIX_EPOCH);
        op.result = Some(result);
        op
    }

    #[test]
    fn renders_result_and_args_into_the_compensating_tool() {
        let registry = Registry::from_toml(TOOLS).expect("registry");
        let op = completed(
            &registry,
            "capture_payment",
            json!({"charge_id": "ch_9", "amount": 1250}),
        );
        let p = proposal(&registry, &op, "ops-oncall").expect("compensation");
        assert_eq!(p.tool, "refund_payment");
        assert_eq!(p.event_id, format!("compensate:{}", op.operation_id));
        assert_eq!(p.entity, op.entity);
        assert_eq!(p.agent_id.as_deref(), Some("ops-oncall"));
        assert_eq!(
            Value::Object(p.args),
            json!({"charge_id": "ch_9", "amount": "1250", "note": 7})
        );
    }

    #[test]
    fn refuses_without_a_compensation_or_a_result_field() {
        let registry = Registry::from_toml(TOOLS).expect("registry");
        let op = completed(&registry, "note", json!({}));
        assert_eq!(
            proposal(&registry, &op, "x").expect_err("none").reason,
            "no_compensation"
        );
        let op = completed(&registry, "capture_payment", json!({"amount": 1250}));
        let err = proposal(&registry, &op, "x").expect_err("no charge id");
        assert_eq!(err.reason, "compensation_args");
        assert!(
            err.message.contains("{result.charge_id}"),
            "{}",
            err.message
        );
    }

    #[test]
    fn an_operator_compensation_passes_agent_allowlists_and_takes_a_declared_intent() {
        let tools = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:{args.amount}"
[tools.args]
amount = "money_minor"
[tools.compensation]
tool = "refund_payment"
args = { charge_id = "{result.charge_id}" }

[[tools]]
name = "refund_payment"
side_effect_class = "irreversible"
entity = "order"
intents = ["undo_charge"]
key = "refund:{entity}:{args.charge_id}"
required = ["charge_id"]

[[agents]]
id = "checkout-bot"
tools = ["capture_payment"]
"#;
        let registry = Registry::from_toml(tools).expect("registry");
        let p = Proposal::from_value(
            json!({"event_id": "e1", "agent_id": "checkout-bot", "tool": "capture_payment",
                "entity": {"type": "order", "id": "o1"}, "args": {"amount": "12.50"}}),
            &Limits::default(),
        )
        .expect("proposal");
        let delivery = || Delivery {
            principal: None,
            source: Source::Http,
            traceparent: None,
        };
        let env = crate::envelope::prepare(&registry, &p, delivery()).expect("accepted");
        let mut op =
            Operation::from_envelope(&env, uuid::Uuid::nil(), time::OffsetDateTime::UNIX_EPOCH);
        op.result = Some(json!({"charge_id": "ch_1"}));
        let comp = proposal(&registry, &op, "ops-oncall").expect("compensation");
        assert_eq!(comp.intent.as_deref(), Some("undo_charge"));
        // An agent named `ops-oncall` is not in the allowlist; an operator is not an agent.
        assert_eq!(
            crate::envelope::prepare(&registry, &comp, delivery())
                .expect_err("agents are checked")
                .reason,
            "unknown_agent"
        );
        let env = crate::envelope::prepare_for_operator(&registry, &comp, delivery())
            .expect("operators are not agents");
        assert_eq!(env.tool, "refund_payment");
        assert_eq!(env.key.key, "refund:o1:ch_1:v1");
    }
}
