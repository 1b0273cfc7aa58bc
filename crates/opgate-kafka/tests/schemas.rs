//! The JSON Schemas in `topics/schemas` accept DESIGN.md's examples, and agree with the
//! Rust types: what the decoder accepts the schema accepts, and every field the Rust
//! result type writes is a schema property.

#![allow(missing_docs)]

use opgate_core::{Dedupe, Entity, ErrorInfo, Limits, Proposal, ResultMessage};
use serde_json::{Value, json};

fn schema(name: &str) -> jsonschema::Validator {
    let path = format!("{}/../../topics/schemas/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let value: Value = serde_json::from_str(&text).expect("schema is JSON");
    jsonschema::validator_for(&value).expect("valid schema")
}

fn design_proposal() -> Value {
    json!({"event_id": "evt-7f3a", "namespace": "acme", "agent_id": "support-bot",
        "workflow_id": "wf-1", "run_id": "run-1", "step": 3,
        "tool": "capture_payment", "intent": "collect_payment_for_order",
        "entity": {"type": "order", "id": "order_123"},
        "args": {"amount": "49.00", "currency": "usd"}})
}

fn design_result() -> Value {
    json!({"operation_id": "0193a4c2-7d1e-7c3b-9f00-1a2b3c4d5e6f", "event_id": "evt-7f3a",
        "idempotency_key": "payment:order_123:capture:4900:USD:v1",
        "workflow_id": "wf-1", "step": 3, "tool": "capture_payment", "entity": {"type": "order", "id": "order_123"},
        "status": "unknown_outcome", "dedupe": {"hit": false, "reason": null},
        "result": null, "external_id": null,
        "error": {"category": "timeout_after_send", "retryable": false, "retry_after_seconds": null},
        "retry_recommendation": "reconcile_before_retry",
        "safe_user_message": "Payment status is being confirmed.", "attempt_count": 1,
        "seq": 4, "at": "2026-11-29T10:00:00Z"})
}

#[test]
fn the_design_examples_validate() {
    let proposal = schema("proposal.schema.json");
    assert!(proposal.is_valid(&design_proposal()));
    let result = schema("result.schema.json");
    let errors: Vec<String> = result
        .iter_errors(&design_result())
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:?}");
}

/// For each input, the decoder and the schema agree on valid versus invalid.
#[test]
fn the_proposal_schema_agrees_with_the_decoder() {
    let validator = schema("proposal.schema.json");
    let mut cases = vec![design_proposal()];
    let mutations: Vec<(&str, Option<Value>)> = vec![
        ("tool", None),
        ("tool", Some(json!(""))),
        ("tool", Some(json!(5))),
        ("event_id", None),
        ("event_id", Some(json!("   "))),
        ("entity", Some(json!({"type": "order"}))),
        ("entity", Some(json!({"type": "order", "id": ""}))),
        (
            "entity",
            Some(json!({"type": "order", "id": "x", "extra": 1})),
        ),
        ("args", Some(json!([]))),
        ("args", None),
        ("step", Some(json!(-1))),
        ("step", Some(json!(2))),
        ("step", Some(json!(null))),
        ("namespace", Some(json!(null))),
        ("namespace", Some(json!(""))),
        ("intent", Some(json!(7))),
        ("arguments", Some(json!({}))),
        // DESIGN.md section 9: control characters and over-long ids.
        ("event_id", Some(json!("a\u{0}b"))),
        ("agent_id", Some(json!("bot\n"))),
        ("workflow_id", Some(json!("x".repeat(257)))),
        ("workflow_id", Some(json!("x".repeat(256)))),
        ("tool", Some(json!("pay\u{7f}"))),
        ("entity", Some(json!({"type": "order", "id": "o\r1"}))),
        ("step", Some(json!(9_223_372_036_854_775_807u64))),
        ("step", Some(json!(9_223_372_036_854_775_808u64))),
    ];
    for (field, value) in mutations {
        let mut v = design_proposal();
        match value {
            Some(x) => v[field] = x,
            None => {
                v.as_object_mut().expect("object").remove(field);
            }
        }
        cases.push(v);
    }
    for case in cases {
        let decoder = Proposal::from_value(case.clone(), &Limits::default()).is_ok();
        assert_eq!(
            validator.is_valid(&case),
            decoder,
            "schema and decoder disagree on {case}"
        );
    }
}

#[test]
fn result_messages_from_rust_validate_and_use_only_schema_fields() {
    let validator = schema("result.schema.json");
    let path = format!(
        "{}/../../topics/schemas/result.schema.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let schema_json: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let properties = schema_json["properties"].as_object().expect("properties");
    let messages = [
        ResultMessage {
            operation_id: Some(uuid::Uuid::now_v7()),
            event_id: "e".into(),
            namespace: Some("acme".into()),
            idempotency_key: Some("k:v1".into()),
            workflow_id: None,
            step: Some(1),
            tool: Some("t".into()),
            entity: Some(Entity {
                kind: "order".into(),
                id: "o".into(),
            }),
            status: "completed_success".into(),
            dedupe: Dedupe::hit("key"),
            result: Some(json!({"charge_id": "ch_1"})),
            external_id: Some("ch_1".into()),
            error: None,
            retry_recommendation: "none".into(),
            safe_user_message: "The action was completed.".into(),
            attempt_count: 1,
            seq: 3,
            at: "2026-11-29T10:00:00.5Z".into(),
            traceparent: Some("00-abc-def-01".into()),
        },
        ResultMessage {
            operation_id: None,
            event_id: "kafka:opgate.proposals:0:7".into(),
            namespace: None,
            idempotency_key: None,
            workflow_id: None,
            step: None,
            tool: None,
            entity: None,
            status: "rejected".into(),
            dedupe: Dedupe::miss(),
            result: None,
            external_id: None,
            error: Some(ErrorInfo {
                category: "not_json".into(),
                retryable: false,
                retry_after_seconds: None,
                message: Some("bad".into()),
            }),
            retry_recommendation: "do_not_retry".into(),
            safe_user_message: "The action was not accepted.".into(),
            attempt_count: 0,
            seq: 0,
            at: "2026-11-29T10:00:00Z".into(),
            traceparent: None,
        },
    ];
    for message in messages {
        let value = serde_json::to_value(&message).expect("serializes");
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{errors:?} in {value}");
        for key in value.as_object().expect("object").keys() {
            assert!(
                properties.contains_key(key),
                "Rust writes `{key}`, the schema lacks it"
            );
        }
    }
}
