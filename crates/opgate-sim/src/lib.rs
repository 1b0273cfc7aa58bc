//! Simulated providers for tests, the demo and `opgate sim` (DESIGN.md section 6).
//!
//! Providers with the idempotency behaviour real ones have:
//! - `POST /payments` honours the `Idempotency-Key` header (a repeat returns the stored
//!   charge, no new effect); `GET /payments?idempotency_key=K` looks a charge up;
//! - `POST /emails` has no idempotency: every accepted send is an effect;
//!   `GET /emails?client_reference=R` finds a sent email by the body's `client_reference`;
//! - `POST /tickets` dedupes on the body's `client_token`; `GET /tickets?client_token=T`;
//! - `POST /orders` and `POST /credits` dedupe on `client_token` like tickets, and
//!   `POST /refunds` on `Idempotency-Key` like payments (the demo's extra providers).
//!
//! Faults are injected per provider, per key prefix, a number of times or with a
//! probability (seeded): `timeout_before_commit`, `timeout_after_commit`, `throttle`
//! (429 + Retry-After), `error_committed` (500 after commit), `error_not_committed`,
//! `malformed` (200 with a body that is not JSON, after commit) and `slow_propagation`
//! (lookups miss for a while after commit).
//!
//! Every real effect is counted per key, and concurrent requests on one entity (the
//! `x-opgate-entity` header) are counted as overlaps, so a test can assert "each intended
//! effect happened at most once" and "one entity's writes never overlapped" with
//! `GET /effects`.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The three providers.
pub const PROVIDERS: [&str; 6] = [
    "payments", "emails", "tickets", "orders", "refunds", "credits",
];

/// A fault kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Hang (longer than any sane client timeout), then fail; nothing committed.
    TimeoutBeforeCommit,
    /// Commit, then hang: the client times out although the effect happened.
    TimeoutAfterCommit,
    /// 429 with `Retry-After`; nothing committed.
    Throttle,
    /// Commit, then answer 500.
    ErrorCommitted,
    /// Answer 500 without committing.
    ErrorNotCommitted,
    /// Commit, then answer 200 with a body that is not JSON.
    Malformed,
    /// Commit and answer normally, but lookups miss for a while.
    SlowPropagation,
}

impl FaultKind {
    /// Every kind, for fault matrices.
    pub const ALL: [Self; 7] = [
        Self::TimeoutBeforeCommit,
        Self::TimeoutAfterCommit,
        Self::Throttle,
        Self::ErrorCommitted,
        Self::ErrorNotCommitted,
        Self::Malformed,
        Self::SlowPropagation,
    ];
}

/// `POST /faults` body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FaultSpec {
    /// `payments`, `emails` or `tickets`.
    pub provider: String,
    /// Only keys starting with this prefix (all keys when absent).
    #[serde(default, rename = "match")]
    pub match_prefix: Option<String>,
    /// The fault.
    pub fault: FaultKind,
    /// Apply to this many requests, then stop.
    #[serde(default)]
    pub times: Option<u32>,
    /// Apply to each request with this probability (seeded).
    #[serde(default)]
    pub probability: Option<f64>,
}

/// Timing of the simulated misbehaviour.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    /// Seed of the fault dice.
    pub seed: u64,
    /// How long a "timeout" hangs.
    pub hang: Duration,
    /// How long lookups miss under `slow_propagation`.
    pub propagation: Duration,
    /// `Retry-After` seconds sent with `throttle`.
    pub retry_after_secs: u64,
    /// Simulated work per request (makes overlaps observable).
    pub work: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            hang: Duration::from_secs(10),
            propagation: Duration::from_secs(3),
            retry_after_secs: 1,
            work: Duration::from_millis(2),
        }
    }
}

#[derive(Debug, Clone)]
struct Stored {
    body: Value,
    visible_at: Instant,
}

#[derive(Debug)]
struct Effect {
    provider: &'static str,
    key: String,
    entity: Option<String>,
    /// When the request that made it arrived.
    received_ms: u64,
    at_ms: u128,
}

