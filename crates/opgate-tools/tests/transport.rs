//! The HTTP adapter's transport-level classification against real sockets.

#![allow(missing_docs)]

use std::time::Duration;

use opgate_core::outcome::AdapterOutcome;
use opgate_core::{Entity, Operation, Registry, SideEffectClass, Status};
use opgate_tools::{DispatchRequest, HttpAdapter, ToolAdapter};
use serde_json::json;
use time::OffsetDateTime;
use uuid::Uuid;

fn operation() -> Operation {
    let now = OffsetDateTime::now_utc();
    Operation {
        operation_id: Uuid::now_v7(),
        namespace: "default".into(),
        idempotency_key: "k:v1".into(),
        key_components: json!({}),
        args_fingerprint: String::new(),
        event_id: "e".into(),
        agent_id: None,
        workflow_id: None,
        run_id: None,
        step: None,
        tool: "t".into(),
        intent: None,
        entity: Entity {
            kind: "order".into(),
            id: "o1".into(),
        },
        entity_key: "default:order:o1".into(),
        canonical_args: json!({"amount": 1}),
        side_effect_class: SideEffectClass::Irreversible,
        status: Status::Dispatched,
        attempt_count: 1,
        first_attempt_at: Some(now),
        unknown_since: None,
        ambiguous_since: None,
        next_attempt_at: None,
        lease_owner: None,
        lease_expires_at: None,
        lease_epoch: 1,
        external_request_id: None,
        external_object_id: None,
        result: None,
        error: None,
        compensates: None,
        traceparent: None,
        result_seq: 1,
        created_at: now,
        updated_at: now,
    }
}

fn adapter(url: &str, timeout_ms: u64) -> HttpAdapter {
    let toml = format!(
        "[[tools]]\nname = \"t\"\nside_effect_class = \"irreversible\"\n[tools.adapter]\nkind = \"http\"\nurl = \"{url}\"\ntimeout_ms = {timeout_ms}\nidempotency_header = \"Idempotency-Key\""
    );
    let registry = Registry::from_toml(&toml).expect("registry");
    HttpAdapter::new(registry.tool("t").expect("tool"), |_| None).expect("adapter")
}

async fn call(adapter: &HttpAdapter) -> AdapterOutcome {
    let op = operation();
    adapter
        .dispatch(&DispatchRequest {
            operation: &op,
            attempt_id: Uuid::now_v7(),
            provider_key: "default/k:v1",
            traceparent: None,
        })
        .await
        .outcome
}

#[tokio::test]
async fn connection_refused_is_not_sent() {
    // Bind then drop a listener: the port is closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let outcome = call(&adapter(&format!("http://127.0.0.1:{port}/x"), 500)).await;
    assert_eq!(outcome, AdapterOutcome::NotSent);
}

#[tokio::test]
async fn a_request_that_was_accepted_but_never_answered_is_sent_no_answer() {
    // Accept the connection, read the request, never answer.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = vec![0u8; 4096];
        let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let outcome = call(&adapter(&format!("http://{addr}/x"), 300)).await;
    assert_eq!(outcome, AdapterOutcome::SentNoAnswer);
}

#[tokio::test]
async fn a_connection_reset_after_the_request_is_sent_no_answer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = vec![0u8; 4096];
        let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
        drop(socket);
    });
    let outcome = call(&adapter(&format!("http://{addr}/x"), 2000)).await;
    assert_eq!(outcome, AdapterOutcome::SentNoAnswer);
}

/// A key or entity that cannot travel in a header stops the call before anything is
/// sent: no connection is even opened (an accepted connection would fail the test).
#[tokio::test]
async fn a_key_or_entity_that_is_not_a_header_value_is_never_sent() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let adapter = adapter(&format!("http://{addr}/x"), 500);
    let bad_key = operation();
    let mut bad_entity = operation();
    bad_entity.entity.id = "o\r\nX-Injected: 1".into();
    let cases = [
        (bad_key.clone(), "default/k\n:v1"),
        (bad_key, "default/k\u{7f}:v1"),
        (bad_entity, "default/k:v1"),
    ];
    for (op, key) in cases {
        let report = adapter
            .dispatch(&DispatchRequest {
                operation: &op,
                attempt_id: Uuid::now_v7(),
                provider_key: key,
                traceparent: None,
            })
            .await;
        assert_eq!(report.outcome, AdapterOutcome::Unsendable, "{key:?}");
        assert!(
            report
                .detail
                .as_deref()
                .unwrap_or_default()
                .contains("nothing was sent"),
            "{report:?}"
        );
    }
    let accepted = tokio::time::timeout(Duration::from_millis(300), listener.accept()).await;
    assert!(accepted.is_err(), "a connection reached the provider");
}

/// Answers every request on `listener` with `status` and `body`, then closes.
async fn answer_with(listener: tokio::net::TcpListener, status: &'static str, body: &'static [u8]) {
    use tokio::io::AsyncWriteExt;
    while let Ok((mut socket, _)) = listener.accept().await {
        let mut buf = vec![0u8; 8192];
        let _ = tokio::io::AsyncReadExt::read(&mut socket, &mut buf).await;
        let head = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = socket.write_all(head.as_bytes()).await;
        let _ = socket.write_all(body).await;
    }
}

/// A provider's answer with a NUL (a `\u0000` escape in its JSON, or a raw NUL in an
/// error body) must not make the outcome unrecordable: PostgreSQL cannot store it, so the
/// adapter reports it with U+FFFD instead, never dropping the answer.
#[tokio::test]
async fn a_nul_in_a_providers_answer_is_made_storable() {
    let ok = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let ok_addr = ok.local_addr().expect("addr");
    tokio::spawn(answer_with(
        ok,
        "200 OK",
        br#"{"charge_id": "ch\u0000_1", "k\u0000": 1}"#,
    ));
    let op = operation();
    let report = adapter(&format!("http://{ok_addr}/x"), 1000)
        .dispatch(&DispatchRequest {
            operation: &op,
            attempt_id: Uuid::now_v7(),
            provider_key: "default/k:v1",
            traceparent: None,
        })
        .await;
    assert_eq!(
        report.outcome,
        AdapterOutcome::Committed {
            acknowledged: false
        }
    );
    assert_eq!(
        report.result,
        Some(json!({"charge_id": "ch\u{fffd}_1", "k\u{fffd}": 1}))
    );

    let failing = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let failing_addr = failing.local_addr().expect("addr");
    tokio::spawn(answer_with(
        failing,
        "422 Unprocessable Entity",
        b"bad\0input",
    ));
    let report = adapter(&format!("http://{failing_addr}/x"), 1000)
        .dispatch(&DispatchRequest {
            operation: &op,
            attempt_id: Uuid::now_v7(),
            provider_key: "default/k:v1",
            traceparent: None,
        })
        .await;
    assert_eq!(
        report.outcome,
        AdapterOutcome::Rejected { status: Some(422) }
    );
    let detail = report.detail.expect("detail");
    assert!(!detail.contains('\0'), "{detail:?}");
    assert!(detail.contains("bad\u{fffd}input"), "{detail:?}");
}
