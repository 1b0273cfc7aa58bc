//! The admin API over real HTTP against a real ledger (SQLite, or PostgreSQL with the
//! testkit's `postgres` feature).

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use opgate_api::{AgentScope, ApiState, Role, Token};
use opgate_core::{Event, Limits, Registry};
use opgate_store::{ClaimRequest, Recording, SharedLedger};
use reqwest::StatusCode;
use serde_json::{Value, json};

const TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"
[tools.args_schema]
type = "object"
required = ["amount"]
[tools.args_schema.properties.amount]
type = ["string", "number"]
pattern = '^\s*0*([1-9][0-9]*(\.[0-9]+)?|0?\.[0-9]*[1-9][0-9]*)\s*$'
exclusiveMinimum = 0

[[tools]]
name = "refund"
side_effect_class = "irreversible"
entity = "order"
approval = "required"
"#;

struct Api {
    url: String,
    http: reqwest::Client,
    ledger: SharedLedger,
}

async fn api() -> Api {
    api_with(|state| state).await
}

async fn api_with(configure: impl FnOnce(ApiState) -> ApiState) -> Api {
    let db = opgate_testkit::TestLedger::new().await;
    let registry = Arc::new(Registry::from_toml(TOOLS).expect("registry"));
    let token = |name: &str, role, secret: &str, agent: Option<(&str, &str)>| {
        let scope = agent.map(|(id, ns)| AgentScope {
            agent_id: id.into(),
            namespaces: vec![ns.into()],
        });
        Token::new(name, role, &[secret.into()], &[], scope).expect("token")
    };
    let tokens = vec![
        token("vera", Role::Viewer, VIEWER_SECRET, None),
        token("otto", Role::Operator, OPERATOR_SECRET, None),
        token("olga", Role::Operator, OPERATOR_TWO_SECRET, None),
        token(
            "bot-token",
            Role::Agent,
            AGENT_SECRET,
            Some(("bot", "default")),
        ),
        token(
            "rival-token",
            Role::Agent,
            RIVAL_SECRET,
            Some(("rival", "default")),
        ),
    ];
    let state = configure(
        ApiState::new(db.ledger.clone(), registry, Limits::default(), tokens).expect("tokens"),
    );
    let (addr, _server) = opgate_api::serve("127.0.0.1:0".parse().expect("addr"), state)
        .await
        .expect("serve");
    Api {
        url: format!("http://{addr}"),
        http: reqwest::Client::new(),
        ledger: db.ledger.clone(),
    }
}

impl Api {
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut req = self.http.request(
            method.parse().expect("method"),
            format!("{}{path}", self.url),
        );
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.expect("request");
        let status = res.status();
        let text = res.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn propose(&self, event_id: &str, tool: &str, amount: Value) -> (StatusCode, Value) {
        let body = json!({"event_id": event_id, "tool": tool, "entity": {"type": "order", "id": "o1"},
            "args": {"amount": amount, "currency": "usd"}});
        self.call("POST", "/v1/proposals", AGENT, Some(body)).await
    }
}

const VIEWER_SECRET: &str = "viewer-secret-0123456789";
const OPERATOR_SECRET: &str = "operator-secret-0123456789";
const OPERATOR_TWO_SECRET: &str = "operator-two-secret-0123456789";
const AGENT_SECRET: &str = "agent-secret-0123456789";
const RIVAL_SECRET: &str = "rival-agent-secret-0123456789";
const OPERATOR: Option<&str> = Some(OPERATOR_SECRET);
const OPERATOR_TWO: Option<&str> = Some(OPERATOR_TWO_SECRET);
const VIEWER: Option<&str> = Some(VIEWER_SECRET);
const AGENT: Option<&str> = Some(AGENT_SECRET);
const RIVAL: Option<&str> = Some(RIVAL_SECRET);

