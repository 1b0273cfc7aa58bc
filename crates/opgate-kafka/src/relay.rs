//! The results relay: the ledger's result outbox -> `opgate.results`.
//!
//! Each round (`Ledger::relay_round`) takes a batch of unpublished rows (oldest first) for
//! a lease — a written one, or on PostgreSQL the rows' locks held by the round's
//! transaction — produces them with an idempotent producer (`enable.idempotence=true`,
//! `acks=all`) keyed by entity, waits for the broker's acknowledgements, and marks only
//! the acknowledged rows published. A crash between publish and mark republishes those
//! rows once the lease ends: the copies carry the same (operation_id, status, seq), which
//! is what consumers dedupe on.
//!
//! One operation's results go out in `seq` order, across relays, restarts and failures:
//! the ledger leases a row only with every earlier unpublished row of its operation
//! (`claim_results`), and the relay sends an operation's rows one after the other, each
//! only once the previous one was acknowledged, stopping at the first failure. The lease
//! is longer than the producer's delivery timeout (`message.timeout.ms`), and no row is
//! sent with less than one delivery timeout of lease left, so no row is still in flight
//! when another relay may lease it.

use std::time::Duration;

use std::collections::HashMap;

use opgate_store::{ClaimRequest, OutboxRow, RelayRound, SharedLedger};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::Result;
use crate::config::{KafkaConfig, RESULTS};
use crate::quiet::QuietContext;

/// An idempotent producer: `enable.idempotence` and `acks=all` are forced; batching and
/// timeouts have defaults that `[kafka.client]` may override.
pub(crate) fn idempotent_producer(config: &KafkaConfig) -> Result<FutureProducer<QuietContext>> {
    let mut producer_config = config.client_config()?;
    for (key, default) in [("linger.ms", "5"), ("message.timeout.ms", "30000")] {
        if producer_config.get(key).is_none() {
            producer_config.set(key, default);
        }
    }
    producer_config
        .set("enable.idempotence", "true")
        .set("acks", "all");
    Ok(producer_config.create_with_context(QuietContext)?)
}

/// The producer's delivery timeout (`message.timeout.ms`) as configured.
pub fn delivery_timeout(config: &KafkaConfig) -> Result<Duration> {
    let producer_config = config.client_config()?;
    let ms = producer_config
        .get("message.timeout.ms")
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                crate::Error::Config(format!("message.timeout.ms `{v}` is not a number"))
            })
        })
        .transpose()?
        .unwrap_or(30_000);
    Ok(Duration::from_millis(ms))
}

/// How long a relay that found another relay's turn waits before trying again: how soon
/// it takes over from a relay that stopped (a crashed relay's turn is free at once; a hung
/// one's after its lease).
const STANDBY: Duration = Duration::from_millis(500);

/// Publishes the result outbox.
pub struct ResultsRelay {
    ledger: SharedLedger,
    producer: FutureProducer<QuietContext>,
    topic: String,
    claim: ClaimRequest,
    idle: Duration,
    delivery_timeout: Duration,
}

impl ResultsRelay {
    /// The default lease: twice the delivery timeout.
    pub fn default_lease(config: &KafkaConfig) -> Result<Duration> {
        Ok(delivery_timeout(config)? * 2)
    }

