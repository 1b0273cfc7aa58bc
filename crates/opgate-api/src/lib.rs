//! The admin HTTP API (DESIGN.md section 6), bearer-token protected with two roles.
//!
//! - viewer: `GET /v1/operations`, `GET /v1/operations/{id}` (`?wait=10s` long-polls for
//!   a terminal state), `GET /v1/operations/{id}/events`;
//! - operator: everything a viewer may, plus `POST /v1/operations/{id}/{approve|reject|
//!   cancel|resolve|compensate}` and `POST /v1/proposals` (HTTP ingress for agents without a Kafka
//!   client; the same JSON as the topic, the same ledger path, so a proposal sent both ways
//!   is one operation);
//! - viewer: also `GET /metrics` (Prometheus text; scrape with a viewer token);
//! - no token: `/healthz` (alive) and `/readyz` (ledger reachable, schema current, and
//!   every added check — the broker in `opgate run` and `opgate dev` — answering).
//!
//! Errors are JSON `{"error": {"code", "message"}}`: 400 names the field at fault, 401/403
//! for tokens and roles, 404, 409 for a transition the state machine refuses. Tokens are
//! compared in constant time (over their SHA-256 digests).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use opgate_core::{
    Delivery, Event, IngestItem, Limits, Operation, Proposal, Registry, Resolution, Source, Status,
};
use opgate_store::{Command, IngestDecision, ListFilter, SharedLedger};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// A token's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Read only.
    Viewer,
    /// Read, decide and propose.
    Operator,
}

/// A bearer token.
#[derive(Debug, Clone)]
pub struct Token {
    /// Who (recorded as the actor of commands).
    pub name: String,
    /// The secret presented as `Authorization: Bearer <secret>`.
    pub secret: String,
    /// Its role.
    pub role: Role,
}

/// A dependency `/readyz` checks besides the ledger (the Kafka broker): `Ok` or why not.
pub type ReadinessCheck = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync,
>;

/// What the handlers share.
#[derive(Clone)]
pub struct ApiState {
    ledger: SharedLedger,
    registry: Arc<Registry>,
    limits: Limits,
    tokens: Arc<Vec<([u8; 32], String, Role)>>,
    checks: Vec<(&'static str, ReadinessCheck)>,
}

impl ApiState {
    /// State over a ledger and registry with these tokens.
    pub fn new(
        ledger: SharedLedger,
        registry: Arc<Registry>,
        limits: Limits,
        tokens: Vec<Token>,
    ) -> Self {
        let tokens = tokens
            .into_iter()
            .map(|t| (digest(&t.secret), t.name, t.role))
            .collect();
        Self {
            ledger,
            registry,
            limits,
            tokens: Arc::new(tokens),
            checks: Vec::new(),
        }
    }

    /// Adds a dependency `/readyz` checks, reported under `name` (e.g. `broker`).
    pub fn with_check(mut self, name: &'static str, check: ReadinessCheck) -> Self {
        self.checks.push((name, check));
        self
    }
}

fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Equal-length comparison whose time does not depend on where the bytes differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// An API error: an HTTP status and a `{"error": {"code", "message"}}` body.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({"error": {"code": self.code, "message": self.message}})),
        )
            .into_response()
    }
}

impl From<opgate_store::Error> for ApiError {
    fn from(e: opgate_store::Error) -> Self {
        match e {
            opgate_store::Error::NotFound(id) => Self::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("operation {id} not found"),
            ),
            opgate_store::Error::IllegalTransition { .. } => {
                Self::new(StatusCode::CONFLICT, "illegal_transition", e.to_string())
            }
            opgate_store::Error::Conflict(message) => {
                Self::new(StatusCode::CONFLICT, "conflict", message)
            }
            other if other.is_deterministic() => {
                tracing::warn!(error = %other, "the ledger refused a value");
                Self::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "ledger_refused",
                    "the ledger refused a value of this request (see the opgate log for the database's reason)",
                )
            }
            other => {
                tracing::error!(error = %other, "ledger error in the API");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ledger_unavailable",
                    "the ledger is not available",
                )
            }
        }
    }
}