#[tokio::test]
async fn tokens_and_roles_are_enforced() {
    let a = api().await;
    let (s, body) = a.call("GET", "/v1/operations", None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["code"], "unauthorized");
    assert_eq!(
        a.call("GET", "/v1/operations", Some("guess"), None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        a.call("GET", "/v1/operations", VIEWER, None).await.0,
        StatusCode::OK
    );
    let (s, body) = a
        .call("POST", "/v1/proposals", VIEWER, Some(json!({})))
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("viewer")
    );
    assert_eq!(
        a.call("GET", "/healthz", None, None).await.0,
        StatusCode::OK
    );
    let (s, body) = a.call("GET", "/readyz", None, None).await;
    assert_eq!((s, body["ledger"].clone()), (StatusCode::OK, json!("ok")));
}

#[tokio::test]
async fn readyz_reports_every_dependency_and_fails_when_one_is_down() {
    let a = api_with(|state| {
        state
            .with_check("broker", Arc::new(|| Box::pin(async { Ok(()) })))
            .with_check(
                "search",
                Arc::new(|| Box::pin(async { Err("connection refused".to_owned()) })),
            )
    })
    .await;
    let (s, body) = a.call("GET", "/readyz", None, None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "dependency_unavailable");
    assert_eq!(body["checks"]["ledger"], "ok");
    assert_eq!(body["checks"]["broker"], "ok");
    assert_eq!(body["checks"]["search"], "unavailable");
    assert!(
        !body.to_string().contains("connection refused"),
        "the dependency's own words stay in the log: {body}"
    );
    let ok =
        api_with(|state| state.with_check("broker", Arc::new(|| Box::pin(async { Ok(()) })))).await;
    let (s, body) = ok.call("GET", "/readyz", None, None).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(body["broker"], "ok");
}

#[tokio::test]
async fn bad_proposals_are_400_with_the_field_at_fault() {
    let a = api().await;
    let raw = a
        .http
        .post(format!("{}/v1/proposals", a.url))
        .bearer_auth(OPERATOR_SECRET)
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(raw.status(), StatusCode::BAD_REQUEST);
    let body: Value = raw.json().await.expect("json");
    assert_eq!(body["error"]["code"], "not_json");
    let (s, body) = a
        .call(
            "POST",
            "/v1/proposals",
            OPERATOR,
            Some(json!({"event_id": "e", "entity": {"type": "order", "id": "o"}, "args": {}})),
        )
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("`tool`"),
        "{body}"
    );
    let (s, body) = a.propose("e-bad", "capture_payment", json!("4.999")).await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["reason"], "invalid_args");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("amount"),
        "{body}"
    );
    let (s, body) = a
        .call("GET", "/v1/operations?status=done", VIEWER, None)
        .await;
    assert_eq!(
        (s, body["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_status"))
    );
    assert_eq!(
        a.call("GET", "/v1/operations/not-a-uuid", VIEWER, None)
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
}

/// DESIGN.md section 9 over HTTP: the same refusals as on Kafka, on either ledger, and
/// the ledger keeps working (a NUL used to fail the transaction as `503` on PostgreSQL).
#[tokio::test]
async fn hostile_proposals_are_400_naming_the_field_and_leave_no_trace() {
    let a = api().await;
    let post = |body: String| {
        a.http
            .post(format!("{}/v1/proposals", a.url))
            .bearer_auth(OPERATOR_SECRET)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let base = r#"{"event_id": "EVT", "tool": "capture_payment", "entity": {"type": "order", "id": "ID"}, "args": {"amount": "AMOUNT", "currency": "usd"}}"#;
    let huge = "f".repeat(3000);
    let cases = [
        (base.replace("ID", "o\\u0000"), "entity.id"),
        (base.replace("EVT", "e\\u0000"), "event_id"),
        (base.replace("ID", "o\\n1"), "entity.id"),
        (base.replace("EVT", &huge), "event_id"),
        (base.replace("AMOUNT", "1\\u0000"), "args.amount"),
        (
            base.replace(
                r#""amount": "AMOUNT""#,
                r#""amount": "1.00", "amount": "1000.00""#,
            ),
            "args.amount",
        ),
    ];
    for (body, field) in cases {
        let res = post(body.clone()).await.expect("send");
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{body}");
        let err: Value = res.json().await.expect("json");
        assert_eq!(err["error"]["code"], "schema_violation", "{err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains(&format!("`{field}`")),
            "{field}: {err}"
        );
    }
    let page = a.ledger.list(&Default::default()).await.expect("list");
    assert!(page.operations.is_empty(), "nothing reached the ledger");
    let (s, body) = a.propose("e-good", "capture_payment", json!("1.00")).await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    // Item 7: the same event id with other content is a 409, never the first answer.
    let (s, body) = a
        .propose("e-good", "capture_payment", json!("1000.00"))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["reason"], "event_id_conflict");
    let (s, body) = a.propose("e-good", "capture_payment", json!("1.00")).await;
    assert_eq!(
        (s, body["inbox_hit"].clone()),
        (StatusCode::OK, json!(true))
    );
}

