//! The dispatcher: claim, call with the key, classify, record.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opgate_core::key::scoped_key;
use opgate_core::outcome::AdapterOutcome;
use opgate_core::policy::{self, Attempt, Hold};
use opgate_core::registry::Tool;
use opgate_core::{ErrorInfo, Event, Operation, Registry};
use opgate_store::{AttemptReport, Claim, ClaimRequest, Handoff, Offer, Recording, SharedLedger};
use opgate_tools::{CallReport, DispatchRequest};
use rand::SeedableRng;
use rand::rngs::StdRng;
use time::OffsetDateTime;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::Adapters;
use crate::claim_loop::{Handed, Loop, Next, Round, handle_all};
use crate::recorder::Recorder;

/// Dispatcher settings.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    /// Lease holder name (host and process).
    pub owner: String,
    /// Lease per claim, on the database clock; must exceed every adapter timeout.
    pub lease: Duration,
    /// Most operations claimed per round.
    pub batch: usize,
    /// Most calls in flight overall.
    pub concurrency: usize,
    /// Most calls in flight per tool.
    pub per_tool: usize,
    /// Per tool, at most how many more operations a claim may take than there are free
    /// permits: they wait (leased) for a permit the calls in flight give back. A claim
    /// takes `per_tool` ahead, or more, up to this, when the calls the tool's permits
    /// finish during one claim, twice over, are more than that ([`claim_ahead`]), and
    /// never more waves than the lease leaves time to send should every call run to its
    /// timeout ([`waves_in_lease`]); 0 claims only what can be sent now.
    pub prefetch: usize,
    /// Most call outcomes recorded in one ledger transaction (group commit).
    pub record_batch: usize,
    /// Pause when there is nothing to claim.
    pub idle: Duration,
    /// When an acknowledged (202) operation is first looked up.
    pub acknowledged_poll: Duration,
    /// Seed of the jitter source (random when `None`).
    pub seed: Option<u64>,
    /// Test crash point: abort the process right after a claim, before the call.
    #[doc(hidden)]
    pub crash_after_claim: bool,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            owner: "dispatcher".into(),
            lease: Duration::from_secs(60),
            batch: 64,
            concurrency: 256,
            per_tool: DEFAULT_PER_TOOL,
            prefetch: Self::prefetch_for(DEFAULT_PER_TOOL),
            record_batch: 128,
            idle: Duration::from_millis(50),
            acknowledged_poll: Duration::from_secs(2),
            seed: None,
            crash_after_claim: false,
        }
    }
}

/// The default `per_tool`.
const DEFAULT_PER_TOOL: usize = 16;

impl DispatcherConfig {
    /// The default `prefetch` for a `per_tool`: four waves, room for a fast tool's calls
    /// to keep finishing while the next claim is under way ([`claim_ahead`]).
    pub fn prefetch_for(per_tool: usize) -> usize {
        per_tool.saturating_mul(4)
    }
}

/// How many operations of a tool a claim takes ahead of its free permits: the calls its
/// `per_tool` permits finish during one claim's round trip, twice over (claims vary), so
/// the permits are still busy when the next claim lands; at least one wave (`per_tool`),
/// at most `most` (`prefetch`). Until both durations have been measured (zero), one wave.
///
/// With a tool slower than a claim this is one wave, which is all it can use: claiming
/// more would only hold entities and leases that another dispatcher could be calling.
/// Measured (`bench e2e`, a 2 ms provider, claims of ~7 ms): with one wave ahead each
/// claim round found the permits idle and the dispatcher topped out near 2,000
/// operations/s; BENCHMARKS.md.
pub fn claim_ahead(per_tool: usize, most: usize, claim: Duration, call: Duration) -> usize {
    if claim.is_zero() || call.is_zero() {
        return per_tool.min(most);
    }
    let finished = (per_tool as f64 * claim.as_secs_f64() / call.as_secs_f64()).ceil();
    // `as` saturates; the product stays far below usize::MAX for any sane config.
    let wanted = (2.0 * finished) as usize;
    wanted.max(per_tool).min(most)
}

/// How many operations a claim asks the ledger for: at most `limit`, and no more than the
/// room its tools have left in all, `tool_room` listing every tool of the registry (an
/// empty list bounds nothing). The ledger locks every row it picks, and the claim keeps
/// only what fits each tool's room: with one busy tool and claims of 64, ~40% of the rows
/// picked were locked only to be given back (35,646 picked for 20,000 operations;
/// BENCHMARKS.md). 0 when every tool is full: then nothing is asked, and an operation of
/// a tool missing from the registry (escalated when claimed) waits for room like the rest.
/// The ledger picks oldest first across the tools with room, so an older backlog of one
/// tool can fill a claim while another tool has room left; that tool gets the next claim,
/// which follows at once.
pub fn claim_limit(limit: usize, tool_room: &BTreeMap<String, usize>) -> usize {
    if tool_room.is_empty() {
        return limit;
    }
    let room = tool_room
        .values()
        .fold(0usize, |sum, free| sum.saturating_add(*free));
    limit.min(room)
}