/// The caller, once authenticated.
#[derive(Debug, Clone)]
struct Caller {
    name: String,
    role: Role,
}

async fn authenticate(State(state): State<ApiState>, mut request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(digest);
    let Some(presented) = presented else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "an `Authorization: Bearer <token>` header is required",
        )
        .into_response();
    };
    // Compare against every token so the time does not tell which one matched.
    let mut found = None;
    for (secret, name, role) in state.tokens.iter() {
        if constant_time_eq(secret, &presented) {
            found = Some(Caller {
                name: name.clone(),
                role: *role,
            });
        }
    }
    let Some(caller) = found else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "unknown token")
            .into_response();
    };
    let needs_operator = request.method() != axum::http::Method::GET;
    if needs_operator && caller.role < Role::Operator {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "token `{}` is a viewer; this route needs an operator",
                caller.name
            ),
        )
        .into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The router.
pub fn router(state: ApiState) -> Router {
    let v1 = Router::new()
        .route("/v1/operations", get(list_operations))
        .route("/v1/operations/{id}", get(get_operation))
        .route("/v1/operations/{id}/events", get(get_events))
        .route("/v1/operations/{id}/{action}", post(act))
        .route("/v1/proposals", post(propose))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .merge(v1)
        .with_state(state)
}

/// Serves the API on `addr` (port 0 picks one).
pub async fn serve(
    addr: SocketAddr,
    state: ApiState,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(state)).await {
            tracing::error!(error = %e, "admin API stopped");
        }
    });
    Ok((bound, handle))
}

/// Serves only `GET /metrics` (and `/healthz`), without tokens, on `addr`: for processes
/// that do not run the admin API (`[metrics] listen`). Bind it to an internal interface.
pub async fn serve_metrics(
    addr: SocketAddr,
    ledger: SharedLedger,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    #[derive(Clone)]
    struct Scrape {
        ledger: SharedLedger,
    }
    let router = Router::new()
        .route(
            "/metrics",
            get(|State(s): State<Scrape>| async move { render_metrics(&s.ledger).await }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Scrape { ledger });
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "metrics listener stopped");
        }
    });
    Ok((bound, handle))
}

/// An operation as the API shows it.
pub fn operation_json(op: &Operation) -> Value {
    json!({
        "operation_id": op.operation_id, "namespace": op.namespace, "idempotency_key": op.idempotency_key,
        "key_components": op.key_components, "args_fingerprint": op.args_fingerprint, "event_id": op.event_id,
        "agent_id": op.agent_id, "workflow_id": op.workflow_id, "run_id": op.run_id, "step": op.step,
        "tool": op.tool, "intent": op.intent, "entity": op.entity, "canonical_args": op.canonical_args,
        "side_effect_class": op.side_effect_class.as_str(), "status": op.status.as_str(),
        "attempt_count": op.attempt_count, "next_attempt_at": op.next_attempt_at.map(opgate_core::canonical::format_utc),
        "lease_owner": op.lease_owner, "lease_epoch": op.lease_epoch,
        "external_request_id": op.external_request_id, "external_id": op.external_object_id,
        "result": op.result, "error": op.error, "compensates": op.compensates, "traceparent": op.traceparent,
        "created_at": opgate_core::canonical::format_utc(op.created_at),
        "updated_at": opgate_core::canonical::format_utc(op.updated_at),
    })
}

fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_id",
            format!("`{id}` is not an operation id"),
        )
    })
}

