//! Starting opgate's roles in this process: `opgate run` and `opgate dev` both come here.
//!
//! A proposal's path through the roles: `ingest` (opgate-kafka's IngestWorker) writes it
//! to the ledger; `dispatch` (opgate-worker's Dispatcher) claims and sends it through the
//! tool's adapter; `reconcile` (Reconciler) settles unknown outcomes; `relay`
//! (ResultsRelay) publishes every state change to `opgate.results`; `api` (opgate-api)
//! lets people and HTTP agents inspect and act.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::Config;

/// The role names `--roles` accepts.
pub const ROLES: [&str; 5] = ["ingest", "relay", "dispatch", "reconcile", "api"];

/// Looks up `${NAME}` references in tool adapters (the environment, or `opgate dev`'s
/// overlay that points `OPGATE_SIM_URL` at the embedded providers).
pub type EnvLookup = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The process environment as an [`EnvLookup`].
pub fn process_env() -> EnvLookup {
    Arc::new(|name| std::env::var(name).ok())
}

/// Roles running in this process.
pub struct Running {
    cancel: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
    /// Where the admin API listens, when the `api` role runs.
    pub api_addr: Option<SocketAddr>,
    /// The ledger the roles share.
    pub ledger: opgate_store::SharedLedger,
    /// The OTLP exporter, flushed when the roles are dropped.
    _telemetry: crate::telemetry::Telemetry,
}

/// Waits for a broker to answer before the Kafka roles start: a broker that stays
/// unreachable past `kafka.startup_timeout_ms` is a failed start (non-zero exit), not a
/// process that logs and waits forever.
async fn wait_for_broker(kafka: &opgate_kafka::KafkaConfig) -> anyhow::Result<()> {
    let probe = opgate_kafka::BrokerProbe::new(kafka, Duration::from_secs(2))?;
    let deadline = Duration::from_millis(kafka.startup_timeout_ms);
    // SIGTERM while waiting stops the start (as PID 1 in a container, nothing else would).
    tokio::select! {
        up = probe.wait_until_up(deadline) => up.map_err(|e| {
            anyhow::anyhow!(
                "no Kafka broker answered at {} within {deadline:?} (kafka.startup_timeout_ms; 0 waits forever): {e}",
                kafka.brokers,
            )
        }),
        () = shutdown_signal() => bail!("stopped by a signal while waiting for a Kafka broker at {}", kafka.brokers),
    }
}

/// Checks role names before anything starts.
pub fn validate(roles: &[String]) -> anyhow::Result<()> {
    for role in roles {
        if !ROLES.contains(&role.as_str()) {
            bail!("unknown role `{role}` (roles: {})", ROLES.join(", "));
        }
    }
    Ok(())
}