/// What a claim that asked for `limit` ([`claim_limit`] of the loop's `asked`) and got
/// `claimed` of each tool says about the next claim ([`Next`]): claim again at once when it
/// got all it asked for and room did not cut the asking; wait for room when room bounded
/// it (the tools' room cut the limit, or it filled a tool's room: that tool may have more
/// waiting); else it took everything claimable, and only a change in the ledger (a new
/// operation, a settled one freeing its entity) can make more.
pub fn next_claim(
    asked: usize,
    limit: usize,
    tool_room: &BTreeMap<String, usize>,
    claimed: &BTreeMap<&str, usize>,
) -> Next {
    let total: usize = claimed.values().sum();
    let tool_filled = tool_room
        .iter()
        .any(|(tool, room)| claimed.get(tool.as_str()).copied().unwrap_or(0) >= *room);
    if limit > 0 && total >= limit && limit == asked {
        Next::Now
    } else if total >= limit || tool_filled {
        Next::Room
    } else {
        Next::Change
    }
}

/// How many waves of `per_tool` calls may wait behind the calls in flight, leased, and
/// still each be sent with a whole timeout of lease left (what [`policy::may_send`] asks)
/// should every call run to its timeout: the wave in flight and the waiting ones take a
/// timeout each, and the last needs one more to be sent. At least one wave (the
/// dispatcher refuses a lease shorter than twice a timeout); unbounded without a timeout.
///
/// A tool that turns slow keeps its measured call time short for a while, so
/// [`claim_ahead`] alone could leave several waves waiting behind hung calls: here a
/// lease of 10 s over 2 s timeouts holds four waves, and a fifth would reach its permit
/// with too little lease left, be given back unsent and use up an attempt.
pub fn waves_in_lease(lease: Duration, timeout: Duration) -> usize {
    if timeout.is_zero() {
        return usize::MAX;
    }
    let fit = lease.as_nanos() / timeout.as_nanos();
    usize::try_from(fit.saturating_sub(1))
        .unwrap_or(usize::MAX)
        .max(1)
}

/// A moving average of durations, in microseconds, that tasks update without a lock
/// (a lost update between two racing tasks only delays the average by one sample).
#[derive(Default)]
struct Average(AtomicU64);

impl Average {
    fn get(&self) -> Duration {
        Duration::from_micros(self.0.load(Ordering::Relaxed))
    }

    fn add(&self, sample: Duration) {
        let sample = u64::try_from(sample.as_micros()).unwrap_or(u64::MAX);
        let old = self.0.load(Ordering::Relaxed);
        let new = if old == 0 {
            sample
        } else {
            // One eighth of the way to the new sample.
            (old.saturating_mul(7).saturating_add(sample)) / 8
        };
        self.0.store(new.max(1), Ordering::Relaxed);
    }
}

/// Why a dispatcher cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The lease is too short for a tool's timeout.
    #[error("dispatcher lease {lease:?} must exceed twice tool `{tool}`'s timeout {timeout:?}")]
    LeaseTooShort {
        /// Lease.
        lease: Duration,
        /// Tool.
        tool: String,
        /// Its timeout.
        timeout: Duration,
    },
}

struct Inner {
    ledger: SharedLedger,
    recorder: Recorder,
    registry: Arc<Registry>,
    adapters: Adapters,
    config: DispatcherConfig,
    per_tool: HashMap<String, ToolSlots>,
    /// Notified when a per-tool permit is given back (the claim loop may claim again).
    tool_freed: Arc<Notify>,
    /// How long claims take, round trip (for [`claim_ahead`]).
    claim_time: Average,
    rng: Mutex<StdRng>,
    /// Whether the last claim took everything claimable ([`Next::Change`]): only then
    /// does the dispatcher offer room to the ingest. With a backlog waiting, what an
    /// ingest creates would be claimed ahead of older operations (measured: p50 latency
    /// up from 3.0 s to 5.6 s and 1,764 down to 1,377 operations/s on a pre-published
    /// load; BENCHMARKS.md).
    caught_up: std::sync::atomic::AtomicBool,
    /// Where claims made at ingest go ([`Handoff`]); taken away when the dispatcher
    /// stops, so that no new offer is made.
    handoff: Mutex<Option<mpsc::UnboundedSender<HandedBatch>>>,
    /// Their receiving end, until [`Dispatcher::run`] takes it.
    handed: Mutex<Option<Handed<Leased>>>,
}

/// Claims made at ingest.
type HandedBatch = Vec<Leased>;

impl Inner {
    /// A claim asked for at `asked`, with its tool's permit when one is free, else a place
    /// among the tool's waiting operations.
    fn leased(&self, claim: Claim, asked: Instant) -> Leased {
        let slots = self.per_tool.get(&claim.operation.tool);
        let tool_permit = slots.and_then(|s| s.permits.clone().try_acquire_owned().ok());
        let waiting = match (slots, &tool_permit) {
            (Some(s), None) => Some(Waiting::new(&s.waiting)),
            _ => None,
        };
        Leased {
            claim,
            deadline: asked + self.config.lease,
            asked,
            tool_permit,
            waiting,
        }
    }
}

