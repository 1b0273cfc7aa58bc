//! `/healthz`, `/readyz` (no token) and `/metrics` (viewer or operator; or without a
//! token on the separate `[metrics] listen` address, which serves the probes too).

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Json, Router};
use opgate_store::SharedLedger;
use serde_json::{Value, json};

use crate::auth::Principal;
use crate::error::ApiError;
use crate::{ApiState, ReadinessCheck};

/// `/readyz`: the ledger reachable with the schema this build knows, and every added
/// check (the broker in `opgate run` and `opgate dev`) answering.
pub(crate) async fn ready(State(state): State<ApiState>) -> Response {
    readiness(&state.ledger, &state.checks).await
}

/// The `/readyz` answer over a ledger and the added checks (the API's and the metrics
/// listener's).
async fn readiness(ledger: &SharedLedger, checks: &[(&'static str, ReadinessCheck)]) -> Response {
    let mut body = serde_json::Map::new();
    let mut failure = None;
    match ledger.schema_status().await {
        Ok(s) if s.is_current() => {
            body.insert("ledger".into(), json!("ok"));
            body.insert("schema_version".into(), json!(s.found));
        }
        Ok(s) => {
            let message = format!(
                "schema version {} but this build needs {}",
                s.found, s.known
            );
            body.insert("ledger".into(), json!(message));
            failure.get_or_insert(("schema_mismatch", message));
        }
        Err(e) => {
            // `/readyz` answers without a token: the database's own words (role,
            // database and host names) go to the log, not to the caller.
            tracing::warn!(error = %e, "readiness: the ledger is unavailable");
            body.insert("ledger".into(), json!("unavailable"));
            failure.get_or_insert(("ledger_unavailable", "ledger: unavailable".to_owned()));
        }
    }
    for (name, check) in checks {
        match check().await {
            Ok(()) => {
                body.insert((*name).into(), json!("ok"));
            }
            Err(e) => {
                tracing::warn!(check = *name, error = %e, "readiness: a dependency is unavailable");
                body.insert((*name).into(), json!("unavailable"));
                failure.get_or_insert(("dependency_unavailable", format!("{name}: unavailable")));
            }
        }
    }
    match failure {
        None => (StatusCode::OK, Json(Value::Object(body))).into_response(),
        Some((code, message)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error": {"code": code, "message": message}, "checks": body})),
        )
            .into_response(),
    }
}

/// `GET /metrics` (viewer or operator): this process's counters and the ledger's gauges,
/// in the Prometheus text format.
pub(crate) async fn metrics(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
) -> Result<Response, ApiError> {
    caller.require_reader("/metrics")?;
    Ok(render_metrics(&state.ledger).await)
}

async fn render_metrics(ledger: &SharedLedger) -> Response {
    // Without the ledger, the process's own counters are still worth scraping.
    let gauges = match ledger.stats().await {
        Ok(stats) => Some(ledger_gauges(&stats)),
        Err(e) => {
            tracing::warn!(error = %e, "ledger gauges unavailable for /metrics");
            None
        }
    };
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        opgate_metrics::metrics().render(gauges.as_ref()),
    )
        .into_response()
}

/// The ledger's shape as the metrics crate's gauges.
pub fn ledger_gauges(stats: &opgate_store::LedgerStats) -> opgate_metrics::LedgerGauges {
    let age = |at: time::OffsetDateTime| (stats.now - at).as_seconds_f64().max(0.0);
    opgate_metrics::LedgerGauges {
        live: stats
            .live
            .iter()
            .map(|l| {
                (
                    l.tool.clone(),
                    l.class.clone(),
                    l.status.clone(),
                    l.count,
                    age(l.oldest_change),
                )
            })
            .collect(),
        queue: stats.queue.clone(),
        relay_pending: stats.relay_pending,
        relay_lag_seconds: stats.relay_oldest.map_or(0.0, age),
        relay_window: stats.relay_window,
    }
}

/// Serves `GET /metrics`, `/healthz` and `/readyz` (with these checks besides the
/// ledger), without tokens, on `addr`: for processes that do not run the admin API
/// (`[metrics] listen`), so that their probes and scrapes need no token. Bind it to an
/// internal interface.
pub async fn serve_metrics(
    addr: SocketAddr,
    ledger: SharedLedger,
    checks: Vec<(&'static str, ReadinessCheck)>,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    #[derive(Clone)]
    struct Scrape {
        ledger: SharedLedger,
        checks: std::sync::Arc<Vec<(&'static str, ReadinessCheck)>>,
    }
    let router = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Scrape>| async move { render_metrics(&s.ledger).await }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(s): State<Scrape>| async move { readiness(&s.ledger, &s.checks).await }),
        )
        .with_state(Scrape {
            ledger,
            checks: std::sync::Arc::new(checks),
        });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "metrics listener stopped");
        }
    });
    Ok((bound, handle))
}
