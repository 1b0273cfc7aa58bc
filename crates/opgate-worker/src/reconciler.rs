//! The reconciler: resolve operations whose outcome opgate does not know by looking the
//! key up at the provider — never by sending again blindly.
//!
//! For each leased `unknown_outcome` (including a crashed dispatcher's expired lease) or
//! `acknowledged` operation, it looks the key up and records what
//! [`opgate_core::policy::after_lookup`] decides: found -> `completed_success`; a miss that
//! the provider's key retention makes safe, or a miss past the tool's `lookup_grace`
//! (proof of absence) -> a re-dispatch while attempts are left, else the tool's
//! `on_exhausted`; a miss inside the grace, a failing lookup, an acknowledged operation
//! still in progress -> look again later; no lookup, or the budget's `max_elapsed` spent
//! -> `needs_attention`.
//!
//! The ledger records how long each ambiguity took to resolve (`unknown_for_ms`).

use std::sync::Arc;
use std::time::Duration;

use opgate_core::key::scoped_key;
use opgate_core::{ErrorInfo, Event, Registry, Status};
use opgate_store::{Claim, ClaimRequest, Recording, SharedLedger};
use opgate_tools::Lookup;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::claim_loop::{Loop, Next, Round, handle_all};
use crate::{Adapters, between};
use opgate_core::policy::{self, Seen};