/// A tool's calls in flight (`per_tool` permits) and the claimed operations waiting for
/// one of them (at most `prefetch`).
struct ToolSlots {
    permits: Arc<Semaphore>,
    waiting: Arc<AtomicUsize>,
    /// Room offered to ingest transactions now under way ([`Handoff`]), counted as
    /// waiting until they hand back their claims.
    promised: Arc<AtomicUsize>,
    /// At most this many waiting: `prefetch`, and no more waves than the lease has time
    /// for ([`waves_in_lease`]).
    most_ahead: usize,
    /// How long its calls take (for [`claim_ahead`]).
    call_time: Average,
}

impl ToolSlots {
    /// How many operations of this tool a claim may take now: its free permits and its
    /// free places ahead of them, less the room promised to ingest transactions.
    fn room(&self, config: &DispatcherConfig, claim_time: Duration) -> usize {
        let ahead = claim_ahead(
            config.per_tool.max(1),
            self.most_ahead,
            claim_time,
            self.call_time.get(),
        );
        let waiting = self.waiting.load(Ordering::Acquire);
        let free = self
            .permits
            .available_permits()
            .saturating_add(ahead.saturating_sub(waiting));
        // Room promised to an ingest is taken from the free permits first, as its claims
        // will take them.
        free.saturating_sub(self.promised.load(Ordering::Acquire))
    }
}

/// One claimed operation counted among its tool's waiting ones until it gets a permit
/// (or is dropped).
struct Waiting(Arc<AtomicUsize>);

impl Waiting {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Dispatches ready operations.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
    permits: Arc<Semaphore>,
}

/// A claim as the dispatcher holds it: the lease's end on this process's clock, and the
/// tool permit taken with it (claims are sized by the free per-tool permits).
pub struct Leased {
    /// The claim.
    pub claim: Claim,
    /// The lease ends no later than this (measured from before the claim was asked for).
    pub deadline: Instant,
    /// When the claim was asked for.
    asked: Instant,
    /// The per-tool permit, when one was free at the claim.
    tool_permit: Option<OwnedSemaphorePermit>,
    /// Otherwise, its place among the tool's waiting operations.
    waiting: Option<Waiting>,
}

impl Leased {
    /// A claim taken elsewhere (tests, tools): `asked` is when it was asked for, so the
    /// lease ends at `asked + lease` on this process's clock. No tool permit is held: the
    /// dispatcher waits for one, then checks the lease again.
    pub fn new(claim: Claim, asked: Instant, lease: Duration) -> Self {
        Self {
            claim,
            deadline: asked + lease,
            asked,
            tool_permit: None,
            waiting: None,
        }
    }

    /// How much of the lease is left.
    fn lease_left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The database clock now, estimated from the claim's timestamp plus the time since
    /// the claim was asked for (an overestimate, which errs towards "retention passed").
    fn now(&self) -> OffsetDateTime {
        self.claim.claimed_at + Instant::now().saturating_duration_since(self.asked)
    }
}

/// The label of an outcome in the attempts table and the history.
pub(crate) fn outcome_label(outcome: &AdapterOutcome) -> &'static str {
    match outcome {
        AdapterOutcome::Committed {
            acknowledged: false,
        } => "committed",
        AdapterOutcome::Committed { acknowledged: true } => "acknowledged",
        other => other.error_category().unwrap_or("unknown"),
    }
}

impl Dispatcher {
    /// A dispatcher over the ledger with the tools' adapters. Call it inside a Tokio
    /// runtime: it starts the task that group-commits call outcomes.
    pub fn new(
        ledger: SharedLedger,
        registry: Arc<Registry>,
        adapters: Adapters,
        config: DispatcherConfig,
    ) -> Result<Self, ConfigError> {
        for tool in registry.tools() {
            if let Some(adapter) = &tool.adapter
                && config.lease <= adapter.timeout * 2
            {
                return Err(ConfigError::LeaseTooShort {
                    lease: config.lease,
                    tool: tool.name.clone(),
                    timeout: adapter.timeout,
                });
            }
        }
        let per_tool = registry
            .tools()
            .map(|t| {
                (
                    t.name.clone(),
                    ToolSlots {
                        permits: Arc::new(Semaphore::new(config.per_tool.max(1))),
                        waiting: Arc::new(AtomicUsize::new(0)),
                        promised: Arc::new(AtomicUsize::new(0)),
                        most_ahead: t.adapter.as_ref().map_or(config.prefetch, |a| {
                            let waves = waves_in_lease(config.lease, a.timeout);
                            config
                                .prefetch
                                .min(config.per_tool.max(1).saturating_mul(waves))
                        }),
                        call_time: Average::default(),
                    },
                )
            })
            .collect();
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let (handoff, handed) = mpsc::unbounded_channel();
        Ok(Self {
            permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
            inner: Arc::new(Inner {
                recorder: Recorder::start(ledger.clone(), config.record_batch.max(1)),
                ledger,
                registry,
                adapters,
                config,
                per_tool,
                tool_freed: Arc::new(Notify::new()),
                claim_time: Average::default(),
                rng: Mutex::new(rng),
                caught_up: std::sync::atomic::AtomicBool::new(false),
                handoff: Mutex::new(Some(handoff)),
                handed: Mutex::new(Some(handed)),
            }),
        })
    }