async fn ready(State(state): State<ApiState>) -> Response {
    let mut body = serde_json::Map::new();
    let mut failure = None;
    match state.ledger.schema_status().await {
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
    for (name, check) in &state.checks {
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

/// `GET /metrics` (viewer): this process's counters and the ledger's gauges, in the
/// Prometheus text format.
async fn metrics(State(state): State<ApiState>) -> Response {
    render_metrics(&state.ledger).await
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
    }
}

#[derive(Debug, Deserialize)]
struct WaitQuery {
    wait: Option<String>,
}

async fn get_operation(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let wait = match q.wait.as_deref() {
        None => Duration::ZERO,
        Some(w) => opgate_core::registry::parse_duration(w)
            .map_err(|m| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_wait",
                    format!("wait: {m}"),
                )
            })?
            .min(Duration::from_secs(60)),
    };
    let started = Instant::now();
    loop {
        let op = state
            .ledger
            .operation(id)
            .await?
            .ok_or(opgate_store::Error::NotFound(id))?;
        let settled = op.status.is_terminal() || op.status == Status::NeedsAttention;
        if settled || started.elapsed() >= wait {
            return Ok(Json(operation_json(&op)));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    status: Option<String>,
    tool: Option<String>,
    entity: Option<String>,
    namespace: Option<String>,
    idempotency_key: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

async fn list_operations(
    State(state): State<ApiState>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let status = q
        .status
        .as_deref()
        .map(|s| {
            Status::parse(s).ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_status",
                    format!("status `{s}` is not an operation state"),
                )
            })
        })
        .transpose()?;
    if let Some(c) = &q.cursor {
        parse_id(c).map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_cursor",
                "cursor is not one this API returned",
            )
        })?;
    }
    let page = state
        .ledger
        .list(&ListFilter {
            status,
            tool: q.tool,
            entity: q.entity,
            namespace: q.namespace,
            idempotency_key: q.idempotency_key,
            limit: q.limit,
            cursor: q.cursor,
        })
        .await?;
    Ok(Json(json!({
        "operations": page.operations.iter().map(operation_json).collect::<Vec<_>>(),
        "next_cursor": page.next_cursor,
    })))
}

async fn get_events(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    state
        .ledger
        .operation(id)
        .await?
        .ok_or(opgate_store::Error::NotFound(id))?;
    let events = state.ledger.events(id).await?;
    Ok(Json(json!({"events": events.iter().map(|e| json!({
        "seq": e.event_seq, "from": e.from.map(Status::as_str), "to": e.to.as_str(), "reason": e.reason,
        "attempt_id": e.attempt_id, "epoch": e.epoch, "actor": e.actor,
        "at": opgate_core::canonical::format_utc(e.at), "detail": e.detail,
    })).collect::<Vec<_>>()})))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionBody {
    #[serde(default)]
    reason: Option<String>,
    /// For `resolve`: succeeded | noop | failed | redispatch.
    #[serde(default)]
    resolution: Option<String>,
    /// For `resolve` as succeeded: the result to record.
    #[serde(default)]
    result: Option<Value>,
}

async fn act(
    State(state): State<ApiState>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((id, action)): Path<(String, String)>,
    body: Option<Json<Value>>,
) -> Result<Json<Value>, ApiError> {
    let id = parse_id(&id)?;
    let body: ActionBody = match body {
        None => ActionBody::default(),
        Some(Json(v)) => serde_json::from_value(v)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", e.to_string()))?,
    };
    if action == "compensate" {
        return compensate(&state, caller, id, body).await;
    }
    let event = match action.as_str() {
        "approve" => Event::Approve,
        "reject" => Event::Reject,
        "cancel" => Event::Cancel,
        "resolve" => Event::Resolve(match body.resolution.as_deref() {
            Some("succeeded") => Resolution::Succeeded,
            Some("noop") => Resolution::Noop,
            Some("failed") => Resolution::Failed,
            Some("redispatch") => Resolution::Redispatch,
            other => {
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_body",
                    format!(
                        "field `resolution` must be succeeded, noop, failed or redispatch (got {other:?})"
                    ),
                ));
            }
        }),
        other => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_action",
                format!("unknown action `{other}` (approve, reject, cancel, resolve, compensate)"),
            ));
        }
    };
    let op = state
        .ledger
        .apply(&Command {
            operation_id: id,
            event,
            actor: caller.name,
            reason: body.reason.unwrap_or_else(|| action.clone()),
            result: body.result,
        })
        .await?;
    Ok(Json(operation_json(&op)))
}

