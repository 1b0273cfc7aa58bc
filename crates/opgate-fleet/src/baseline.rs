//! The naive baseline the eval compares opgate with: what a team ships without an
//! execution layer. An at-least-once Kafka consumer reads the proposals and calls the
//! provider directly — with the model's `event_id` as the idempotency key (the best a
//! consumer without a ledger can do), retrying on a timeout, a 5xx or a 429, and no
//! record of what it did. It runs as many calls at once as opgate's dispatcher.
//!
//! Its failure modes are the ones the seeds describe: a redelivery of a payment is
//! absorbed by the provider's key, but a re-spelled or re-planned duplicate (a new event
//! id) charges again, every retry of an email after a timeout-after-commit sends another
//! email, and a call that times out on every try is an answer nobody gets.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use opgate_sim::KeyedBy;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::Message as _;
use serde_json::Value;
use tokio::sync::Semaphore;

/// How the baseline calls a provider.
#[derive(Debug, Clone)]
pub struct BaselineConfig {
    /// Base URL of the simulated providers.
    pub providers: String,
    /// Calls in flight.
    pub concurrency: usize,
    /// Per-call timeout.
    pub timeout: Duration,
    /// Tries per record (the first call and its retries).
    pub tries: u32,
}

/// What the baseline did.
#[derive(Debug, Default)]
pub struct BaselineRun {
    /// Event ids that got an answer from the provider (2xx or 4xx) at least once.
    pub answered: HashSet<String>,
    /// Event ids processed at least once.
    pub processed: HashSet<String>,
    /// Records that were not proposals it could call a provider for.
    pub skipped: u64,
    /// Calls made (with retries).
    pub calls: u64,
    /// Calls that timed out or answered 5xx: outcomes it could not know.
    pub ambiguous: u64,
    /// From its first record to its last finished call.
    pub elapsed: Duration,
}

/// The provider of each dev-registry tool.
fn provider_of(tool: &str) -> Option<&'static str> {
    Some(match tool {
        "capture_payment" => "payments",
        "refund_payment" | "issue_refund" => "refunds",
        "send_email" => "emails",
        "place_order" => "orders",
        "create_ticket" => "tickets",
        "credit_account" => "credits",
        _ => return None,
    })
}

/// Consumes `records` records from `topic` (from the beginning) and calls the providers;
/// `ready` fires once the first record arrived.
pub async fn run(
    mut client: ClientConfig,
    topic: String,
    records: usize,
    ready: tokio::sync::oneshot::Sender<()>,
    config: BaselineConfig,
) -> anyhow::Result<BaselineRun> {
    let consumer: StreamConsumer = client
        .set(
            "group.id",
            format!("opgate-baseline-{}", uuid::Uuid::now_v7()),
        )
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .create()
        .context("creating the baseline's consumer")?;
    consumer.subscribe(&[topic.as_str()])?;
    let http = reqwest::Client::builder().timeout(config.timeout).build()?;
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let run = Arc::new(Mutex::new(BaselineRun::default()));
    let config = Arc::new(config);
    let mut tasks = tokio::task::JoinSet::new();
    let mut started: Option<Instant> = None;
    let mut ready = Some(ready);
    for _ in 0..records {
        let message = consumer.recv().await.context("the baseline's consumer")?;
        started.get_or_insert_with(Instant::now);
        if let Some(ready) = ready.take() {
            let _ = ready.send(());
        }
        let call = message
            .payload()
            .and_then(|p| serde_json::from_slice::<Value>(p).ok())
            .and_then(Call::from_proposal);
        let Some(call) = call else {
            lock(&run).skipped += 1;
            continue;
        };
        let permit = permits.clone().acquire_owned().await?;
        let (http, config, run) = (http.clone(), config.clone(), run.clone());
        tasks.spawn(async move {
            call.execute(&http, &config, &run).await;
            drop(permit);
        });
        // Reap finished tasks as we go so the set stays small.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let elapsed = started.map(|s| s.elapsed()).unwrap_or_default();
    let mut run = std::mem::take(&mut *lock(&run));
    run.elapsed = elapsed;
    Ok(run)
}

fn lock(run: &Mutex<BaselineRun>) -> std::sync::MutexGuard<'_, BaselineRun> {
    run.lock().unwrap_or_else(|e| e.into_inner())
}

/// One provider call, as the naive consumer makes it.
struct Call {
    event_id: String,
    provider: &'static str,
    keyed_by: KeyedBy,
    entity: String,
    body: Value,
}

impl Call {
    fn from_proposal(p: Value) -> Option<Self> {
        let event_id = p.get("event_id")?.as_str()?.to_owned();
        let provider = provider_of(p.get("tool")?.as_str()?)?;
        let (_, keyed_by) = opgate_sim::ROUTES
            .iter()
            .find(|(name, _)| *name == provider)?;
        let entity = format!(
            "{}:{}",
            p.pointer("/entity/type")?.as_str()?,
            p.pointer("/entity/id")?.as_str()?
        );
        let mut body = p.get("args").cloned().unwrap_or(Value::Null);
        if let (KeyedBy::Body(field), Value::Object(map)) = (keyed_by, &mut body) {
            map.insert((*field).to_owned(), Value::String(event_id.clone()));
        }
        Some(Self {
            event_id,
            provider,
            keyed_by: *keyed_by,
            entity,
            body,
        })
    }

    async fn execute(
        &self,
        http: &reqwest::Client,
        config: &BaselineConfig,
        run: &Mutex<BaselineRun>,
    ) {
        lock(run).processed.insert(self.event_id.clone());
        for attempt in 0..config.tries {
            let mut request = http
                .post(format!("{}/{}", config.providers, self.provider))
                .header("x-opgate-entity", &self.entity)
                .json(&self.body);
            if self.keyed_by == KeyedBy::Header {
                request = request.header("Idempotency-Key", &self.event_id);
            }
            let response = request.send().await;
            lock(run).calls += 1;
            match response.map(|r| r.status()) {
                Ok(status)
                    if status.is_success()
                        || status.is_client_error() && status.as_u16() != 429 =>
                {
                    lock(run).answered.insert(self.event_id.clone());
                    return;
                }
                Ok(status) if status.is_server_error() => lock(run).ambiguous += 1,
                Ok(_) => {}
                Err(_) => lock(run).ambiguous += 1,
            }
            tokio::time::sleep(Duration::from_millis(100 * (u64::from(attempt) + 1))).await;
        }
    }
}

/// Counts effects per event id from the providers' effect log (the baseline's key is the
/// event id).
pub fn effects_by_event(effects: &opgate_sim::EffectsReport) -> HashMap<String, u64> {
    let mut by_event = HashMap::new();
    for e in &effects.effects {
        *by_event.entry(e.key.clone()).or_default() += e.count;
    }
    by_event
}