    /// Dispatches until cancelled; then stops claiming and lets every call in flight
    /// finish and be recorded (no operation is left half-recorded). Claims made at
    /// ingest ([`Handoff`]) are sent as they arrive; once cancelled, no new offer is made
    /// and the drain waits for the offers made before to be taken or dropped.
    pub async fn run(self, cancel: CancellationToken) {
        info!(owner = %self.inner.config.owner, "dispatcher started");
        let handed = lock(&self.inner.handed).take();
        let stop_offers = {
            let this = self.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                cancel.cancelled().await;
                lock(&this.inner.handoff).take();
            })
        };
        let worker = Loop {
            name: "dispatcher",
            permits: self.permits.clone(),
            batch: self.inner.config.batch,
            idle: self.inner.config.idle,
            changes: self.inner.ledger.claimable_changes(),
            freed: self.inner.tool_freed.clone(),
        };
        worker
            .run(
                cancel,
                |room| {
                    let this = self.clone();
                    async move { this.claim(room).await }
                },
                {
                    let handler = self.clone();
                    move |leased| {
                        let this = handler.clone();
                        async move { this.dispatch(leased).await }
                    }
                },
                handed,
            )
            .await;
        stop_offers.abort();
        info!("dispatcher stopped");
    }

    /// Claims up to `limit` operations, of each tool at most its free permits plus its
    /// free places ahead ([`claim_ahead`]), and takes the free permits with the claims
    /// (the others wait in [`Self::dispatch`]).
    async fn claim(&self, asked: usize) -> opgate_store::Result<Round<Leased>> {
        let c = &self.inner.config;
        let tool_room = self.tool_room();
        let limit = claim_limit(asked, &tool_room);
        if limit == 0 {
            return Ok(Round {
                claims: Vec::new(),
                next: Next::Room,
            });
        }
        let started = Instant::now();
        let claims = self
            .inner
            .ledger
            .claim(&ClaimRequest {
                owner: c.owner.clone(),
                lease: c.lease,
                limit,
                tool_room: tool_room.clone(),
            })
            .await?;
        if !claims.is_empty() {
            // Only claims that found work: an empty one is a short read, not the round
            // trip the calls in flight must outlast.
            self.inner.claim_time.add(started.elapsed());
        }
        let mut claimed: BTreeMap<&str, usize> = BTreeMap::new();
        for claim in &claims {
            *claimed.entry(claim.operation.tool.as_str()).or_default() += 1;
        }
        let next = next_claim(asked, limit, &tool_room, &claimed);
        self.inner
            .caught_up
            .store(next == Next::Change, Ordering::Release);
        tracing::debug!(
            limit,
            claimed = claims.len(),
            ?next,
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "claimed"
        );
        let claims = claims
            .into_iter()
            .map(|claim| self.inner.leased(claim, started))
            .collect();
        Ok(Round { claims, next })
    }

    /// How many operations of each tool a claim may take now ([`ToolSlots::room`]).
    fn tool_room(&self) -> BTreeMap<String, usize> {
        let claim_time = self.inner.claim_time.get();
        self.inner
            .per_tool
            .iter()
            .map(|(tool, slots)| (tool.clone(), slots.room(&self.inner.config, claim_time)))
            .collect()
    }

    /// One round without the loop (tests): claim up to `limit`, dispatch them all, wait.
    pub async fn run_once(&self, limit: usize) -> opgate_store::Result<usize> {
        let claims = self.claim(limit).await?.claims;
        Ok(handle_all(claims, |leased| {
            let this = self.clone();
            async move { this.dispatch(leased).await }
        })
        .await)
    }

    /// Calls the tool for one claimed operation and records the outcome. Before the call
    /// (when the claim is taken, and again after waiting for a permit) the dispatch policy
    /// decides whether it may be sent at all ([`policy::may_send`]).
    pub async fn dispatch(&self, mut leased: Leased) {
        let inner = &self.inner;
        if inner.config.crash_after_claim {
            // `dispatched` and the attempt row are committed; nothing was sent.
            warn!(operation_id = %leased.claim.operation.operation_id, "crash point: aborting after the claim");
            std::process::abort();
        }
        let claim = &leased.claim;
        let op = &claim.operation;
        let attempt_id = claim.attempt_id.unwrap_or_default();
        let Some(tool) = inner.registry.tool(&op.tool) else {
            self.give_up(claim, "tool_not_registered", Event::Escalate)
                .await;
            return;
        };
        let Some(adapter) = inner.adapters.get(&op.tool).cloned() else {
            self.give_up(claim, "no_adapter", Event::Escalate).await;
            return;
        };
        if op.attempt_count > tool.retry.max_attempts {
            let event = policy::over_budget(tool, op.ambiguous_since);
            self.give_up(claim, "attempt_budget_exhausted", event).await;
            return;
        }
        if let Err(hold) =
            policy::may_send(tool, op.ambiguous_since, leased.now(), leased.lease_left())
        {
            self.hold(claim, hold).await;
            return;
        }
        if leased.tool_permit.is_none() {
            // Claimed ahead of a free permit (prefetch), or outside the loop (run_once):
            // wait for one, then ask the policy again — the lease kept running meanwhile.
            leased.tool_permit = match inner.per_tool.get(&op.tool) {
                Some(s) => s.permits.clone().acquire_owned().await.ok(),
                None => None,
            };
            leased.waiting = None;
            if let Err(hold) = policy::may_send(
                tool,
                leased.claim.operation.ambiguous_since,
                leased.now(),
                leased.lease_left(),
            ) {
                self.hold(&leased.claim, hold).await;
                return;
            }
        }
        let claim = &leased.claim;
        let op = &claim.operation;
        let provider_key = scoped_key(&op.namespace, &op.idempotency_key);
        let span = crate::trace::CallSpan::start("opgate.dispatch", op, Some(attempt_id));
        let traceparent = span.traceparent();
        let report = adapter
            .dispatch(&DispatchRequest {
                operation: op,
                attempt_id,
                provider_key: &provider_key,
                traceparent: traceparent.as_deref(),
            })
            .await;
        span.end(
            outcome_label(&report.outcome),
            report.http_status,
            report.outcome.error_category().is_some(),
        );
        // `per_tool` bounds calls in flight at the provider: the call is over, the
        // outcome's commit need not hold the tool's permit (the overall permit bounds it).
        if leased.tool_permit.take().is_some() {
            inner.tool_freed.notify_one();
        }
        if let Some(slots) = inner.per_tool.get(&op.tool) {
            slots.call_time.add(report.latency);
        }
        let recording = self.decide(tool, claim, leased.now(), &report);
        let transition = recording.event;
        let m = opgate_metrics::metrics();
        m.attempts
            .with_label_values(&[op.tool.as_str(), outcome_label(&report.outcome)])
            .inc();
        m.attempt_seconds
            .with_label_values(&[op.tool.as_str()])
            .observe(report.latency.as_secs_f64());
        if transition == Event::OutcomeUnknown {
            m.unknown_outcomes
                .with_label_values(&[
                    op.tool.as_str(),
                    report.outcome.error_category().unwrap_or("unknown"),
                ])
                .inc();
        }
        match self.record(recording).await {
            Some(after) => log_attempt(op, attempt_id, tool, &report, transition, Some(&after)),
            None => log_attempt(op, attempt_id, tool, &report, transition, None),
        }
    }

    /// What follows an attempt, by the dispatch policy.
    fn decide(
        &self,
        tool: &Tool,
        claim: &Claim,
        now: OffsetDateTime,
        report: &CallReport,
    ) -> Recording {
        let op = &claim.operation;
        let decision = {
            let mut rng = self.inner.rng.lock().unwrap_or_else(|e| e.into_inner());
            policy::after_attempt(
                tool,
                &Attempt {
                    outcome: &report.outcome,
                    number: op.attempt_count,
                    started_at: claim.claimed_at,
                    first_attempt_at: claim.first_attempt_at.unwrap_or(claim.claimed_at),
                    ambiguous_since: op.ambiguous_since,
                    now,
                },
                &mut *rng,
            )
        };
        let next_in = decision.retry_in.or(match decision.event {
            Event::Acknowledge => Some(self.inner.config.acknowledged_poll),
            _ => None,
        });
        let retry_after_seconds = match &report.outcome {
            AdapterOutcome::Throttled { retry_after } => retry_after.map(|d| d.as_secs()),
            _ => None,
        };
        let error = report.outcome.error_category().map(|category| ErrorInfo {
            category: category.to_owned(),
            retryable: decision.retryable,
            retry_after_seconds,
            message: report.detail.clone(),
        });
        Recording {
            operation_id: op.operation_id,
            epoch: claim.epoch(),
            event: decision.event,
            reason: outcome_label(&report.outcome).to_owned(),
            attempt: claim.attempt_id.map(|id| {
                (
                    id,
                    AttemptReport {
                        outcome: outcome_label(&report.outcome).to_owned(),
                        http_status: report.http_status,
                        error_category: report.outcome.error_category().map(str::to_owned),
                        latency: Some(report.latency),
                        provider_request_id: report.provider_request_id.clone(),
                    },
                )
            }),
            next_in,
            result: report.result.clone(),
            external_object_id: report.external_id.clone(),
            external_request_id: report.provider_request_id.clone(),
            error,
            ambiguity: decision.ambiguity,
        }
    }

    /// A claim the policy would not send: given back unsent (a short lease), or handed
    /// to the reconciler (a resend no longer covered by the provider's key retention).
    async fn hold(&self, claim: &Claim, hold: Hold) {
        let (event, reason) = hold.event();
        self.give_up(claim, reason, event).await;
    }

    /// Ends an attempt that was claimed but never sent.
    async fn give_up(&self, claim: &Claim, reason: &str, event: Event) {
        let next_in = (event == Event::ScheduleRetry).then_some(Duration::ZERO);
        warn!(operation_id = %claim.operation.operation_id, tool = %claim.operation.tool, reason, "not dispatched");
        let mut rec = Recording::new(claim.operation.operation_id, claim.epoch(), event, reason);
        rec.attempt = claim.attempt_id.map(|id| {
            (
                id,
                AttemptReport {
                    outcome: "not_sent".into(),
                    error_category: Some(reason.to_owned()),
                    ..AttemptReport::default()
                },
            )
        });
        rec.next_in = next_in;
        rec.error = Some(ErrorInfo {
            category: reason.to_owned(),
            retryable: next_in.is_some(),
            retry_after_seconds: None,
            message: None,
        });
        self.record(rec).await;
    }

    /// Records an outcome through the group-committing recorder.
    async fn record(&self, recording: Recording) -> Option<Operation> {
        self.inner.recorder.record(recording).await
    }
}