/// Starts the chosen roles over the config's ledger and broker.
pub async fn start(config: &Config, roles: &[String], env: EnvLookup) -> anyhow::Result<Running> {
    validate(roles)?;
    let has = |r: &str| roles.iter().any(|x| x == r);
    let telemetry = crate::telemetry::install(config.telemetry.as_ref())?;
    let ledger = opgate_store::open(&config.database_url()?).await?;
    if has("ingest") || has("relay") {
        wait_for_broker(config.kafka()?).await?;
    }
    let registry = Arc::new(config.registry.clone());
    let cancel = CancellationToken::new();
    let mut tasks = JoinSet::new();
    let owner = format!("{}-{}", hostname(), std::process::id());
    // The ingest worker is built first, so the API's /readyz can watch its partitions.
    let ingest = if has("ingest") {
        Some(opgate_kafka::IngestWorker::new(
            config.kafka()?,
            ledger.clone(),
            registry.clone(),
            config.limits,
        )?)
    } else {
        None
    };
    // What /readyz checks besides the ledger, on the API and on the metrics listener.
    let mut checks: Vec<(&'static str, opgate_api::ReadinessCheck)> = Vec::new();
    if let Some(kafka) = &config.kafka
        && (has("api") || config.metrics.is_some())
    {
        let probe = opgate_kafka::BrokerProbe::new(kafka, Duration::from_secs(2))?;
        checks.push((
            "broker",
            Arc::new(move || {
                let probe = probe.clone();
                Box::pin(async move { probe.check().await })
            }),
        ));
    }
    if let (Some(worker), Some(kafka)) = (&ingest, &config.kafka) {
        let health = worker.health();
        let threshold = Duration::from_millis(kafka.batch.unready_after_stall_ms);
        checks.push((
            "ingest",
            Arc::new(move || {
                let result = health.check(threshold);
                Box::pin(async move { result })
            }),
        ));
    }
    // Listeners first: a port that cannot be bound fails the start before any role has
    // claimed work it would then have to abandon.
    let mut api_addr = None;
    if has("api") {
        let api = config
            .api
            .as_ref()
            .context("the api role needs an [api] table with [[api.tokens]]")?;
        let tokens = api.tokens()?;
        anyhow::ensure!(
            !tokens.is_empty(),
            "the api role needs at least one [[api.tokens]]"
        );
        let mut state =
            opgate_api::ApiState::new(ledger.clone(), registry.clone(), config.limits, tokens)?;
        for (name, check) in &checks {
            state = state.with_check(name, check.clone());
        }
        let (addr, server) = opgate_api::serve(api.listen, state)
            .await
            .with_context(|| format!("api.listen {}", api.listen))?;
        info!(%addr, "admin API listening");
        api_addr = Some(addr);
        let token = cancel.child_token();
        tasks.spawn(async move {
            tokio::select! {
                _ = server => {}
                () = token.cancelled() => {}
            }
            Ok(())
        });
    }
    if let Some(metrics) = &config.metrics {
        let (addr, server) = opgate_api::serve_metrics(metrics.listen, ledger.clone(), checks)
            .await
            .with_context(|| format!("metrics.listen {}", metrics.listen))?;
        info!(%addr, "metrics listening");
        let token = cancel.child_token();
        tasks.spawn(async move {
            tokio::select! {
                _ = server => {}
                () = token.cancelled() => {}
            }
            Ok(())
        });
    }
    if has("relay") {
        let kafka = config.kafka()?;
        let relay = opgate_kafka::ResultsRelay::new(
            kafka,
            ledger.clone(),
            owner.clone(),
            500,
            opgate_kafka::ResultsRelay::default_lease(kafka)?,
        )?;
        let token = cancel.child_token();
        tasks.spawn(async move { Ok(relay.run(token).await?) });
        let (reap_after, reap_every) = config.worker.reaping()?;
        tasks.spawn(reaper(
            ledger.clone(),
            reap_after,
            reap_every,
            cancel.child_token(),
        ));
    }
    // This process's dispatcher, for claims made at ingest.
    let mut handoff: Option<Arc<dyn opgate_store::Handoff>> = None;
    if has("dispatch") || has("reconcile") {
        let adapters = opgate_worker::Adapters::from_registry(&registry, |n| env(n))?;
        let w = &config.worker;
        let lease = Duration::from_millis(w.lease_ms.unwrap_or(60_000));
        if has("dispatch") {
            let defaults = opgate_worker::DispatcherConfig::default();
            let dispatcher = opgate_worker::Dispatcher::new(
                ledger.clone(),
                registry.clone(),
                adapters.clone(),
                opgate_worker::DispatcherConfig {
                    owner: format!("{owner}/dispatch"),
                    lease,
                    batch: w.batch.unwrap_or(defaults.batch),
                    concurrency: w.concurrency.unwrap_or(defaults.concurrency),
                    per_tool: w.per_tool.unwrap_or(defaults.per_tool),
                    prefetch: w
                        .prefetch
                        .unwrap_or(opgate_worker::DispatcherConfig::prefetch_for(
                            w.per_tool.unwrap_or(defaults.per_tool),
                        )),
                    record_batch: w.record_batch.unwrap_or(defaults.record_batch),
                    // Test crash point (see crates/opgate/tests/crash.rs).
                    crash_after_claim: std::env::var("OPGATE_CRASH_AT").as_deref()
                        == Ok("after_claim"),
                    ..defaults
                },
            )?;
            if w.claim_at_ingest.unwrap_or(true) {
                handoff = Some(Arc::new(dispatcher.clone()));
            }
            let token = cancel.child_token();
            tasks.spawn(async move {
                dispatcher.run(token).await;
                Ok(())
            });
        }
        if has("reconcile") {
            let defaults = opgate_worker::ReconcilerConfig::default();
            let reconciler = opgate_worker::Reconciler::new(
                ledger.clone(),
                registry.clone(),
                adapters,
                opgate_worker::ReconcilerConfig {
                    owner: format!("{owner}/reconcile"),
                    lease,
                    max_backoff: w
                        .reconcile_max_backoff_ms
                        .map_or(defaults.max_backoff, Duration::from_millis),
                    ..defaults
                },
            );
            let token = cancel.child_token();
            tasks.spawn(async move {
                reconciler.run(token).await;
                Ok(())
            });
        }
    }
    // The ingest worker starts last, once the dispatcher it may hand claims to is built.
    if let Some(mut worker) = ingest {
        if let Some(handoff) = handoff {
            worker = worker.with_handoff(handoff);
        }
        let token = cancel.child_token();
        tasks.spawn(async move { Ok(worker.run(token).await?) });
    }
    info!(roles = %roles.join(","), "opgate running");
    Ok(Running {
        cancel,
        tasks,
        api_addr,
        ledger,
        _telemetry: telemetry,
    })
}

impl Running {
    /// Runs until SIGTERM or Ctrl-C (or until a role fails), then shuts down.
    /// A second signal during the drain stops the process at once (exit status 130):
    /// what was in flight is then settled by the next process (inbox redelivery, lease
    /// expiry and reconciliation), as after a crash.
    pub async fn until_signal(mut self) -> anyhow::Result<()> {
        tokio::select! {
            () = shutdown_signal() => info!("shutting down; a second signal stops at once"),
            Some(done) = self.tasks.join_next() => {
                self.cancel.cancel();
                done??;
                bail!("a role stopped on its own");
            }
        }
        tokio::select! {
            drained = self.shutdown() => drained,
            () = shutdown_signal() => {
                tracing::warn!("second signal: stopping without draining");
                std::process::exit(130);
            }
        }
    }

    /// Drains: the ingest worker finishes or abandons its batch, commits offsets and
    /// leaves the group; dispatchers let calls in flight finish and record them; the relay
    /// finishes its round.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.cancel.cancel();
        while let Some(done) = self.tasks.join_next().await {
            done??;
        }
        Ok(())
    }

    /// Fails if a role has already stopped with an error (checked between demo phases).
    pub fn check(&mut self) -> anyhow::Result<()> {
        if let Some(done) = self.tasks.try_join_next() {
            done??;
            bail!("a role stopped on its own");
        }
        Ok(())
    }
}