#[derive(Debug)]
struct Inner {
    rng: StdRng,
    started: Instant,
    /// The wall clock when `started` was read.
    started_wall: SystemTime,
    records: HashMap<(&'static str, String), Stored>,
    effects: Vec<Effect>,
    faults: Vec<FaultSpec>,
    in_flight: HashMap<String, u32>,
    overlaps: u64,
    next_id: u64,
}

/// The simulated providers' shared state.
#[derive(Debug, Clone)]
pub struct Sim {
    config: SimConfig,
    inner: Arc<Mutex<Inner>>,
}

/// `GET /effects` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectsReport {
    /// Effects per (provider, key).
    pub effects: Vec<EffectCount>,
    /// All effects.
    pub total: u64,
    /// Effects beyond the first per key.
    pub duplicates: u64,
    /// Requests that arrived while another request on the same entity was in flight.
    pub overlaps: u64,
    /// Effects in the order they happened.
    pub log: Vec<EffectEntry>,
}

/// One (provider, key) count.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectCount {
    /// Provider.
    pub provider: String,
    /// Key.
    pub key: String,
    /// Effects.
    pub count: u64,
}

/// One effect, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EffectEntry {
    /// Provider.
    pub provider: String,
    /// Key.
    pub key: String,
    /// Entity header, when sent.
    pub entity: Option<String>,
    /// When the request that made it arrived, in milliseconds since the sim started
    /// (before the provider's `work`).
    pub received_ms: u64,
    /// When it happened, in milliseconds since the sim started.
    pub at_ms: u64,
}