/// Claim at ingest ([`opgate_store::handoff`]): offered only while the dispatcher's own
/// claims find no backlog (`caught_up`), so what an ingest claims is the newest work and
/// goes ahead of no older operation. The room offered is what a claim of the dispatcher's
/// own could take now ([`ToolSlots::room`]: free permits and free places ahead of them),
/// at most as many as the batch holds, of all at most `batch` and the free overall
/// permits. The tools' room is promised to the ingest until its claims come back
/// (counted against the room of every other claim and offer); a handed claim that finds
/// no free permit waits for one behind those claimed before it, as a claim taken ahead
/// does (the permits are handed out in order).
impl Handoff for Dispatcher {
    fn offer(&self, wanted: &BTreeMap<String, usize>) -> Option<Offer> {
        let inner = &self.inner;
        if !inner.caught_up.load(Ordering::Acquire) {
            return None;
        }
        let sender = lock(&inner.handoff).clone()?;
        let total = wanted
            .values()
            .fold(0usize, |sum, n| sum.saturating_add(*n));
        let claim_time = inner.claim_time.get();
        let tool_room: BTreeMap<String, usize> = inner
            .per_tool
            .iter()
            .map(|(tool, slots)| {
                let want = wanted.get(tool).copied().unwrap_or(0);
                (
                    tool.clone(),
                    slots.room(&inner.config, claim_time).min(want),
                )
            })
            .collect();
        // Within the calls in flight overall too, so a claim handed back finds its permit.
        let most = total
            .min(inner.config.batch)
            .min(self.permits.available_permits());
        let limit = claim_limit(most, &tool_room);
        if limit == 0 {
            return None;
        }
        let promised = Promised(
            tool_room
                .iter()
                .filter(|(_, room)| **room > 0)
                .filter_map(|(tool, room)| {
                    let slots = inner.per_tool.get(tool)?;
                    slots.promised.fetch_add(*room, Ordering::AcqRel);
                    Some((slots.promised.clone(), *room))
                })
                .collect(),
            inner.tool_freed.clone(),
        );
        let asked = Instant::now();
        let request = ClaimRequest {
            owner: inner.config.owner.clone(),
            lease: inner.config.lease,
            limit,
            tool_room,
        };
        let this = self.inner.clone();
        Some(Offer::new(request, move |claims| {
            let handed: HandedBatch = claims
                .into_iter()
                .map(|claim| this.leased(claim, asked))
                .collect();
            // The room promised is given back once the claims hold their places.
            drop(promised);
            if let Err(lost) = sender.send(handed) {
                // Only when the dispatcher's loop has ended: the leases run out and the
                // reconciler settles these operations, as after a crash.
                warn!(
                    claims = lost.0.len(),
                    "claims made at ingest found the dispatcher stopped"
                );
            }
        }))
    }
}

