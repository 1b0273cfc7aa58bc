//! What an outside client sees of opgate: every answer on `opgate.results` and every
//! record on `opgate.dlq`, read from the beginning by a consumer of its own.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use anyhow::Context as _;
use opgate_core::Status;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Headers as _, Message as _};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// The first answer to a proposal, as read from `opgate.results`.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status of the first result that named this event.
    pub status: String,
    /// `dedupe.reason` when the proposal was merged into an existing operation.
    pub dedupe_reason: Option<String>,
    /// The operation the proposal was answered with (none when refused at ingest).
    pub operation_id: Option<String>,
    /// `error.category` of that first answer.
    pub error_category: Option<String>,
    /// When the reader saw it.
    pub seen_at: Instant,
}

/// An operation's history as results: the latest status, and when the reader first saw
/// it enter `unknown_outcome` and leave it.
#[derive(Debug, Clone)]
pub struct Latest {
    /// Highest `seq` read.
    pub seq: i64,
    /// Its status.
    pub status: String,
}

/// Everything read from the results and DLQ topics.
#[derive(Debug, Default)]
pub struct Observed {
    /// First answer per event id.
    pub answers: HashMap<String, Answer>,
    /// Latest result per operation.
    pub latest: HashMap<String, Latest>,
    /// Result messages read (including republished duplicates).
    pub messages: u64,
    /// DLQ records by reason.
    pub dlq: BTreeMap<String, u64>,
    /// DLQ records by the event id they carried (when readable).
    pub dlq_events: HashMap<String, String>,
    /// When the last result message arrived.
    pub last_result_at: Option<Instant>,
}

impl Observed {
    /// Operations whose latest result is not settled (terminal or waiting for a person).
    pub fn unsettled(&self) -> usize {
        self.latest
            .values()
            .filter(|l| !is_settled(&l.status))
            .count()
    }
}

/// A shared, live view of the answers.
#[derive(Debug, Clone, Default)]
pub struct Observer(Arc<Mutex<Observed>>);

impl Observer {
    /// The view (a poisoned lock still holds every answer read).
    pub fn lock(&self) -> MutexGuard<'_, Observed> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads `results` and `dlq` from the beginning until cancelled.
    pub fn spawn_reader(
        &self,
        mut client: ClientConfig,
        results: &str,
        dlq: &str,
        cancel: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let consumer: StreamConsumer = client
            .set("group.id", format!("opgate-fleet-{}", uuid::Uuid::now_v7()))
            .set("auto.offset.reset", "earliest")
            .set("enable.auto.commit", "false")
            .create()
            .context("creating the fleet's results reader")?;
        consumer.subscribe(&[results, dlq])?;
        let observed = self.0.clone();
        let dlq = dlq.to_owned();
        Ok(tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    () = cancel.cancelled() => return,
                    m = consumer.recv() => m,
                };
                let Ok(message) = message else { continue };
                let mut seen = observed.lock().unwrap_or_else(|e| e.into_inner());
                if message.topic() == dlq {
                    let header = |name: &str| {
                        message.headers().and_then(|h| {
                            h.iter()
                                .find(|h| h.key == name)
                                .and_then(|h| h.value)
                                .map(|v| String::from_utf8_lossy(v).into_owned())
                        })
                    };
                    let reason = header("opgate.dlq.reason").unwrap_or_else(|| "unknown".into());
                    if let Some(event) = header("opgate.dlq.event_id") {
                        seen.dlq_events.insert(event, reason.clone());
                    }
                    *seen.dlq.entry(reason).or_default() += 1;
                    continue;
                }
                let Some(Ok(result)) = message.payload().map(serde_json::from_slice::<Value>)
                else {
                    continue;
                };
                seen.record(&result);
            }
        }))
    }
}

impl Observed {
    fn record(&mut self, result: &Value) {
        self.messages += 1;
        self.last_result_at = Some(Instant::now());
        let text = |p: &str| result.pointer(p).and_then(Value::as_str).map(str::to_owned);
        let status = text("/status").unwrap_or_default();
        let operation_id = text("/operation_id");
        if let Some(event_id) = text("/event_id") {
            self.answers.entry(event_id).or_insert_with(|| Answer {
                status: status.clone(),
                dedupe_reason: text("/dedupe/reason"),
                operation_id: operation_id.clone(),
                error_category: text("/error/category"),
                seen_at: Instant::now(),
            });
        }
        if let Some(op) = operation_id {
            let seq = result.get("seq").and_then(Value::as_i64).unwrap_or(0);
            let latest = self.latest.entry(op).or_insert(Latest {
                seq,
                status: status.clone(),
            });
            if seq >= latest.seq {
                *latest = Latest { seq, status };
            }
        }
    }
}

/// Terminal, or waiting for a person: nothing more happens without someone acting.
pub fn is_settled(status: &str) -> bool {
    Status::parse(status).is_some_and(|s| s.is_terminal() || s == Status::NeedsAttention)
}
