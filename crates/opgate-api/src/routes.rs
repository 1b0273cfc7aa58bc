//! The `/v1` routes: read operations, act on them, and propose (HTTP ingress for agents
//! without a Kafka client: the same JSON as the topic, the same ledger path, so a
//! proposal sent both ways is one operation). Each handler checks what its caller's role
//! allows ([`Principal`]).

use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use opgate_core::{Delivery, Event, IngestItem, Operation, Proposal, Resolution, Source, Status};
use opgate_store::{Command, IngestDecision, ListFilter};
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use crate::ApiState;
use crate::auth::{Principal, Role};
use crate::error::ApiError;
use crate::views::{
    AttemptView, AttemptsView, CompensationAnswer, EventView, EventsView, OperationView,
    OverviewView, PageView, PrincipalView, ProposalAnswer, ResultRecordsView, ToolView, ToolsView,
};

fn parse_id(id: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(id)
        .map_err(|_| ApiError::bad_request("invalid_id", format!("`{id}` is not an operation id")))
}

/// The operation an id names in a read route: a whole id, or for a viewer or operator the
/// start of one (at least 4 hex digits) that exactly one operation's id begins with.
async fn resolve_id(state: &ApiState, caller: &Principal, text: &str) -> Result<Uuid, ApiError> {
    if let Ok(id) = Uuid::parse_str(text) {
        return Ok(id);
    }
    if caller.role == Role::Agent {
        return parse_id(text);
    }
    let (low, high) = opgate_core::operation::id_prefix_range(text)
        .map_err(|m| ApiError::bad_request("invalid_id", m))?;
    if text.chars().filter(char::is_ascii_hexdigit).count() < 4 {
        return Err(ApiError::bad_request(
            "invalid_id",
            format!("`{text}` is too short: give at least 4 hex digits of the operation id"),
        ));
    }
    match state.ledger.ids_between(low, high, 2).await?.as_slice() {
        [id] => Ok(*id),
        [] => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "operation_not_found",
            format!("no operation id starts with `{text}`"),
        )),
        _ => Err(ApiError::bad_request(
            "ambiguous_id",
            format!("several operation ids start with `{text}`: give more of it"),
        )),
    }
}

/// `GET /v1/me` (any token): who the token is.
pub(crate) async fn me(Extension(caller): Extension<Principal>) -> Json<PrincipalView> {
    Json(PrincipalView {
        name: caller.name.clone(),
        role: caller.role.as_str().to_owned(),
        agent_id: caller.agent.as_ref().map(|a| a.agent_id.clone()),
        namespaces: caller
            .agent
            .as_ref()
            .map(|a| a.namespaces.clone())
            .unwrap_or_default(),
    })
}