/// `POST /v1/operations/{id}/compensate`: records the compensating operation the tool's
/// `[tools.compensation]` describes and moves the original to `compensating`; it settles
/// to `compensated` when the compensation completes. Asked again while it runs, the same
/// compensation; after a failed one, a new attempt.
async fn compensate(
    state: &ApiState,
    caller: Caller,
    id: Uuid,
    body: ActionBody,
) -> Result<Json<Value>, ApiError> {
    let original = state
        .ledger
        .operation(id)
        .await?
        .ok_or(opgate_store::Error::NotFound(id))?;
    if !matches!(
        original.status,
        Status::CompletedSuccess | Status::Compensating | Status::Compensated
    ) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "illegal_transition",
            format!(
                "operation {id} is {}; only a completed_success operation can be compensated",
                original.status
            ),
        ));
    }
    let unprocessable = |r: opgate_core::Rejection| {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, r.reason, r.message)
    };
    let proposal = opgate_core::compensation::proposal(&state.registry, &original, &caller.name)
        .map_err(unprocessable)?;
    let delivery = Delivery {
        source: Source::Http,
        traceparent: original.traceparent.clone(),
    };
    let envelope =
        opgate_core::envelope::prepare_for_operator(&state.registry, &proposal, delivery)
            .map_err(unprocessable)?;
    let first_request = original.status == Status::CompletedSuccess;
    let (original, compensation) = state
        .ledger
        .compensate(&opgate_store::CompensationRequest {
            operation_id: id,
            envelope,
            actor: caller.name,
            reason: body.reason.unwrap_or_else(|| "compensate".into()),
        })
        .await?;
    if first_request {
        opgate_metrics::metrics()
            .compensations
            .with_label_values(&[original.tool.as_str()])
            .inc();
    }
    Ok(Json(json!({
        "operation": operation_json(&original),
        "compensation": operation_json(&compensation),
    })))
}

async fn propose(
    State(state): State<ApiState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let proposal = Proposal::decode(&body, &state.limits).map_err(|e| {
        let status = if e.reason() == "oversize" {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.reason(), e.to_string())
    })?;
    let item = IngestItem::from_proposal(
        &state.registry,
        &proposal,
        Delivery {
            source: Source::Http,
            // W3C trace context, carried into the operation and its results as on Kafka.
            traceparent: headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .and_then(opgate_core::input::traceparent),
        },
    );
    let message = match &item {
        IngestItem::Rejected(r) => Some(r.rejection.message.clone()),
        IngestItem::Accepted(_) => None,
    };
    let outcome = state.ledger.ingest(&[item]).await?.pop().ok_or_else(|| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "no ingest outcome",
        )
    })?;
    opgate_metrics::metrics().ingested(
        outcome.decision.as_str(),
        outcome.decision.reason(),
        outcome.inbox_hit,
    );
    let status = match &outcome.decision {
        // The ledger's contents contradict the proposal (DESIGN.md sections 4 and 9).
        IngestDecision::Rejected { reason }
            if reason == "event_id_conflict" || reason == "key_conflict" =>
        {
            StatusCode::CONFLICT
        }
        IngestDecision::Rejected { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        IngestDecision::Accepted if !outcome.inbox_hit => StatusCode::CREATED,
        _ => StatusCode::OK,
    };
    Ok((
        status,
        Json(json!({
            "event_id": outcome.event_id,
            "decision": outcome.decision.as_str(),
            "reason": outcome.decision.reason(),
            "message": message,
            "inbox_hit": outcome.inbox_hit,
            "operation": outcome.operation.as_ref().map(operation_json),
        })),
    )
        .into_response())
}