/// Reconciler settings.
#[derive(Debug, Clone)]
pub struct ReconcilerConfig {
    /// Lease holder name.
    pub owner: String,
    /// Lease per claimed operation.
    pub lease: Duration,
    /// Most operations per round.
    pub batch: usize,
    /// Most lookups in flight.
    pub concurrency: usize,
    /// Pause when there is nothing to reconcile.
    pub idle: Duration,
    /// Longest wait between lookups.
    pub max_backoff: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            owner: "reconciler".into(),
            lease: Duration::from_secs(60),
            batch: 32,
            concurrency: 32,
            idle: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// Resolves unknown outcomes.
#[derive(Clone)]
pub struct Reconciler {
    ledger: SharedLedger,
    registry: Arc<Registry>,
    adapters: Adapters,
    config: ReconcilerConfig,
    permits: Arc<Semaphore>,
}

impl Reconciler {
    /// A reconciler over the ledger with the tools' adapters.
    pub fn new(
        ledger: SharedLedger,
        registry: Arc<Registry>,
        adapters: Adapters,
        config: ReconcilerConfig,
    ) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(config.concurrency.max(1))),
            ledger,
            registry,
            adapters,
            config,
        }
    }

    /// Reconciles until cancelled, then lets lookups in flight finish and be recorded.
    pub async fn run(self, cancel: CancellationToken) {
        info!(owner = %self.config.owner, "reconciler started");
        let worker = Loop {
            name: "reconciler",
            permits: self.permits.clone(),
            batch: self.config.batch,
            idle: self.config.idle,
            // Its work comes due by the clock (leases, lookup schedules): it polls.
            changes: opgate_store::Changes::never(),
            freed: Default::default(),
        };
        worker
            .run(
                cancel,
                |room| {
                    let this = self.clone();
                    async move {
                        let claims = this.claim(room).await?;
                        // Its work comes due by the clock: it claims again at once after
                        // work, else polls.
                        let next = if claims.is_empty() {
                            Next::Room
                        } else {
                            Next::Now
                        };
                        Ok(Round { claims, next })
                    }
                },
                {
                    let handler = self.clone();
                    move |claim| {
                        let this = handler.clone();
                        async move { this.reconcile(claim).await }
                    }
                },
                None,
            )
            .await;
        info!("reconciler stopped");
    }

    async fn claim(&self, limit: usize) -> opgate_store::Result<Vec<Claim>> {
        self.ledger
            .claim_reconcile(&ClaimRequest {
                owner: self.config.owner.clone(),
                lease: self.config.lease,
                limit,
                ..Default::default()
            })
            .await
    }

    /// One round without the loop (tests): claim, reconcile all, wait.
    pub async fn run_once(&self) -> opgate_store::Result<usize> {
        let claims = self.claim(self.config.batch).await?;
        Ok(handle_all(claims, |claim| {
            let this = self.clone();
            async move { this.reconcile(claim).await }
        })
        .await)
    }

    /// Looks one operation up and records what follows.
    pub async fn reconcile(&self, claim: Claim) {
        let op = &claim.operation;
        let now = claim.claimed_at;
        let epoch = claim.epoch();
        let tool = self.registry.tool(&op.tool);
        let adapter = self.adapters.get(&op.tool);
        // Counted from when the outcome became unknown: after the latest attempt ended (or
        // its lease ran out), so after any effect it had. A provider's propagation lag
        // (the lookup grace) runs from the effect, never from an earlier attempt.
        let since = match op.status {
            Status::Acknowledged => op.first_attempt_at,
            _ => op.unknown_since,
        }
        .unwrap_or(now);
        let waited = between(since, now);
        let recording = match (tool, adapter) {
            (Some(tool), Some(adapter)) => {
                let key = scoped_key(&op.namespace, &op.idempotency_key);
                let span = crate::trace::CallSpan::start("opgate.lookup", op, None);
                let (seen, found, failure) = match adapter.lookup(op, &key).await {
                    None => (Seen::NoLookup, None, None),
                    Some(Lookup::Found {
                        result,
                        external_id,
                    }) => (Seen::Found, Some((result, external_id)), None),
                    Some(Lookup::NotFound) => (Seen::NotFound, None, None),
                    Some(Lookup::Failed(e)) => {
                        warn!(operation_id = %op.operation_id, error = %e, "lookup failed");
                        (Seen::Failed, None, Some(e))
                    }
                };
                let seen_label = match seen {
                    Seen::NoLookup => "no_lookup",
                    Seen::Found => "found",
                    Seen::NotFound => "not_found",
                    Seen::Failed => "failed",
                };
                span.end(seen_label, None, failure.is_some());
                let d = policy::after_lookup(
                    tool,
                    &policy::Lookup {
                        seen,
                        acknowledged: op.status == Status::Acknowledged,
                        waited,
                        attempts_made: op.attempt_count,
                        ambiguous_since: op.ambiguous_since,
                        first_attempt_at: op.first_attempt_at,
                        now,
                    },
                );
                let mut rec = Recording::new(op.operation_id, epoch, d.event, d.reason);
                rec.ambiguity = d.ambiguity;
                rec.next_in = d
                    .look_again_in
                    .map(|wait| wait.clamp(Duration::from_millis(100), self.config.max_backoff));
                if let Some((result, external_id)) = found {
                    rec.result = result;
                    rec.external_object_id = external_id;
                }
                if matches!(d.event, Event::Escalate | Event::FailPermanently) {
                    let message = match seen {
                        Seen::NoLookup => format!(
                            "tool `{}` has no lookup_url; a person must check the provider",
                            op.tool
                        ),
                        Seen::Failed => failure.unwrap_or_default(),
                        _ => format!("{}: not found at the provider after {waited:?}", d.reason),
                    };
                    rec.error = Some(error_info(d.reason, message));
                }
                rec
            }
            _ => {
                let mut rec = Recording::new(op.operation_id, epoch, Event::Escalate, "no_adapter");
                rec.error = Some(error_info(
                    "no_adapter",
                    format!("tool `{}` is not registered with an adapter", op.tool),
                ));
                rec
            }
        };
        let event = recording.event;
        let reason = recording.reason.clone();
        let m = opgate_metrics::metrics();
        m.reconciliations
            .with_label_values(&[op.tool.as_str(), reason.as_str()])
            .inc();
        if !matches!(event, Event::StillUnknown) {
            m.reconciliation_lag
                .with_label_values(&[op.tool.as_str()])
                .observe(waited.as_secs_f64());
        }
        match self.ledger.record(&[recording]).await {
            Ok(mut results) => match results.pop() {
                Some(Ok(after)) => info!(
                    target: "opgate::attempt",
                    workflow_id = op.workflow_id.as_deref().unwrap_or(""),
                    operation_id = %op.operation_id,
                    idempotency_key = op.idempotency_key.as_str(),
                    tool = %op.tool,
                    args_fingerprint = %op.args_fingerprint,
                    transition = %format!("{} -> {}", op.status, after.status),
                    event = event.name(),
                    reason = %reason,
                    unknown_for_ms = waited.as_millis() as u64,
                    "reconcile"
                ),
                Some(Err(e)) => {
                    warn!(operation_id = %op.operation_id, error = %e, "reconcile outcome not recorded")
                }
                None => {}
            },
            Err(e) => {
                warn!(operation_id = %op.operation_id, error = %e, "reconcile recording failed; the lease will expire")
            }
        }
    }
}

fn error_info(category: &str, message: String) -> ErrorInfo {
    ErrorInfo {
        category: category.to_owned(),
        retryable: false,
        retry_after_seconds: None,
        message: Some(message),
    }
}