/// `GET /v1/operations/{id}/attempts`: the dispatch tries, oldest first.
pub(crate) async fn get_attempts(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<AttemptsView>, ApiError> {
    let id = resolve_id(&state, &caller, &id).await?;
    visible(&state, &caller, id).await?;
    let attempts = state.ledger.attempts(id).await?;
    Ok(Json(AttemptsView {
        attempts: attempts.iter().map(AttemptView::from).collect(),
    }))
}

/// `GET /v1/operations/{id}/results`: the result messages written, and when the relay
/// published each.
pub(crate) async fn get_results(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<ResultRecordsView>, ApiError> {
    let id = resolve_id(&state, &caller, &id).await?;
    visible(&state, &caller, id).await?;
    let rows = state.ledger.results(id).await?;
    Ok(Json(ResultRecordsView::from(rows.as_slice())))
}

#[derive(Debug, Deserialize)]
pub(crate) struct OverviewQuery {
    window: Option<String>,
}

/// `GET /v1/overview?window=1h` (viewer or operator; the window is 1 minute to 24 hours,
/// 1 hour when not given). The answer for a window is computed at most once per
/// [`crate::OVERVIEW_TTL`] and shared: consoles left open poll it, and it groups the
/// window's inbox rows.
pub(crate) async fn overview(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Query(q): Query<OverviewQuery>,
) -> Result<Json<OverviewView>, ApiError> {
    caller.require_reader("the overview")?;
    let window = match q.window.as_deref() {
        None => Duration::from_secs(3600),
        Some(w) => opgate_core::registry::parse_duration(w)
            .map_err(|m| ApiError::bad_request("invalid_window", format!("window: {m}")))?,
    };
    if !(Duration::from_secs(60)..=Duration::from_secs(86_400)).contains(&window) {
        return Err(ApiError::bad_request(
            "invalid_window",
            "window must be from 1m to 24h",
        ));
    }
    // One computation per window at a time: concurrent callers wait for it and share it.
    let mut cache = state.overviews.lock().await;
    if let Some((at, view)) = cache.get(&window)
        && at.elapsed() < crate::OVERVIEW_TTL
    {
        return Ok(Json(view.clone()));
    }
    let stats = state.ledger.stats().await?;
    let since = stats.now - window;
    let activity = state.ledger.activity(since).await?;
    let view = OverviewView::new(&stats, &activity, window);
    cache.insert(window, (Instant::now(), view.clone()));
    Ok(Json(view))
}

/// An operation this caller may see (404 otherwise, as for an unknown id).
async fn visible(state: &ApiState, caller: &Principal, id: Uuid) -> Result<Operation, ApiError> {
    match state.ledger.operation(id).await? {
        Some(op) if caller.may_read(&op) => Ok(op),
        _ => Err(ApiError::operation_not_found(id)),
    }
}

/// `GET /v1/tools` (any token): the registry as agents see it. An agent token sees the
/// tools its `[[agents]]` allowlist lets it propose.
pub(crate) async fn list_tools(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
) -> Json<ToolsView> {
    let agent = caller.agent.as_ref().map(|a| a.agent_id.as_str());
    let tools = state
        .registry
        .tools()
        .filter(|t| caller.role != Role::Agent || state.registry.allows(agent, &t.name).is_ok())
        .map(ToolView::from)
        .collect();
    Json(ToolsView { tools })
}

#[derive(Debug, Deserialize)]
pub(crate) struct WaitQuery {
    wait: Option<String>,
}

/// `GET /v1/operations/{id}` (`?wait=10s` long-polls until settled, at most 60 s).
pub(crate) async fn get_operation(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Result<Json<OperationView>, ApiError> {
    let id = resolve_id(&state, &caller, &id).await?;
    let wait = match q.wait.as_deref() {
        None => Duration::ZERO,
        Some(w) => opgate_core::registry::parse_duration(w)
            .map_err(|m| ApiError::bad_request("invalid_wait", format!("wait: {m}")))?
            .min(Duration::from_secs(60)),
    };
    let started = Instant::now();
    loop {
        let view = OperationView::from(&visible(&state, &caller, id).await?);
        if view.is_settled() || started.elapsed() >= wait {
            return Ok(Json(view));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    status: Option<String>,
    tool: Option<String>,
    entity: Option<String>,
    namespace: Option<String>,
    idempotency_key: Option<String>,
    agent_id: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

/// `GET /v1/operations`: newest first, filtered, paginated. An agent token lists its own
/// operations in its namespaces only.
pub(crate) async fn list_operations(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Query(q): Query<ListQuery>,
) -> Result<Json<PageView>, ApiError> {
    let status = q
        .status
        .as_deref()
        .map(|s| {
            Status::parse(s).ok_or_else(|| {
                ApiError::bad_request(
                    "invalid_status",
                    format!(
                        "status `{s}` is not an operation state (one of: {})",
                        Status::ALL
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })
        })
        .transpose()?;
    if let Some(c) = &q.cursor {
        parse_id(c).map_err(|_| {
            ApiError::bad_request("invalid_cursor", "cursor is not one this API returned")
        })?;
    }
    let mut filter = ListFilter {
        status,
        tool: q.tool,
        entity: q.entity,
        namespace: q.namespace,
        idempotency_key: q.idempotency_key,
        agent_id: q.agent_id,
        limit: q.limit,
        cursor: q.cursor,
    };
    if let Some(scope) = &caller.agent {
        if filter
            .agent_id
            .as_ref()
            .is_some_and(|a| *a != scope.agent_id)
        {
            return Err(ApiError::forbidden(format!(
                "token `{}` lists its own agent's operations only: leave out field `agent_id`",
                caller.name
            )));
        }
        filter.agent_id = Some(scope.agent_id.clone());
        match (&filter.namespace, scope.namespaces.as_slice()) {
            (Some(ns), allowed) if !allowed.contains(ns) => {
                return Err(ApiError::forbidden(format!(
                    "token `{}` may not read namespace `{ns}` (field `namespace`)",
                    caller.name
                )));
            }
            (Some(_), _) => {}
            (None, [only]) => filter.namespace = Some(only.clone()),
            (None, _) => {
                return Err(ApiError::bad_request(
                    "namespace_required",
                    format!(
                        "token `{}` works in several namespaces: give field `namespace`",
                        caller.name
                    ),
                ));
            }
        }
    }
    let page = state.ledger.list(&filter).await?;
    Ok(Json(PageView {
        operations: page.operations.iter().map(OperationView::from).collect(),
        next_cursor: page.next_cursor,
    }))
}

/// `GET /v1/operations/{id}/events`: the history, oldest first.
pub(crate) async fn get_events(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<EventsView>, ApiError> {
    let id = resolve_id(&state, &caller, &id).await?;
    visible(&state, &caller, id).await?;
    let events = state.ledger.events(id).await?;
    Ok(Json(EventsView {
        events: events.iter().map(EventView::from).collect(),
    }))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ActionBody {
    #[serde(default)]
    reason: Option<String>,
    /// For `resolve`: succeeded | noop | failed | redispatch.
    #[serde(default)]
    resolution: Option<String>,
    /// For `resolve` as succeeded: the result to record.
    #[serde(default)]
    result: Option<Value>,
}

/// `POST /v1/operations/{id}/{approve|reject|cancel|resolve|compensate}` (operator).
pub(crate) async fn act(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    Path((id, action)): Path<(String, String)>,
    body: Option<Json<Value>>,
) -> Result<Response, ApiError> {
    caller.require_operator(&format!("`{action}`"))?;
    // A command names its operation in full: a short prefix pasted into the wrong
    // environment could match an unrelated operation there and act on it.
    let id = parse_id(&id)?;
    let body: ActionBody = match body {
        None => ActionBody::default(),
        Some(Json(v)) => serde_json::from_value(v)
            .map_err(|e| ApiError::bad_request("invalid_body", e.to_string()))?,
    };
    if action == "compensate" {
        return Ok(compensate(&state, caller, id, body).await?.into_response());
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
                return Err(ApiError::bad_request(
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
    if event == Event::Approve && proposed_by(&state, id, &caller.name).await? {
        return Err(ApiError::forbidden(format!(
            "token `{}` proposed operation {id}: another operator must approve it",
            caller.name
        )));
    }
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
    Ok(Json(OperationView::from(&op)).into_response())
}

/// Whether `principal` proposed the operation: its first event records who sent the
/// proposal over an authenticated interface.
async fn proposed_by(state: &ApiState, id: Uuid, principal: &str) -> Result<bool, ApiError> {
    let events = state.ledger.events(id).await?;
    Ok(events
        .iter()
        .find(|e| e.from.is_none())
        .and_then(|e| e.actor.as_deref())
        == Some(principal))
}

/// `POST /v1/operations/{id}/compensate`: records the compensating operation the tool's
/// `[tools.compensation]` describes and moves the original to `compensating`; it settles
/// to `compensated` when the compensation completes. Asked again while it runs, the same
/// compensation; after a failed one, a new attempt.
async fn compensate(
    state: &ApiState,
    caller: Principal,
    id: Uuid,
    body: ActionBody,
) -> Result<Json<CompensationAnswer>, ApiError> {
    let original = state
        .ledger
        .operation(id)
        .await?
        .ok_or(ApiError::operation_not_found(id))?;
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
        principal: Some(caller.name.clone()),
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
    Ok(Json(CompensationAnswer {
        operation: OperationView::from(&original),
        compensation: OperationView::from(&compensation),
    }))
}

/// `POST /v1/proposals` (agent or operator). An agent token's proposals carry its
/// `agent_id` (another one in the body is refused) and stay in its namespaces.
pub(crate) async fn propose(
    State(state): State<ApiState>,
    Extension(caller): Extension<Principal>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    caller.require_proposer()?;
    let mut proposal = Proposal::decode(&body, &state.limits).map_err(|e| {
        let status = if e.reason() == "oversize" {
            StatusCode::PAYLOAD_TOO_LARGE
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.reason(), e.to_string())
    })?;
    if caller.role == Role::Agent {
        bind_to_agent(&caller, &mut proposal)?;
    }
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
            principal: Some(caller.name.clone()),
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
    let answer = ProposalAnswer {
        event_id: outcome.event_id,
        decision: outcome.decision.as_str().to_owned(),
        reason: outcome.decision.reason().map(str::to_owned),
        message,
        inbox_hit: outcome.inbox_hit,
        operation: outcome.operation.as_ref().map(OperationView::from),
    };
    Ok((status, Json(answer)).into_response())
}

/// Gives an agent token's proposal the token's `agent_id`, and keeps it to the token's
/// namespaces; each refusal names the field.
fn bind_to_agent(caller: &Principal, proposal: &mut Proposal) -> Result<(), ApiError> {
    let Some(scope) = &caller.agent else {
        return Err(ApiError::forbidden(format!(
            "token `{}` is an agent token without an agent",
            caller.name
        )));
    };
    match &proposal.agent_id {
        Some(given) if *given != scope.agent_id => {
            return Err(ApiError::forbidden(format!(
                "field `agent_id` does not match the agent token `{}` is bound to: leave it out (it is taken from the token)",
                caller.name
            )));
        }
        _ => proposal.agent_id = Some(scope.agent_id.clone()),
    }
    if !scope.namespaces.contains(&proposal.namespace) {
        return Err(ApiError::forbidden(format!(
            "token `{}` may not propose in namespace `{}` (field `namespace`)",
            caller.name, proposal.namespace
        )));
    }
    Ok(())
}
