//! The results relay: the ledger's result outbox -> `opgate.results`.
//!
//! It leases a batch of unpublished rows (oldest first), produces them with an
//! idempotent producer (`enable.idempotence=true`, `acks=all`) keyed by entity, waits for
//! the broker's acknowledgements, and marks only the acknowledged rows published. A crash
//! between publish and mark republishes those rows after their lease expires: the copies
//! carry the same (operation_id, status, seq), which is what consumers dedupe on.

use std::time::Duration;

use opgate_store::{ClaimRequest, OutboxRow, SharedLedger};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Result;
use crate::config::{KafkaConfig, RESULTS};

/// An idempotent producer: `enable.idempotence` and `acks=all` are forced; batching and
/// timeouts have defaults that `[kafka.client]` may override.
pub(crate) fn idempotent_producer(config: &KafkaConfig) -> Result<FutureProducer> {
    let mut producer_config = config.client_config()?;
    for (key, default) in [("linger.ms", "5"), ("message.timeout.ms", "30000")] {
        if producer_config.get(key).is_none() {
            producer_config.set(key, default);
        }
    }
    producer_config
        .set("enable.idempotence", "true")
        .set("acks", "all");
    Ok(producer_config.create()?)
}

/// Publishes the result outbox.
pub struct ResultsRelay {
    ledger: SharedLedger,
    producer: FutureProducer,
    topic: String,
    claim: ClaimRequest,
    idle: Duration,
}

impl ResultsRelay {
    /// A relay that leases up to `batch` rows at a time for `lease`.
    pub fn new(
        config: &KafkaConfig,
        ledger: SharedLedger,
        owner: impl Into<String>,
        batch: usize,
        lease: Duration,
    ) -> Result<Self> {
        Ok(Self {
            ledger,
            producer: idempotent_producer(config)?,
            topic: config.topic(RESULTS),
            claim: ClaimRequest {
                owner: owner.into(),
                lease,
                limit: batch.max(1),
                ..Default::default()
            },
            idle: Duration::from_millis(50),
        })
    }

    /// Relays until cancelled.
    pub async fn run(self, cancel: CancellationToken) -> Result<()> {
        info!(topic = %self.topic, "results relay started");
        let mut backoff = crate::stall_backoff();
        while !cancel.is_cancelled() {
            let pause = match self.relay_once().await {
                Ok(0) => self.idle,
                Ok(_) => {
                    backoff = crate::stall_backoff();
                    Duration::ZERO
                }
                Err(e) => {
                    let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "relay round failed");
                    delay
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = cancel.cancelled() => {}
            }
        }
        info!("results relay stopped");
        Ok(())
    }

    /// One round: lease, publish, mark. Returns how many rows were marked published.
    pub async fn relay_once(&self) -> Result<usize> {
        let rows = self.ledger.claim_results(&self.claim).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let acked = self.publish(&rows).await;
        self.ledger.mark_published(&acked).await?;
        opgate_metrics::metrics()
            .results_published
            .inc_by(acked.len() as u64);
        debug!(
            published = acked.len(),
            leased = rows.len(),
            "relayed results"
        );
        Ok(acked.len())
    }

    /// Produces rows and returns the ids the broker acknowledged. Rows that failed stay
    /// unpublished and are retried once their lease expires.
    pub async fn publish(&self, rows: &[OutboxRow]) -> Vec<i64> {
        let mut pending = Vec::with_capacity(rows.len());
        for row in rows {
            let payload = serde_json::to_vec(&row.payload).unwrap_or_default();
            let mut headers = OwnedHeaders::new();
            if let Some(tp) = row.payload.get("traceparent").and_then(|v| v.as_str()) {
                headers = headers.insert(Header {
                    key: crate::ingest::TRACEPARENT,
                    value: Some(tp),
                });
            }
            let record = FutureRecord::to(&self.topic)
                .key(&row.kafka_key)
                .payload(&payload)
                .headers(headers);
            match self.producer.send_result(record) {
                Ok(delivery) => pending.push((row.id, delivery)),
                Err((e, _)) => warn!(error = %e, id = row.id, "result not enqueued"),
            }
        }
        let mut acked = Vec::with_capacity(pending.len());
        for (id, delivery) in pending {
            match delivery.await {
                Ok(Ok(_)) => acked.push(id),
                Ok(Err((e, _))) => warn!(error = %e, id, "result not acknowledged"),
                Err(_) => warn!(id, "result delivery cancelled"),
            }
        }
        acked
    }
}