    /// A relay that leases up to `batch` rows at a time for `lease`, which must exceed
    /// the producer's delivery timeout (else a row could still be in flight when its lease
    /// ends and another relay sends it again, out of order).
    pub fn new(
        config: &KafkaConfig,
        ledger: SharedLedger,
        owner: impl Into<String>,
        batch: usize,
        lease: Duration,
    ) -> Result<Self> {
        let delivery_timeout = delivery_timeout(config)?;
        if lease <= delivery_timeout {
            return Err(crate::Error::Config(format!(
                "the relay lease {lease:?} must exceed the producer's delivery timeout (message.timeout.ms = {delivery_timeout:?})"
            )));
        }
        Ok(Self {
            delivery_timeout,
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
        // A commit that wrote results ends an idle pause (not a failure's back-off).
        let mut changes = self.ledger.changes();
        while !cancel.is_cancelled() {
            changes.seen();
            let (pause, wake_on_change) = match self.relay_once().await {
                // Another relay holds the turn and is woken by the commits itself; this
                // one tries again now and then, to take over if that relay stops.
                Ok(round) if round.standby => (STANDBY, false),
                Ok(round) if round.marked == 0 => (self.idle, true),
                Ok(_) => {
                    backoff = crate::stall_backoff();
                    (Duration::ZERO, false)
                }
                Err(e) => {
                    let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                    warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "relay round failed");
                    (delay, false)
                }
            };
            let changed = async {
                if wake_on_change {
                    changes.changed().await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = changed => {}
                () = cancel.cancelled() => {}
            }
        }
        info!("results relay stopped");
        Ok(())
    }

    /// One round: take, publish, mark ([`opgate_store::Ledger::relay_round`]).
    pub async fn relay_once(&self) -> Result<RelayRound> {
        let lease_ends = Instant::now() + self.claim.lease;
        let round = self
            .ledger
            .relay_round(
                &self.claim,
                Box::new(move |rows| Box::pin(async move { self.publish(rows, lease_ends).await })),
            )
            .await?;
        if round.taken > 0 {
            opgate_metrics::metrics()
                .results_published
                .inc_by(round.marked as u64);
            debug!(
                published = round.marked,
                taken = round.taken,
                "relayed results"
            );
        }
        Ok(round)
    }

    /// Produces leased rows (in id order) and returns the ids the broker acknowledged.
    /// An operation's rows are sent one after the other, each once the previous one was
    /// acknowledged; its first failure ends its chain, so a later result never overtakes
    /// an earlier one. No row is sent once less than one delivery timeout is left before
    /// `lease_ends`. Rows not acknowledged stay unpublished for a later round.
    pub async fn publish(&self, rows: Vec<OutboxRow>, lease_ends: Instant) -> Vec<i64> {
        let taken = rows.len();
        let mut chains: Vec<Vec<OutboxRow>> = Vec::new();
        let mut chain_of: HashMap<uuid::Uuid, usize> = HashMap::new();
        for row in rows {
            match row.operation_id {
                Some(op) => {
                    let i = *chain_of.entry(op).or_insert_with(|| {
                        chains.push(Vec::new());
                        chains.len() - 1
                    });
                    chains[i].push(row);
                }
                None => chains.push(vec![row]),
            }
        }
        let mut tasks = JoinSet::new();
        for chain in chains {
            let producer = self.producer.clone();
            let topic = self.topic.clone();
            let timeout = self.delivery_timeout;
            tasks.spawn(async move {
                let mut acked = Vec::with_capacity(chain.len());
                for row in chain {
                    if Instant::now() + timeout >= lease_ends {
                        debug!(id = row.id, "lease too short to send; left for the next round");
                        break;
                    }
                    match send(&producer, &topic, &row).await {
                        Ok(()) => acked.push(row.id),
                        Err(e) => {
                            warn!(error = %e, id = row.id, "result not acknowledged; its operation's later results wait");
                            break;
                        }
                    }
                }
                acked
            });
        }
        let mut acked = Vec::with_capacity(taken);
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok(ids) => acked.extend(ids),
                Err(e) => warn!(error = %e, "a publishing task failed"),
            }
        }
        acked.sort_unstable();
        acked
    }
}

/// Produces one result row and waits for the broker's acknowledgement.
async fn send(producer: &FutureProducer<QuietContext>, topic: &str, row: &OutboxRow) -> Result<()> {
    let mut headers = OwnedHeaders::new();
    if let Some(tp) = &row.traceparent {
        headers = headers.insert(Header {
            key: crate::ingest::TRACEPARENT,
            value: Some(tp),
        });
    }
    let record = FutureRecord::to(topic)
        .key(&row.kafka_key)
        .payload(&row.payload)
        .headers(headers);
    producer
        .send(record, rdkafka::util::Timeout::Never)
        .await
        .map(|_| ())
        .map_err(|(e, _)| crate::Error::Kafka(e))
}
