//! The admin HTTP API (DESIGN.md sections 6 and 9): bearer tokens with three roles.
//!
//! - any token: `GET /v1/me` (who it is);
//! - agent (bound to an `agent_id` and namespaces): `POST /v1/proposals`, its own
//!   operations through the read routes, and `GET /v1/tools` (the tools it may propose);
//! - viewer: `GET /v1/operations` (filters, cursor), `GET /v1/operations/{id}` (`?wait=10s`
//!   long-polls until settled; an id may be shortened to a unique prefix),
//!   `GET /v1/operations/{id}/{events|attempts|results}`, `GET /v1/overview?window=1h`
//!   (computed at most once per [`OVERVIEW_TTL`] per window),
//!   `GET /metrics`;
//! - operator: everything a viewer may, plus `POST /v1/proposals` and `POST
//!   /v1/operations/{id}/{approve|reject|cancel|resolve|compensate}` — never approving
//!   what it proposed itself;
//! - no token: `/healthz` (alive) and `/readyz` (ledger reachable, schema current, and
//!   every added check — the broker in `opgate run` and `opgate dev` — answering), and the
//!   operator console's page and assets at `/ui/` (it signs in with a token).
//!
//! Modules: [`auth`] (tokens, principals, what each role may do), [`error`] (the error
//! body), [`views`] (the answers as types, shared with the CLI), `routes` (the handlers)
//! and `health`.
#![forbid(unsafe_code)]

pub mod auth;
pub mod error;
mod health;
mod routes;
mod ui;
pub mod views;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::middleware;
use axum::routing::{get, post};
use opgate_core::{Limits, Registry};
use opgate_store::SharedLedger;

pub use auth::{AgentScope, Principal, Role, Token, TokenError};
pub use error::ApiError;
pub use health::{ledger_gauges, serve_metrics};

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
    tokens: Arc<Vec<Token>>,
    checks: Vec<(&'static str, ReadinessCheck)>,
    overviews: Arc<tokio::sync::Mutex<OverviewCache>>,
}

/// Overviews by window, with when each was computed.
type OverviewCache =
    std::collections::HashMap<std::time::Duration, (std::time::Instant, views::OverviewView)>;

/// How long a computed `GET /v1/overview` answer is served before it is read again.
pub const OVERVIEW_TTL: std::time::Duration = std::time::Duration::from_secs(5);

impl ApiState {
    /// State over a ledger and registry with these tokens (names and secrets unique).
    pub fn new(
        ledger: SharedLedger,
        registry: Arc<Registry>,
        limits: Limits,
        tokens: Vec<Token>,
    ) -> Result<Self, TokenError> {
        auth::check_tokens(&tokens)?;
        Ok(Self {
            ledger,
            registry,
            limits,
            tokens: Arc::new(tokens),
            checks: Vec::new(),
            overviews: Arc::default(),
        })
    }

    /// Adds a dependency `/readyz` checks, reported under `name` (e.g. `broker`).
    pub fn with_check(mut self, name: &'static str, check: ReadinessCheck) -> Self {
        self.checks.push((name, check));
        self
    }
}

/// The router.
pub fn router(state: ApiState) -> Router {
    let v1 = Router::new()
        .route("/v1/operations", get(routes::list_operations))
        .route("/v1/operations/{id}", get(routes::get_operation))
        .route("/v1/operations/{id}/events", get(routes::get_events))
        .route("/v1/operations/{id}/attempts", get(routes::get_attempts))
        .route("/v1/operations/{id}/results", get(routes::get_results))
        .route("/v1/overview", get(routes::overview))
        .route("/v1/me", get(routes::me))
        .route("/v1/operations/{id}/{action}", post(routes::act))
        .route("/v1/proposals", post(routes::propose))
        .route("/v1/tools", get(routes::list_tools))
        .route("/metrics", get(health::metrics))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(health::ready))
        .merge(ui::routes())
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
