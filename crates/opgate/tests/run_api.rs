//! `opgate run --roles api,dispatch,reconcile` as a real process: a proposal over HTTP is
//! dispatched to the simulated provider and the long-poll returns the settled operation;
//! the `[metrics]` listener (set with `--set metrics.listen=...`) serves the counters and
//! the probes;
//! SIGTERM ends the process cleanly.

#![allow(missing_docs)]

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opgate_sim::{Sim, SimConfig};
use serde_json::{Value, json};
use uuid::Uuid;

const CONFIG: &str = r#"
[worker]
lease_ms = 5000

[api]
listen = "127.0.0.1:PORT"
[[api.tokens]]
name = "ops"
role = "operator"
secret = "${TEST_OPERATOR_TOKEN}"

[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/payments"
timeout_ms = 1000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${OPGATE_SIM_URL}/payments?idempotency_key={key}"
external_id_pointer = "/charge_id"
"#;

const TOKEN: &str = "s3cret-s3cret-s3cret";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// An `opgate run` child process with `CONFIG` (plus `extra` TOML) over a migrated
/// ledger, its tools calling `provider`, once its API answers `/readyz`.
struct Run {
    child: support::Reaped,
    http: reqwest::Client,
    base: String,
}

impl Run {
    async fn start(
        name: &str,
        extra: &str,
        roles: &str,
        provider: std::net::SocketAddr,
        sets: &[String],
    ) -> Self {
        let dir = std::env::temp_dir().join(format!("opgate-{name}-{}", Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("dir");
        let url = opgate_testkit::database_url(&dir).await;
        opgate_store::migrate(&url).await.expect("migrate");
        let port = free_port();
        let config = dir.join("opgate.toml");
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = \"{url}\"\n{extra}{}",
                CONFIG.replace("PORT", &port.to_string())
            ),
        )
        .expect("config");
        let mut command = Command::new(env!("CARGO_BIN_EXE_opgate"));
        command
            .args(["run", "--config"])
            .arg(&config)
            .args(["--roles", roles]);
        for set in sets {
            command.arg("--set").arg(set);
        }
        let child = support::Reaped::spawn(
            command
                .env("OPGATE_SIM_URL", format!("http://{provider}"))
                .env("TEST_OPERATOR_TOKEN", TOKEN)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(dir.join("opgate.log")).expect("log"),
                )),
        );
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while http
            .get(format!("{base}/readyz"))
            .send()
            .await
            .map(|r| r.status().is_success())
            .ok()
            != Some(true)
        {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the API never became ready; see {}",
                dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Self { child, http, base }
    }

    /// Proposes over HTTP (with a `traceparent` header when given), expects it accepted,
    /// and long-polls the operation until it settles.
    async fn propose_and_settle(&self, proposal: Value, traceparent: Option<&str>) -> Value {
        let mut post = self
            .http
            .post(format!("{}/v1/proposals", self.base))
            .bearer_auth(TOKEN);
        if let Some(tp) = traceparent {
            post = post.header("traceparent", tp);
        }
        let created: Value = post
            .json(&proposal)
            .send()
            .await
            .expect("post")
            .json()
            .await
            .expect("json");
        assert_eq!(created["decision"], "accepted", "{created}");
        let id = created["operation"]["operation_id"]
            .as_str()
            .expect("id")
            .to_owned();
        self.http
            .get(format!("{}/v1/operations/{id}?wait=15s", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_proposal_over_http_is_dispatched_once_and_sigterm_stops_cleanly() {
    let metrics_port = free_port();
    let sim = Sim::new(SimConfig::default());
    let (sim_addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("sim");
    let mut run = Run::start(
        "run-api",
        "",
        "api,dispatch,reconcile",
        sim_addr,
        &[format!("metrics.listen=127.0.0.1:{metrics_port}")],
    )
    .await;
    let http = run.http.clone();
    let settled = run
        .propose_and_settle(
            json!({"event_id": "http-1", "tool": "capture_payment", "entity": {"type": "order", "id": "o1"},
                "args": {"amount": "49.00", "currency": "usd"}}),
            None,
        )
        .await;
    assert_eq!(settled["status"], "completed_success", "{settled}");
    assert!(
        settled["external_id"]
            .as_str()
            .is_some_and(|s| s.starts_with("ch_"))
    );
    assert_eq!((sim.effects().total, sim.effects().duplicates), (1, 0));

    // The `[metrics]` listener serves this process's counters without a token.
    let metrics = http
        .get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .send()
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("body");
    assert!(
        metrics
            .lines()
            .any(|l| l == "opgate_attempts_total{outcome=\"committed\",tool=\"capture_payment\"} 1"),
        "{metrics}"
    );
    // And the ledger's gauges: no relay runs here, so the results wait in the outbox.
    let pending = metrics
        .lines()
        .find_map(|l| l.strip_prefix("opgate_relay_pending "))
        .and_then(|v| v.parse::<f64>().ok());
    assert!(pending.is_some_and(|n| n >= 3.0), "{metrics}");
    // It serves the probes too (for role groups without the API): alive, and ready with
    // the ledger at this build's schema (no broker is configured, so none is checked).
    for probe in ["/healthz", "/readyz"] {
        let res = http
            .get(format!("http://127.0.0.1:{metrics_port}{probe}"))
            .send()
            .await
            .expect("probe");
        let status = res.status();
        let body = res.text().await.expect("body");
        assert!(status.is_success(), "{probe}: {status} {body}");
        if probe == "/readyz" {
            assert!(body.contains("\"ledger\":\"ok\""), "{body}");
        }
    }

    // SIGTERM: the roles drain and the process exits successfully.
    let status = support::terminate(&mut run.child, "opgate run");
    assert!(
        status.success(),
        "opgate exited with {status:?} after SIGTERM"
    );
}

/// `[telemetry] otlp_endpoint`: the provider call is a span in the proposing agent's
/// trace, exported over OTLP/HTTP, and the provider is sent a `traceparent` naming that
/// span (same trace, opgate's span as the parent).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn provider_calls_are_exported_as_spans_of_the_agents_trace() {
    use axum::body::Bytes;
    use axum::http::HeaderMap;
    use std::sync::{Arc, Mutex};

    // A collector that keeps every export, and a provider that keeps every traceparent.
    let exports: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let (e, s) = (exports.clone(), seen.clone());
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(move |body: Bytes| async move {
                e.lock().expect("lock").push(body);
                ""
            }),
        )
        .route(
            "/payments",
            axum::routing::post(move |headers: HeaderMap| async move {
                if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
                    s.lock().expect("lock").push(tp.to_owned());
                }
                axum::Json(json!({"charge_id": "ch_otlp"}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let fake = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut run = Run::start(
        "otlp",
        &format!(
            "[telemetry]\notlp_endpoint = \"http://{fake}\"\nservice_name = \"opgate-test\"\n"
        ),
        "api,dispatch",
        fake,
        &[],
    )
    .await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let agent_span = "00f067aa0ba902b7";
    let settled = run
        .propose_and_settle(
            json!({"event_id": "otlp-1", "tool": "capture_payment",
                "entity": {"type": "order", "id": "o1"}, "args": {"amount": "5.00", "currency": "usd"}}),
            Some(&format!("00-{trace_id}-{agent_span}-01")),
        )
        .await;
    assert_eq!(settled["status"], "completed_success", "{settled}");

    // The provider saw the agent's trace with opgate's call span as the parent.
    let sent = seen.lock().expect("lock").clone();
    assert_eq!(sent.len(), 1, "{sent:?}");
    let parts: Vec<&str> = sent[0].split('-').collect();
    assert_eq!((parts[0], parts[1]), ("00", trace_id), "{sent:?}");
    assert_ne!(
        parts[2], agent_span,
        "the provider's parent is opgate's span: {sent:?}"
    );
    // The collector got that span (protobuf: the ids as raw bytes, names as text).
    let hex = |s: &str| {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect::<Vec<u8>>()
    };
    let contains = |body: &[u8], needle: &[u8]| body.windows(needle.len()).any(|w| w == needle);
    let wanted: [Vec<u8>; 5] = [
        hex(trace_id),
        hex(parts[2]),
        hex(agent_span),
        b"opgate.dispatch".to_vec(),
        b"opgate-test".to_vec(),
    ];
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let bodies = exports.lock().expect("lock").clone();
        if bodies.iter().any(|b| wanted.iter().all(|w| contains(b, w))) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no export with the call span ({} exports)",
            bodies.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = support::terminate(&mut run.child, "opgate run");
    assert!(status.success(), "{status:?}");
}