/// Deletes what the ledger no longer needs (inbox rows, finished queue rows, published
/// results past `retention`) every `every`; operations, events and attempts are kept.
/// Several processes may run it: the deletes are idempotent.
async fn reaper(
    ledger: opgate_store::SharedLedger,
    retention: Duration,
    every: Duration,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    loop {
        tokio::select! {
            () = cancel.cancelled() => return Ok(()),
            () = tokio::time::sleep(every) => {}
        }
        match ledger.reap(retention).await {
            Ok(stats) => info!(inbox = stats.inbox, results = stats.results, "reaped"),
            // The next round tries again; nothing depends on a round succeeding.
            Err(e) => tracing::warn!(error = %e, "reaping failed"),
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| "opgate".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use opgate_core::{Delivery, IngestItem, Limits, Proposal, Registry, Source};

    #[tokio::test]
    async fn the_reaper_deletes_published_results_and_keeps_operations() {
        let path = std::env::temp_dir().join(format!("opgate-reaper-{}.db", uuid::Uuid::now_v7()));
        let url = format!("sqlite://{}", path.display());
        opgate_store::migrate(&url).await.expect("migrate");
        let ledger = opgate_store::open(&url).await.expect("open");
        let registry = Registry::from_toml(
            "[[tools]]\nname = \"note\"\nside_effect_class = \"internal_write\"",
        )
        .expect("registry");
        let proposal = Proposal::from_value(
            serde_json::json!({"event_id": "e1", "tool": "note",
                "entity": {"type": "t", "id": "1"}, "args": {}}),
            &Limits::default(),
        )
        .expect("proposal");
        let item = IngestItem::from_proposal(
            &registry,
            &proposal,
            Delivery {
                principal: None,
                source: Source::Http,
                traceparent: None,
            },
        );
        ledger.ingest(&[item]).await.expect("ingest");
        let rows = ledger
            .claim_results(&opgate_store::ClaimRequest {
                owner: "relay".into(),
                lease: Duration::from_secs(60),
                limit: 10,
                ..Default::default()
            })
            .await
            .expect("claim results");
        ledger
            .mark_published(&rows.iter().map(|r| r.id).collect::<Vec<_>>())
            .await
            .expect("mark");
        let cancel = CancellationToken::new();
        let task = tokio::spawn(reaper(
            ledger.clone(),
            Duration::ZERO,
            Duration::from_millis(20),
            cancel.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(300)).await;
        cancel.cancel();
        task.await.expect("join").expect("reaper");
        // Reaped already: a second pass finds nothing left, and the operation stays.
        let again = ledger.reap(Duration::ZERO).await.expect("reap");
        assert_eq!((again.inbox, again.results), (0, 0), "{again:?}");
        assert_eq!(
            ledger
                .list(&opgate_store::ListFilter::default())
                .await
                .expect("list")
                .operations
                .len(),
            1
        );
        let _ = std::fs::remove_file(&path);
    }
}