impl Sim {
    /// New providers with no records and no faults.
    pub fn new(config: SimConfig) -> Self {
        Self {
            config,
            inner: Arc::new(Mutex::new(Inner {
                rng: StdRng::seed_from_u64(config.seed),
                started: Instant::now(),
                started_wall: SystemTime::now(),
                records: HashMap::new(),
                effects: Vec::new(),
                faults: Vec::new(),
                in_flight: HashMap::new(),
                overlaps: 0,
                next_id: 1,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the counters half-written in a way
        // that matters more than losing them; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a fault.
    pub fn add_fault(&self, fault: FaultSpec) {
        self.lock().faults.push(fault);
    }

    /// Clears every fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Milliseconds since these providers started: the clock of [`EffectEntry::at_ms`],
    /// so a client can stamp what it sends on the same clock.
    pub fn elapsed_ms(&self) -> u64 {
        self.lock().started.elapsed().as_millis() as u64
    }

    /// The wall-clock time at which [`EffectEntry::at_ms`] is 0: an effect happened at
    /// this plus its `at_ms` (to the millisecond, rounded down).
    pub fn started_at(&self) -> SystemTime {
        self.lock().started_wall
    }

    /// The effects so far.
    pub fn effects(&self) -> EffectsReport {
        let inner = self.lock();
        let mut counts: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for e in &inner.effects {
            *counts.entry((e.provider, e.key.as_str())).or_default() += 1;
        }
        EffectsReport {
            total: inner.effects.len() as u64,
            duplicates: counts.values().map(|c| c.saturating_sub(1)).sum(),
            overlaps: inner.overlaps,
            effects: counts
                .into_iter()
                .map(|((provider, key), count)| EffectCount {
                    provider: provider.to_owned(),
                    key: key.to_owned(),
                    count,
                })
                .collect(),
            log: inner
                .effects
                .iter()
                .map(|e| EffectEntry {
                    provider: e.provider.to_owned(),
                    key: e.key.clone(),
                    entity: e.entity.clone(),
                    received_ms: e.received_ms,
                    at_ms: e.at_ms as u64,
                })
                .collect(),
        }
    }

    /// The faults that fire for a request, each consuming one use: at most one
    /// misbehaviour of the answer, plus `slow_propagation`, which combines with any.
    fn faults_for(&self, provider: &str, key: &str) -> (Option<FaultKind>, bool) {
        let mut inner = self.lock();
        let Inner { faults, rng, .. } = &mut *inner;
        let (mut answer, mut slow) = (None, false);
        for fault in faults.iter_mut() {
            let wanted = if fault.fault == FaultKind::SlowPropagation {
                !slow
            } else {
                answer.is_none()
            };
            if !wanted
                || fault.provider != provider
                || fault
                    .match_prefix
                    .as_deref()
                    .is_some_and(|p| !key.starts_with(p))
            {
                continue;
            }
            let fires = match (&mut fault.times, fault.probability) {
                (Some(0), _) => false,
                (Some(times), _) => {
                    *times -= 1;
                    true
                }
                (None, Some(p)) => rng.random_bool(p.clamp(0.0, 1.0)),
                (None, None) => true,
            };
            if fires {
                if fault.fault == FaultKind::SlowPropagation {
                    slow = true;
                } else {
                    answer = Some(fault.fault);
                }
            }
        }
        (answer, slow)
    }

    /// Commits the effect of a request (unless the provider dedupes it) and returns the
    /// stored body.
    fn commit(
        &self,
        provider: &'static str,
        key: &str,
        entity: Option<String>,
        body: &Value,
        slow: bool,
        received_ms: u64,
    ) -> Value {
        let mut inner = self.lock();
        let dedupes = provider != "emails";
        if dedupes && let Some(stored) = inner.records.get(&(provider, key.to_owned())) {
            return stored.body.clone();
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let stored = match provider {
            "payments" => {
                json!({"charge_id": format!("ch_{id}"), "amount": body.get("amount"), "currency": body.get("currency")})
            }
            "tickets" => json!({"ticket_id": format!("tk_{id}"), "client_token": key}),
            "orders" => json!({"order_id": format!("ord_{id}"), "client_token": key}),
            "refunds" => {
                json!({"refund_id": format!("re_{id}"), "charge_id": body.get("charge_id")})
            }
            "credits" => json!({"credit_id": format!("cr_{id}"), "client_token": key}),
            _ => json!({"message_id": format!("msg_{id}"), "client_reference": key}),
        };
        let visible_at = Instant::now()
            + if slow {
                self.config.propagation
            } else {
                Duration::ZERO
            };
        inner.records.insert(
            (provider, key.to_owned()),
            Stored {
                body: stored.clone(),
                visible_at,
            },
        );
        let at_ms = inner.started.elapsed().as_millis();
        inner.effects.push(Effect {
            provider,
            key: key.to_owned(),
            entity,
            received_ms,
            at_ms,
        });
        stored
    }

    fn lookup(&self, provider: &'static str, key: &str) -> Option<Value> {
        let inner = self.lock();
        inner
            .records
            .get(&(provider, key.to_owned()))
            .filter(|s| s.visible_at <= Instant::now())
            .map(|s| s.body.clone())
    }
}

/// Counts concurrent requests per entity for as long as it lives.
struct InFlight {
    sim: Sim,
    entity: Option<String>,
}

impl InFlight {
    fn enter(sim: &Sim, entity: Option<String>) -> Self {
        if let Some(e) = &entity {
            let mut inner = sim.lock();
            let n = inner.in_flight.entry(e.clone()).or_default();
            *n += 1;
            if *n > 1 {
                inner.overlaps += 1;
            }
        }
        Self {
            sim: sim.clone(),
            entity,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(e) = &self.entity {
            let mut inner = self.sim.lock();
            if let Some(n) = inner.in_flight.get_mut(e) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

/// How a provider recognises a repeated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedBy {
    /// The `Idempotency-Key` header (payments, refunds); looked up by `idempotency_key`.
    Header,
    /// A body field, looked up by a query parameter of the same name.
    Body(&'static str),
}

/// Each provider and how it keys requests (every provider but `emails` deduplicates).
pub const ROUTES: [(&str, KeyedBy); 6] = [
    ("payments", KeyedBy::Header),
    ("emails", KeyedBy::Body("client_reference")),
    ("tickets", KeyedBy::Body("client_token")),
    ("orders", KeyedBy::Body("client_token")),
    ("refunds", KeyedBy::Header),
    ("credits", KeyedBy::Body("client_token")),
];

/// The HTTP router.
pub fn router(sim: Sim) -> Router {
    let mut router = Router::new();
    for (provider, keyed_by) in ROUTES {
        let path = format!("/{provider}");
        router = router.route(
            &path,
            post(
                move |State(sim): State<Sim>, headers: HeaderMap, Json(body): Json<Value>| {
                    create(sim, provider, keyed_by, headers, body)
                },
            )
            .get(
                move |State(sim): State<Sim>, Query(q): Query<HashMap<String, String>>| async move {
                    let param = match keyed_by {
                        KeyedBy::Header => "idempotency_key",
                        KeyedBy::Body(field) => field,
                    };
                    match q.get(param) {
                        Some(k) => found(sim.lookup(provider, k)),
                        None => missing(param),
                    }
                },
            ),
        );
    }
    router
        .route("/effects", get(effects))
        .route("/faults", post(add_fault).delete(clear_faults))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(sim)
}

/// Serves the providers on `addr` (port 0 picks one); returns the bound address.
pub async fn start(
    addr: SocketAddr,
    sim: Sim,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(sim)).await {
            tracing::error!(error = %e, "simulated providers stopped");
        }
    });
    Ok((bound, handle))
}

async fn handle(
    sim: Sim,
    provider: &'static str,
    key: String,
    headers: HeaderMap,
    body: Value,
) -> Response {
    let entity = headers
        .get("x-opgate-entity")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let received_ms = sim.elapsed_ms();
    let _in_flight = InFlight::enter(&sim, entity.clone());
    tokio::time::sleep(sim.config.work).await;
    let (fault, slow) = sim.faults_for(provider, &key);
    match fault {
        Some(FaultKind::TimeoutBeforeCommit) => {
            tokio::time::sleep(sim.config.hang).await;
            return (StatusCode::GATEWAY_TIMEOUT, "timed out").into_response();
        }
        Some(FaultKind::ErrorNotCommitted) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": "internal"})),
            )
                .into_response();
        }
        Some(FaultKind::Throttle) => {
            let mut response = (
                StatusCode::TOO_MANY_REQUESTS,
                Json(json!({"error": "slow down"})),
            )
                .into_response();
            if let Ok(v) = HeaderValue::from_str(&sim.config.retry_after_secs.to_string()) {
                response.headers_mut().insert("retry-after", v);
            }
            return response;
        }
        _ => {}
    }
    let stored = sim.commit(provider, &key, entity, &body, slow, received_ms);
    match fault {
        Some(FaultKind::TimeoutAfterCommit) => {
            tokio::time::sleep(sim.config.hang).await;
            (StatusCode::OK, Json(stored)).into_response()
        }
        Some(FaultKind::ErrorCommitted) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "internal"})),
        )
            .into_response(),
        Some(FaultKind::Malformed) => (StatusCode::OK, "{\"charge_id\": ").into_response(),
        _ => (StatusCode::OK, Json(stored)).into_response(),
    }
}

fn body_key(body: &Value, field: &str) -> Option<String> {
    body.get(field).and_then(Value::as_str).map(str::to_owned)
}

fn missing(what: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": format!("{what} is required")})),
    )
        .into_response()
}