/// Room promised to an ingest transaction, per tool; given back (and the loop told) when
/// dropped: its claims handed over, or the transaction failed.
struct Promised(Vec<(Arc<AtomicUsize>, usize)>, Arc<Notify>);

impl Drop for Promised {
    fn drop(&mut self) {
        for (count, n) in &self.0 {
            count.fetch_sub(*n, Ordering::AcqRel);
        }
        self.1.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The one structured line per attempt (DESIGN.md section 7).
fn log_attempt(
    op: &Operation,
    attempt_id: uuid::Uuid,
    tool: &Tool,
    report: &CallReport,
    event: Event,
    after: Option<&Operation>,
) {
    info!(
        target: "opgate::attempt",
        workflow_id = op.workflow_id.as_deref().unwrap_or(""),
        operation_id = %op.operation_id,
        // A string value, so the formatter escapes it (ids and keys are checked at ingest;
        // rows written before that may not be).
        idempotency_key = op.idempotency_key.as_str(),
        attempt_id = %attempt_id,
        attempt = op.attempt_count,
        tool = %op.tool,
        side_effect_class = tool.side_effect_class.as_str(),
        args_fingerprint = %op.args_fingerprint,
        provider_request_id = report.provider_request_id.as_deref().unwrap_or(""),
        transition = %format!("{} -> {}", op.status, after.map_or("(not recorded)", |a| a.status.as_str())),
        event = event.name(),
        latency_ms = report.latency.as_millis() as u64,
        error_category = report.outcome.error_category().unwrap_or(""),
        dedupe_decision = "miss",
        "attempt"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_claim_takes_one_wave_ahead_until_it_has_measured_claims_and_calls() {
        assert_eq!(claim_ahead(16, 64, Duration::ZERO, 2 * MS), 16);
        assert_eq!(claim_ahead(16, 64, 7 * MS, Duration::ZERO), 16);
        // Never more than `prefetch`: 0 claims only what can be sent at once.
        assert_eq!(claim_ahead(16, 0, Duration::ZERO, Duration::ZERO), 0);
    }

    #[test]
    fn a_tool_faster_than_a_claim_gets_the_calls_one_claim_lasts_twice_over() {
        // 16 permits, 2 ms calls, 7 ms claims: 56 calls finish during one claim.
        assert_eq!(claim_ahead(16, 1_000, 7 * MS, 2 * MS), 112);
        assert_eq!(
            claim_ahead(16, 64, 7 * MS, 2 * MS),
            64,
            "capped by prefetch"
        );
        assert_eq!(
            claim_ahead(16, 10, 7 * MS, 2 * MS),
            10,
            "a smaller prefetch too"
        );
    }

    #[test]
    fn a_tool_slower_than_a_claim_gets_one_wave() {
        assert_eq!(claim_ahead(16, 64, 7 * MS, 300 * MS), 16);
        assert_eq!(claim_ahead(16, 64, 7 * MS, 14 * MS), 16);
        // Just faster than a claim: a little more than a wave.
        assert_eq!(claim_ahead(16, 64, 7 * MS, 5 * MS), 46);
    }

    #[test]
    fn a_claim_asks_for_no_more_than_its_tools_have_room_for() {
        let room = |rooms: &[(&str, usize)]| -> BTreeMap<String, usize> {
            rooms.iter().map(|(t, r)| ((*t).to_owned(), *r)).collect()
        };
        // One busy tool with 34 places: 34 rows, not the 64 of a whole batch.
        assert_eq!(claim_limit(64, &room(&[("pay", 34)])), 34);
        // The tools' room in all, up to the batch.
        assert_eq!(claim_limit(64, &room(&[("pay", 20), ("mail", 30)])), 50);
        assert_eq!(claim_limit(64, &room(&[("pay", 50), ("mail", 30)])), 64);
        // Every tool full: nothing to ask for.
        assert_eq!(claim_limit(64, &room(&[("pay", 0), ("mail", 0)])), 0);
        // No tools listed bounds nothing; huge rooms saturate.
        assert_eq!(claim_limit(64, &BTreeMap::new()), 64);
        assert_eq!(
            claim_limit(64, &room(&[("a", usize::MAX), ("b", usize::MAX)])),
            64
        );
    }

    #[test]
    fn a_claim_that_took_less_than_it_had_room_for_waits_for_a_change_not_for_room() {
        let room = |rooms: &[(&str, usize)]| -> BTreeMap<String, usize> {
            rooms.iter().map(|(t, r)| ((*t).to_owned(), *r)).collect()
        };
        let got = |claims: &[(&'static str, usize)]| -> BTreeMap<&'static str, usize> {
            claims.iter().copied().collect()
        };
        let tools = room(&[("pay", 40), ("mail", 40)]);
        // All it asked for, room to spare: more may be queued.
        assert_eq!(
            next_claim(64, 64, &tools, &got(&[("pay", 34), ("mail", 30)])),
            Next::Now
        );
        // Less than asked, no tool filled: everything claimable was claimed.
        assert_eq!(
            next_claim(64, 64, &tools, &got(&[("pay", 3)])),
            Next::Change
        );
        assert_eq!(next_claim(64, 64, &tools, &got(&[])), Next::Change);
        // Less than asked, but one tool's room filled: that tool may have more waiting.
        assert_eq!(next_claim(64, 64, &tools, &got(&[("pay", 40)])), Next::Room);
        // A tool with no room at all: its operations wait for room.
        let one_full = room(&[("pay", 0), ("mail", 40)]);
        assert_eq!(
            next_claim(64, 40, &one_full, &got(&[("mail", 2)])),
            Next::Room
        );
        // The tools' room cut the asking and the claim got it all: wait for room.
        let small = room(&[("pay", 10)]);
        assert_eq!(next_claim(64, 10, &small, &got(&[("pay", 10)])), Next::Room);
        // Every tool full: nothing was asked.
        assert_eq!(
            next_claim(64, 0, &room(&[("pay", 0)]), &got(&[])),
            Next::Room
        );
        // No tools listed: the limit alone.
        let none = BTreeMap::new();
        assert_eq!(next_claim(8, 8, &none, &got(&[("x", 8)])), Next::Now);
        assert_eq!(next_claim(8, 8, &none, &got(&[("x", 7)])), Next::Change);
    }

    #[test]
    fn no_more_waves_wait_than_the_lease_can_send_after_calls_that_run_to_their_timeout() {
        let s = Duration::from_secs(1);
        // 10 s over 2 s: the wave in flight, four waiting, the fourth sent at 8 s with 2 s left.
        assert_eq!(waves_in_lease(10 * s, 2 * s), 4);
        assert_eq!(waves_in_lease(60 * s, 2 * s), 29);
        // Just over twice a timeout (the least the dispatcher accepts): one wave.
        assert_eq!(waves_in_lease(4100 * MS, 2 * s), 1);
        assert_eq!(waves_in_lease(s, 2 * s), 1, "never less than one");
        assert_eq!(waves_in_lease(s, Duration::ZERO), usize::MAX);
    }

    #[test]
    fn a_tool_whose_timeouts_fill_the_lease_gets_fewer_places_ahead() {
        let adapter = |timeout_ms: u64| {
            format!(
                "[[tools]]\nname = \"t\"\nside_effect_class = \"irreversible\"\nentity = \"order\"\n\
                 key = \"k:{{entity}}\"\n[tools.adapter]\nkind = \"http\"\nurl = \"http://127.0.0.1:9\"\n\
                 timeout_ms = {timeout_ms}\n"
            )
        };
        let room_of = |timeout_ms: u64, lease: Duration| -> usize {
            let registry = Registry::from_toml(&adapter(timeout_ms)).expect("registry");
            let config = DispatcherConfig {
                lease,
                ..DispatcherConfig::default()
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                // Never queried: the dispatcher is built, not run.
                let file = std::env::temp_dir().join(format!("opgate-{}.db", uuid::Uuid::now_v7()));
                let ledger: SharedLedger = Arc::new(
                    opgate_store::SqliteLedger::open(&file.to_string_lossy())
                        .await
                        .expect("ledger"),
                );
                let d = Dispatcher::new(ledger, Arc::new(registry), Adapters::default(), config)
                    .expect("dispatcher");
                let slots = d.inner.per_tool.get("t").expect("slots");
                // Calls far shorter than claims: as many ahead as allowed.
                slots.call_time.add(MS);
                let room = slots.room(&d.inner.config, 100 * MS);
                for suffix in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
                }
                room
            })
        };
        // Default lease (60 s) over 2 s timeouts: prefetch (64) bounds it.
        assert_eq!(room_of(2_000, Duration::from_secs(60)), 16 + 64);
        // 10 s over 2 s: four waves of 16 fit, the same 64.
        assert_eq!(room_of(2_000, Duration::from_secs(10)), 16 + 64);
        // 10 s over 4 s: one wave.
        assert_eq!(room_of(4_000, Duration::from_secs(10)), 16 + 16);
    }

    #[test]
    fn the_average_starts_at_its_first_sample_and_moves_an_eighth_each_time() {
        let a = Average::default();
        assert_eq!(a.get(), Duration::ZERO);
        a.add(8 * MS);
        assert_eq!(a.get(), 8 * MS);
        a.add(16 * MS);
        assert_eq!(a.get(), 9 * MS);
        // A zero sample does not make it read as "not measured".
        let b = Average::default();
        b.add(Duration::ZERO);
        assert!(!b.get().is_zero());
    }

    #[test]
    fn a_tool_room_counts_free_permits_and_free_places_ahead() {
        let config = DispatcherConfig {
            per_tool: 4,
            prefetch: 16,
            ..DispatcherConfig::default()
        };
        let slots = ToolSlots {
            permits: Arc::new(Semaphore::new(4)),
            waiting: Arc::new(AtomicUsize::new(0)),
            promised: Arc::new(AtomicUsize::new(0)),
            most_ahead: config.prefetch,
            call_time: Average::default(),
        };
        // Nothing measured: one wave ahead.
        assert_eq!(slots.room(&config, Duration::ZERO), 4 + 4);
        // 1 ms calls, 4 ms claims: 16 finish per claim, twice over, capped at 16.
        slots.call_time.add(MS);
        assert_eq!(slots.room(&config, 4 * MS), 4 + 16);
        // Three already waiting and two permits taken.
        let _w: Vec<Waiting> = (0..3).map(|_| Waiting::new(&slots.waiting)).collect();
        let _p = slots
            .permits
            .clone()
            .try_acquire_many_owned(2)
            .expect("free");
        assert_eq!(slots.room(&config, 4 * MS), 2 + 13);
        // Room promised to an ingest comes off the free permits first, then the places.
        slots.promised.store(5, Ordering::Release);
        assert_eq!(slots.room(&config, 4 * MS), 10);
        slots.promised.store(40, Ordering::Release);
        assert_eq!(slots.room(&config, 4 * MS), 0);
    }
}