#[tokio::test]
async fn proposals_over_http_dedupe_like_kafka_and_can_be_inspected() {
    let a = api().await;
    let (s, first) = a.propose("e1", "capture_payment", json!("49.00")).await;
    assert_eq!(s, StatusCode::CREATED, "{first}");
    assert_eq!(first["decision"], "accepted");
    let id = first["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let (s, again) = a.propose("e2", "capture_payment", json!(49)).await;
    assert_eq!(
        (s, again["decision"].clone(), again["reason"].clone()),
        (StatusCode::OK, json!("deduplicated"), json!("key"))
    );
    assert_eq!(again["operation"]["operation_id"], json!(id));
    // The W3C trace context of an HTTP proposal is kept, as a Kafka header's is.
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let traced: Value = a
        .http
        .post(format!("{}/v1/proposals", a.url))
        .bearer_auth(OPERATOR_SECRET)
        .header("traceparent", traceparent)
        .json(&json!({"event_id": "e9", "tool": "capture_payment",
            "entity": {"type": "order", "id": "o9"}, "args": {"amount": "1", "currency": "usd"}}))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(traced["operation"]["traceparent"], traceparent, "{traced}");
    let (s, redelivered) = a.propose("e1", "capture_payment", json!("49.00")).await;
    assert_eq!(
        (s, redelivered["inbox_hit"].clone()),
        (StatusCode::OK, json!(true))
    );

    let (s, op) = a
        .call("GET", &format!("/v1/operations/{id}"), VIEWER, None)
        .await;
    assert_eq!(
        (s, op["status"].clone()),
        (StatusCode::OK, json!("pending_dispatch"))
    );
    assert_eq!(op["idempotency_key"], "payment:o1:capture:4900:USD:v1");
    let (_, list) = a
        .call(
            "GET",
            "/v1/operations?tool=capture_payment&entity=order:o1",
            VIEWER,
            None,
        )
        .await;
    assert_eq!(list["operations"].as_array().map(Vec::len), Some(1));
    let (_, events) = a
        .call("GET", &format!("/v1/operations/{id}/events"), VIEWER, None)
        .await;
    assert_eq!(events["events"][0]["to"], "pending_dispatch");
    let missing = uuid::Uuid::now_v7();
    let (s, body) = a
        .call("GET", &format!("/v1/operations/{missing}"), VIEWER, None)
        .await;
    assert_eq!(
        (s, body["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
}

#[tokio::test]
async fn approve_and_resolve_change_the_ledger_and_publish_results() {
    let a = api().await;
    let (_, refund) = a.propose("r1", "refund", json!(5)).await;
    let rid = refund["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    assert_eq!(refund["operation"]["status"], "awaiting_approval");
    assert_eq!(
        a.call(
            "POST",
            &format!("/v1/operations/{rid}/approve"),
            VIEWER,
            None
        )
        .await
        .0,
        StatusCode::FORBIDDEN
    );
    let (s, approved) = a
        .call(
            "POST",
            &format!("/v1/operations/{rid}/approve"),
            OPERATOR,
            Some(json!({"reason": "customer verified"})),
        )
        .await;
    assert_eq!(
        (s, approved["status"].clone()),
        (StatusCode::OK, json!("pending_dispatch"))
    );
    let (s, body) = a
        .call(
            "POST",
            &format!("/v1/operations/{rid}/approve"),
            OPERATOR,
            None,
        )
        .await;
    assert_eq!(
        (s, body["error"]["code"].clone()),
        (StatusCode::CONFLICT, json!("illegal_transition"))
    );

    // Put the refund into unknown_outcome as a dispatcher would, then resolve it.
    let claim = a
        .ledger
        .claim(&ClaimRequest {
            owner: "w".into(),
            lease: Duration::from_secs(60),
            limit: 1,
            ..Default::default()
        })
        .await
        .expect("claim")
        .remove(0);
    a.ledger
        .record(&[Recording::new(
            claim.operation.operation_id,
            claim.epoch(),
            Event::OutcomeUnknown,
            "timeout_after_send",
        )])
        .await
        .expect("record");
    let (s, body) = a
        .call(
            "POST",
            &format!("/v1/operations/{rid}/resolve"),
            OPERATOR,
            Some(json!({"resolution": "maybe"})),
        )
        .await;
    assert_eq!(
        (s, body["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_body"))
    );
    let (s, resolved) = a.call("POST", &format!("/v1/operations/{rid}/resolve"), OPERATOR, Some(json!({"resolution": "succeeded", "result": {"refund_id": "re_1"}, "reason": "seen at the provider"}))).await;
    assert_eq!(
        (s, resolved["status"].clone(), resolved["result"].clone()),
        (
            StatusCode::OK,
            json!("completed_success"),
            json!({"refund_id": "re_1"})
        )
    );
    let (_, events) = a
        .call("GET", &format!("/v1/operations/{rid}/events"), VIEWER, None)
        .await;
    let last = events["events"]
        .as_array()
        .and_then(|e| e.last())
        .cloned()
        .expect("event");
    assert_eq!(
        (last["actor"].clone(), last["reason"].clone()),
        (json!("otto"), json!("seen at the provider"))
    );
    let results = a
        .ledger
        .claim_results(&ClaimRequest {
            owner: "relay".into(),
            lease: Duration::from_secs(60),
            limit: 100,
            ..Default::default()
        })
        .await
        .expect("results");
    let statuses: Vec<&str> = results
        .iter()
        .filter(|r| r.operation_id.map(|u| u.to_string()) == Some(rid.clone()))
        .map(|r| r.status.as_str())
        .collect();
    assert!(
        statuses.ends_with(&[
            "pending_dispatch",
            "dispatched",
            "unknown_outcome",
            "completed_success"
        ]),
        "{statuses:?}"
    );
}

#[tokio::test]
async fn get_with_wait_long_polls_until_settled_or_timeout() {
    let a = api().await;
    let (_, p) = a.propose("w1", "capture_payment", json!(1)).await;
    let id = p["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let started = Instant::now();
    let (s, op) = a
        .call("GET", &format!("/v1/operations/{id}?wait=1s"), VIEWER, None)
        .await;
    assert_eq!(
        (s, op["status"].clone()),
        (StatusCode::OK, json!("pending_dispatch"))
    );
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "waited for the timeout"
    );
    let ledger = a.ledger.clone();
    let settle = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let c = ledger
            .claim(&ClaimRequest {
                owner: "w".into(),
                lease: Duration::from_secs(60),
                limit: 1,
                ..Default::default()
            })
            .await
            .expect("claim")
            .remove(0);
        ledger
            .record(&[Recording::new(
                c.operation.operation_id,
                c.epoch(),
                Event::Succeed,
                "committed",
            )])
            .await
            .expect("record");
    });
    let started = Instant::now();
    let (_, op) = a
        .call(
            "GET",
            &format!("/v1/operations/{id}?wait=10s"),
            VIEWER,
            None,
        )
        .await;
    settle.await.expect("settle");
    assert_eq!(op["status"], "completed_success");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "returned as soon as it settled"
    );
}

/// The message of an error answer.
fn message(body: &Value) -> String {
    body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn an_agent_token_proposes_as_its_agent_and_cannot_approve() {
    let a = api().await;
    // The proposal's agent_id comes from the token.
    let (s, refund) = a.propose("r1", "refund", json!(5)).await;
    assert_eq!(s, StatusCode::CREATED, "{refund}");
    assert_eq!(refund["operation"]["agent_id"], "bot");
    let id = refund["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let approve = format!("/v1/operations/{id}/approve");
    let (s, body) = a.call("POST", &approve, AGENT, None).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(message(&body).contains("operator"), "{body}");
    // Another agent neither sees it nor lists it; the owner does.
    let (s, _) = a
        .call("GET", &format!("/v1/operations/{id}"), RIVAL, None)
        .await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "another agent's operation is not found"
    );
    let (s, _) = a
        .call("GET", &format!("/v1/operations/{id}/events"), RIVAL, None)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, page) = a.call("GET", "/v1/operations", RIVAL, None).await;
    assert_eq!(page["operations"], json!([]), "{page}");
    let (s, mine) = a.call("GET", "/v1/operations", AGENT, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(mine["operations"][0]["operation_id"], json!(id));
    let (s, body) = a
        .call("GET", "/v1/operations?agent_id=rival", AGENT, None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    let (s, _) = a
        .call("GET", "/v1/operations?namespace=other", AGENT, None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(
        a.call("GET", "/metrics", AGENT, None).await.0,
        StatusCode::FORBIDDEN
    );
    // An operator approves it.
    let (s, body) = a.call("POST", &approve, OPERATOR, None).await;
    assert_eq!(
        (s, body["status"].clone()),
        (StatusCode::OK, json!("pending_dispatch"))
    );
}

#[tokio::test]
async fn an_agent_cannot_speak_for_another_agent_or_namespace() {
    let a = api().await;
    let proposal = |patch: Value| {
        let mut p = json!({"event_id": "s1", "tool": "capture_payment",
            "entity": {"type": "order", "id": "o1"}, "args": {"amount": "5.00", "currency": "usd"}});
        for (k, v) in patch.as_object().expect("object") {
            p[k] = v.clone();
        }
        p
    };
    let (s, body) = a
        .call(
            "POST",
            "/v1/proposals",
            AGENT,
            Some(proposal(json!({"agent_id": "rival"}))),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(message(&body).contains("`agent_id`"), "{body}");
    assert!(
        !message(&body).contains("rival"),
        "a refusal names no other principal: {body}"
    );
    let (s, body) = a
        .call(
            "POST",
            "/v1/proposals",
            AGENT,
            Some(proposal(json!({"namespace": "other"}))),
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(message(&body).contains("`namespace`"), "{body}");
    // Nothing was written by the refusals; its own agent_id in the body is fine.
    assert_eq!(
        a.ledger
            .list(&Default::default())
            .await
            .expect("list")
            .operations
            .len(),
        0
    );
    let (s, body) = a
        .call(
            "POST",
            "/v1/proposals",
            AGENT,
            Some(proposal(json!({"agent_id": "bot"}))),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    // The same event again without agent_id in the body is a redelivery, not a conflict.
    let (s, body) = a
        .call("POST", "/v1/proposals", AGENT, Some(proposal(json!({}))))
        .await;
    assert_eq!(
        (s, body["inbox_hit"].clone()),
        (StatusCode::OK, json!(true)),
        "{body}"
    );
}

#[tokio::test]
async fn an_operator_never_approves_its_own_proposal() {
    let a = api().await;
    let body = json!({"event_id": "own", "tool": "refund", "entity": {"type": "order", "id": "o9"},
        "args": {"amount": 5}});
    let (s, refund) = a.call("POST", "/v1/proposals", OPERATOR, Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{refund}");
    let id = refund["operation"]["operation_id"].as_str().expect("id");
    let approve = format!("/v1/operations/{id}/approve");
    let (s, body) = a.call("POST", &approve, OPERATOR, None).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(message(&body).contains("another operator"), "{body}");
    // The history records who proposed it; a second operator approves.
    let (_, events) = a
        .call("GET", &format!("/v1/operations/{id}/events"), VIEWER, None)
        .await;
    assert_eq!(events["events"][0]["actor"], "otto", "{events}");
    let (s, body) = a.call("POST", &approve, OPERATOR_TWO, None).await;
    assert_eq!(
        (s, body["status"].clone()),
        (StatusCode::OK, json!("pending_dispatch"))
    );
}

#[tokio::test]
async fn a_viewer_only_reads_and_the_bearer_scheme_is_case_insensitive() {
    let a = api().await;
    let (_, refund) = a.propose("v1", "refund", json!(5)).await;
    let id = refund["operation"]["operation_id"].as_str().expect("id");
    for action in ["approve", "reject", "cancel", "resolve", "compensate"] {
        let (s, _) = a
            .call(
                "POST",
                &format!("/v1/operations/{id}/{action}"),
                VIEWER,
                None,
            )
            .await;
        assert_eq!(s, StatusCode::FORBIDDEN, "viewer {action}");
    }
    assert_eq!(
        a.call("GET", "/metrics", VIEWER, None).await.0,
        StatusCode::OK
    );
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let status = a
            .http
            .get(format!("{}/v1/operations", a.url))
            .header("authorization", format!("{scheme} {VIEWER_SECRET}"))
            .send()
            .await
            .expect("request")
            .status();
        assert_eq!(status, StatusCode::OK, "scheme {scheme}");
    }
}

#[tokio::test]
async fn args_schema_refusals_name_the_path() {
    let a = api().await;
    for (event, amount) in [
        ("n1", json!("-49.00")),
        ("n2", json!("0.00")),
        ("n3", json!(-1)),
    ] {
        let (s, body) = a.propose(event, "capture_payment", amount.clone()).await;
        assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{amount}: {body}");
        assert_eq!(body["reason"], "args_schema", "{body}");
        let m = body["message"].as_str().unwrap_or_default();
        assert!(m.contains("`/amount`"), "{m}");
    }
    let (s, body) = a.propose("p1", "capture_payment", json!("49.00")).await;
    assert_eq!(s, StatusCode::CREATED, "{body}");
    assert_eq!(body["operation"]["canonical_args"]["amount"], 4900);
}

#[tokio::test]
async fn a_bad_status_filter_lists_the_states() {
    let a = api().await;
    let (s, body) = a
        .call("GET", "/v1/operations?status=bogus", VIEWER, None)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let m = message(&body);
    for state in [
        "pending_dispatch",
        "unknown_outcome",
        "needs_attention",
        "compensated",
    ] {
        assert!(m.contains(state), "{m}");
    }
}

#[tokio::test]
async fn the_console_is_served_without_a_token_under_a_strict_policy() {
    let a = api().await;
    let res = a
        .http
        .get(format!("{}/ui", a.url))
        .send()
        .await
        .expect("get /ui");
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.url().path().ends_with("/ui/"), "{}", res.url());
    let policy = res.headers()["content-security-policy"]
        .to_str()
        .expect("policy")
        .to_owned();
    assert!(
        policy.contains("script-src 'self'") && policy.contains("default-src 'none'"),
        "{policy}"
    );
    let page = res.text().await.expect("page");
    assert!(page.contains("/ui/console.js") && page.contains("sign-in-form"));
    for (path, kind) in [
        ("/ui/console.js", "text/javascript"),
        ("/ui/console.css", "text/css"),
    ] {
        let res = a
            .http
            .get(format!("{}{path}", a.url))
            .send()
            .await
            .expect("asset");
        assert_eq!(res.status(), StatusCode::OK, "{path}");
        assert!(
            res.headers()["content-type"]
                .to_str()
                .is_ok_and(|t| t.starts_with(kind)),
            "{path}"
        );
    }
    // The data behind it still needs a token.
    assert_eq!(
        a.call("GET", "/v1/overview", None, None).await.0,
        StatusCode::UNAUTHORIZED
    );
    let (s, who) = a.call("GET", "/v1/me", VIEWER, None).await;
    assert_eq!(
        (s, who["name"].clone(), who["role"].clone()),
        (StatusCode::OK, json!("vera"), json!("viewer"))
    );
    let (_, who) = a.call("GET", "/v1/me", AGENT, None).await;
    assert_eq!(
        (who["role"].clone(), who["agent_id"].clone()),
        (json!("agent"), json!("bot"))
    );
}

/// A refund proposed, approved, sent, answered ambiguously and resolved by a person: the
/// console's timeline and overview read all of it back.
#[tokio::test]
async fn timeline_and_overview_read_attempts_results_and_ambiguity() {
    let a = api().await;
    let (_, refund) = a.propose("t1", "refund", json!(7)).await;
    let id = refund["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    a.call(
        "POST",
        &format!("/v1/operations/{id}/approve"),
        OPERATOR,
        Some(json!({"reason": "ok"})),
    )
    .await;
    let claim = a
        .ledger
        .claim(&ClaimRequest {
            owner: "worker-1".into(),
            lease: Duration::from_secs(60),
            limit: 1,
            ..Default::default()
        })
        .await
        .expect("claim")
        .remove(0);
    let mut rec = Recording::new(
        claim.operation.operation_id,
        claim.epoch(),
        Event::OutcomeUnknown,
        "timeout_after_send",
    );
    rec.attempt = Some((
        claim.attempt_id.expect("attempt"),
        opgate_store::AttemptReport {
            outcome: "timeout_after_send".into(),
            error_category: Some("timeout".into()),
            latency: Some(Duration::from_millis(1500)),
            ..Default::default()
        },
    ));
    a.ledger.record(&[rec]).await.expect("record");
    a.call(
        "POST",
        &format!("/v1/operations/{id}/resolve"),
        OPERATOR,
        Some(json!({"resolution": "noop", "reason": "seen at the provider"})),
    )
    .await;

    let (s, attempts) = a
        .call(
            "GET",
            &format!("/v1/operations/{id}/attempts"),
            VIEWER,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{attempts}");
    let first = &attempts["attempts"][0];
    assert_eq!(
        (
            first["number"].clone(),
            first["worker"].clone(),
            first["outcome"].clone(),
            first["latency_ms"].clone()
        ),
        (
            json!(1),
            json!("worker-1"),
            json!("timeout_after_send"),
            json!(1500)
        )
    );

    // Publish the first two result rows: the rest stay unpublished.
    let rows = a
        .ledger
        .claim_results(&ClaimRequest {
            owner: "relay".into(),
            lease: Duration::from_secs(60),
            limit: 2,
            ..Default::default()
        })
        .await
        .expect("claim results");
    a.ledger
        .mark_published(&rows.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .expect("mark");
    let (_, results) = a
        .call("GET", &format!("/v1/operations/{id}/results"), VIEWER, None)
        .await;
    let results = results["results"].as_array().expect("results").clone();
    let statuses: Vec<&str> = results
        .iter()
        .map(|r| r["status"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        statuses,
        [
            "awaiting_approval",
            "pending_dispatch",
            "dispatched",
            "unknown_outcome",
            "completed_noop"
        ]
    );
    let published: Vec<bool> = results
        .iter()
        .map(|r| r["published_at"].is_string())
        .collect();
    assert_eq!(published, [true, true, false, false, false]);

    let (s, o) = a.call("GET", "/v1/overview?window=1h", VIEWER, None).await;
    assert_eq!(s, StatusCode::OK, "{o}");
    assert_eq!(o["window_seconds"], 3600);
    assert_eq!(o["decisions"], json!([{"name": "accepted", "count": 1}]));
    assert_eq!(o["unknown"]["entered"], 1);
    assert_eq!(
        o["unknown"]["resolved"],
        json!([{"name": "person/completed_noop", "count": 1}])
    );
    assert_eq!(o["unknown"]["resolved_without_person"], 0.0);
    assert!(o["unknown"]["p99_ms"].as_i64().is_some_and(|ms| ms >= 0));
    assert_eq!(o["relay_pending"], 3);
    for (query, token, code) in [
        ("?window=30s", VIEWER, StatusCode::BAD_REQUEST),
        ("?window=8d", VIEWER, StatusCode::BAD_REQUEST),
        ("?window=soon", VIEWER, StatusCode::BAD_REQUEST),
        ("", AGENT, StatusCode::FORBIDDEN),
    ] {
        let (s, body) = a
            .call("GET", &format!("/v1/overview{query}"), token, None)
            .await;
        assert_eq!(s, code, "{query}: {body}");
        assert!(!message(&body).is_empty());
    }
}

#[tokio::test]
async fn an_operation_id_may_be_shortened_to_a_unique_prefix() {
    let a = api().await;
    let (_, one) = a.propose("p1", "capture_payment", json!(1)).await;
    let (_, two) = a.propose("p2", "capture_payment", json!(2)).await;
    let one = one["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let two = two["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    // The shortest prefix of `one` that `two` does not share (ids are time-ordered, so
    // they share a long start), and a few more characters for good measure.
    let common = one
        .chars()
        .zip(two.chars())
        .take_while(|(x, y)| x == y)
        .count();
    let unique = &one[..(common + 1).max(4)];
    let (s, op) = a
        .call("GET", &format!("/v1/operations/{unique}"), VIEWER, None)
        .await;
    assert_eq!(
        (s, op["operation_id"].clone()),
        (StatusCode::OK, json!(one))
    );
    let (s, events) = a
        .call(
            "GET",
            &format!("/v1/operations/{unique}/events"),
            VIEWER,
            None,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{events}");
    let upper = unique.to_uppercase();
    assert_eq!(
        a.call("GET", &format!("/v1/operations/{upper}"), VIEWER, None)
            .await
            .1["operation_id"],
        json!(one)
    );
    if common >= 4 {
        let shared = &one[..common];
        let (s, body) = a
            .call("GET", &format!("/v1/operations/{shared}"), VIEWER, None)
            .await;
        assert_eq!(
            (s, body["error"]["code"].clone()),
            (StatusCode::BAD_REQUEST, json!("ambiguous_id")),
            "{body}"
        );
    }
    // A command names its operation in full.
    let (s, body) = a
        .call(
            "POST",
            &format!("/v1/operations/{unique}/cancel"),
            OPERATOR,
            Some(json!({"reason": "r"})),
        )
        .await;
    assert_eq!(
        (s, body["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_id")),
        "{body}"
    );
    let absent = if one.starts_with('0') { "ffff" } else { "0000" };
    for (path, token, code, want) in [
        (
            absent.to_owned(),
            VIEWER,
            StatusCode::NOT_FOUND,
            "operation_not_found",
        ),
        (
            one[..3].to_owned(),
            VIEWER,
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            "12g4".to_owned(),
            VIEWER,
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            "%00abcd".to_owned(),
            VIEWER,
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            "a".repeat(40),
            VIEWER,
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        // An agent names its operations in full.
        (
            unique.to_owned(),
            AGENT,
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
    ] {
        let (s, body) = a
            .call("GET", &format!("/v1/operations/{path}"), token, None)
            .await;
        assert_eq!(
            (s, body["error"]["code"].clone()),
            (code, json!(want)),
            "{path}: {body}"
        );
    }
}