async fn create(
    sim: Sim,
    provider: &'static str,
    keyed_by: KeyedBy,
    headers: HeaderMap,
    body: Value,
) -> Response {
    let key = match keyed_by {
        KeyedBy::Header => headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or("the Idempotency-Key header"),
        KeyedBy::Body(field) => body_key(&body, field).ok_or(field),
    };
    match key {
        Ok(key) => handle(sim, provider, key, headers, body).await,
        Err(what) => missing(what),
    }
}

fn found(value: Option<Value>) -> Response {
    match value {
        Some(v) => (StatusCode::OK, Json(v)).into_response(),
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "not found"}))).into_response(),
    }
}

async fn effects(State(sim): State<Sim>) -> Json<EffectsReport> {
    Json(sim.effects())
}

async fn add_fault(State(sim): State<Sim>, Json(fault): Json<FaultSpec>) -> Response {
    if !PROVIDERS.contains(&fault.provider.as_str()) {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": format!("unknown provider `{}` (known: payments, emails, tickets, orders, refunds, credits)", fault.provider)})),
        )
            .into_response();
    }
    sim.add_fault(fault);
    StatusCode::NO_CONTENT.into_response()
}

async fn clear_faults(State(sim): State<Sim>) -> StatusCode {
    sim.clear_faults();
    StatusCode::NO_CONTENT
}
