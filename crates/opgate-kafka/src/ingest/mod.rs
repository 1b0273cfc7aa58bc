//! The ingest worker: `opgate.proposals` -> the ledger, exactly once per event id.
//!
//! One consumer loop per worker reads records and hands each to its partition's lane
//! ([`lane`]): every partition batches, dead-letters its poison records (acknowledged by
//! the broker first), ingests its batch and only then stores and commits its offset — on
//! its own, so one partition waiting for the ledger or the DLQ never stops another. A
//! batch's first try shares a ledger transaction with the other partitions' batches
//! waiting at the same time ([`group`]); if that group fails, each batch goes alone. Until a batch is stored it is retried in place: the partition
//! never moves past a record that is not stored. A batch the ledger refuses for good is
//! split until the refused records are alone; those are dead-lettered and answered.
//!
//! Rebalances: the revoke callback commits what the lanes stored; the loop then stops the
//! revoked partitions' lanes, abandoning a batch in flight without storing its offset —
//! the new owner re-reads it and it dedupes in the inbox. A lane that panics stops the
//! member (nothing commits past a batch it never stored).

mod group;
mod lane;
mod signature;

pub use signature::{SIGNATURE_HEADER, Signers, sign};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opgate_core::{
    Delivery, IngestItem, Limits, Proposal, Registry, RejectedProposal, Rejection, Source,
};
use opgate_store::{IngestDecision, IngestOutcome, SharedLedger};
use rdkafka::ClientContext;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{DLQ, KafkaConfig, PROPOSALS};
use crate::{Error, Result};

/// Header carrying the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
/// Header carrying the agent identity set by the transport (e.g. a gateway); it wins
/// over a missing `agent_id` and must agree with a present one.
pub const AGENT_HEADER: &str = "opgate-agent-id";

/// Counters of what a worker did (for tests, the demo and benchmarks).
#[derive(Debug, Default)]
pub struct IngestStats {
    /// Records read.
    pub records: AtomicU64,
    /// New operations.
    pub accepted: AtomicU64,
    /// Redeliveries (same event id).
    pub deduplicated_inbox: AtomicU64,
    /// Duplicates by key.
    pub deduplicated_key: AtomicU64,
    /// Refused proposals (including dead letters).
    pub rejected: AtomicU64,
    /// Records written to the DLQ.
    pub dead_lettered: AtomicU64,
    /// Ledger transactions committed.
    pub batches: AtomicU64,
}

impl IngestStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// A counter's value.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The consumer context: commits stored offsets before partitions are revoked, and tells
/// the consumer loop which partitions it lost.
#[derive(Default)]
pub struct IngestContext {
    revoked: Mutex<Vec<i32>>,
}

impl IngestContext {
    fn take_revoked(&self) -> Vec<i32> {
        std::mem::take(&mut *self.revoked.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl ClientContext for IngestContext {
    /// librdkafka's errors (the broker unreachable, ...), logged once, then summarized.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        crate::quiet::report("kafka consumer error", &error, reason);
    }

    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::quiet::log(level, fac, message);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer lag of
    /// each assigned partition becomes `opgate_consumer_lag`.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let lag = &opgate_metrics::metrics().consumer_lag;
        // Each report covers every assigned partition: start from nothing, so partitions
        // this member no longer owns (after a rebalance) stop being reported.
        lag.reset();
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                // -1 is librdkafka's "not known" (e.g. the partition is not assigned).
                if *partition >= 0 && p.consumer_lag >= 0 {
                    lag.with_label_values(&[topic.as_str(), &partition.to_string()])
                        .set(p.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for IngestContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(partitions) = rebalance {
            debug!(
                count = partitions.count(),
                "partitions revoked; committing stored offsets"
            );
            if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
                // "No offset stored" is the normal answer when nothing is new.
                debug!(error = %e, "commit before revoke");
            }
            let mut revoked = self.revoked.lock().unwrap_or_else(|e| e.into_inner());
            revoked.extend(partitions.elements().iter().map(|e| e.partition()));
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(partitions) = rebalance {
            info!(count = partitions.count(), "partitions assigned");
            // A partition this member paused before it lost it stays paused in
            // librdkafka across a reassignment: a new lane starts unpaused.
            if let Err(e) = consumer.resume(partitions) {
                debug!(error = %e, "resume assigned partitions");
            }
        }
    }
}

/// A record copied out of the consumer, so batches can move between tasks.
#[derive(Debug, Clone)]
struct Record {
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
    key: Option<Vec<u8>>,
    payload: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

impl Record {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| v.as_deref())
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(str::to_owned)
    }
}

/// A record the worker cannot process, bound for the DLQ.
#[derive(Debug, Clone)]
struct DeadLetter {
    reason: &'static str,
    field: Option<String>,
    message: String,
    event_id: Option<String>,
}

struct Shared {
    /// Test crash point: stop dead after this many ledger commits, before storing offsets.
    crash_after_commits: Option<u64>,
    /// Set when the crash point fired.
    crashed: AtomicBool,
    /// Partitions whose batch could not be stored yet, since when.
    health: Arc<IngestHealth>,
    ledger: SharedLedger,
    registry: Arc<Registry>,
    /// Agents whose records must be signed.
    signers: Signers,
    limits: Limits,
    proposals: String,
    dlq_topic: String,
    producer: FutureProducer<crate::quiet::QuietContext>,
    stats: Arc<IngestStats>,
    /// Where the lanes' batches are committed together ([`group`]).
    group: group::Group,
}

/// A consumer-group member ingesting `opgate.proposals`.
pub struct IngestWorker {
    consumer: Arc<StreamConsumer<IngestContext>>,
    shared: Arc<Shared>,
    committer: group::Committer,
    max_messages: usize,
    max_wait: Duration,
}

impl IngestWorker {
    /// Creates a worker (it joins the group when [`Self::run`] starts).
    pub fn new(
        config: &KafkaConfig,
        ledger: SharedLedger,
        registry: Arc<Registry>,
        limits: Limits,
    ) -> Result<Self> {
        let mut consumer_config = config.client_config()?;
        consumer_config
            .set("group.id", &config.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false");
        if consumer_config.get("statistics.interval.ms").is_none() {
            // Feeds opgate_consumer_lag; `[kafka.client]` may set another interval.
            consumer_config.set("statistics.interval.ms", "5000");
        }
        let consumer: StreamConsumer<IngestContext> =
            consumer_config.create_with_context(IngestContext::default())?;
        let signers =
            Signers::from_registry(&registry, |n| std::env::var(n).ok()).map_err(Error::Config)?;
        let max_messages = config.batch.max_messages.max(1);
        let (group, committer) = group::group_commit(max_messages);
        Ok(Self {
            consumer: Arc::new(consumer),
            shared: Arc::new(Shared {
                crash_after_commits: None,
                crashed: AtomicBool::new(false),
                health: Arc::default(),
                ledger,
                registry,
                signers,
                limits,
                proposals: config.topic(PROPOSALS),
                dlq_topic: config.topic(DLQ),
                producer: crate::relay::idempotent_producer(config)?,
                stats: Arc::new(IngestStats::default()),
                group,
            }),
            committer,
            max_messages,
            max_wait: Duration::from_millis(config.batch.max_wait_ms),
        })
    }

    /// Claim at ingest for a dispatcher in this process ([`opgate_store::handoff`]): the
    /// ingest transaction claims the ready operations it creates, as far as the
    /// dispatcher has room to send them at once.
    pub fn with_handoff(mut self, handoff: Arc<dyn opgate_store::Handoff>) -> Self {
        self.committer.handoff = Some(handoff);
        self
    }

    /// A crash point for tests: after `commits` ledger commits the worker stops dead —
    /// no offset stored, no commit, no goodbye to the group — as a killed process would.
    #[doc(hidden)]
    pub fn crash_after_commits(mut self, commits: u64) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.crash_after_commits = Some(commits);
        }
        self
    }

    /// The worker's counters.
    pub fn stats(&self) -> Arc<IngestStats> {
        self.shared.stats.clone()
    }

    /// Which partitions cannot store their batch, for `/readyz`.
    pub fn health(&self) -> Arc<IngestHealth> {
        self.shared.health.clone()
    }

    /// Consumes until `cancel` fires; then commits what is stored and leaves the group.
    /// A batch in flight when `cancel` fires is abandoned without storing its offsets:
    /// it is redelivered and dedupes in the inbox.
    pub async fn run(self, cancel: CancellationToken) -> Result<()> {
        let topic = self.shared.proposals.clone();
        self.consumer.subscribe(&[&topic])?;
        let committer = tokio::spawn(self.committer.run(self.shared.ledger.clone()));
        info!(topic = %topic, "ingest worker started");
        let mut lanes: HashMap<i32, lane::Lane> = HashMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        let outcome = loop {
            tokio::select! {
                m = self.consumer.recv() => match m {
                    Ok(m) => {
                        // A rebalance runs inside recv(): the revoked partitions' lanes stop
                        // before this record is routed, so it never lands in a lane that
                        // is about to be abandoned (its offset would then be skipped).
                        stop_revoked(&self.consumer, &mut lanes);
                        let record = copy(&m);
                        let lane = lanes.entry(record.partition).or_insert_with(|| {
                            lane::Lane::start(
                                self.shared.clone(),
                                self.consumer.clone(),
                                lane::LaneConfig {
                                    partition: record.partition,
                                    max_messages: self.max_messages,
                                    max_wait: self.max_wait,
                                },
                                cancel.child_token(),
                            )
                        });
                        lane.push(record, &self.consumer, &topic);
                    }
                    Err(e) => {
                        crate::quiet::report("consumer error", &e, "");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = tick.tick() => {}
                () = cancel.cancelled() => break Ok(()),
            }
            stop_revoked(&self.consumer, &mut lanes);
            if cancel.is_cancelled() {
                // The lanes see it too and end: that is a stop, not a failure.
                break Ok(());
            }
            if self.shared.crashed.load(Ordering::SeqCst) {
                warn!("crash point reached: stopping without storing offsets");
                for lane in lanes.values() {
                    lane.handle.abort();
                }
                return Err(Error::Crashed);
            }
            let mut failed = None;
            for (partition, lane) in &mut lanes {
                if lane.handle.is_finished() {
                    // A lane ends on its own only when it panicked.
                    failed = Some(*partition);
                } else {
                    lane.unpark(&self.consumer, &topic);
                }
            }
            if let Some(partition) = failed {
                let lane = lanes.remove(&partition);
                let why = match lane {
                    Some(lane) => match lane.handle.await {
                        Err(e) => e.to_string(),
                        Ok(()) => "the lane ended".to_owned(),
                    },
                    None => "the lane ended".to_owned(),
                };
                break Err(Error::PartitionTask(format!(
                    "partition {partition}: {why}"
                )));
            }
        };
        // Stop every lane (a batch in flight is abandoned unstored), then commit what the
        // lanes stored.
        for lane in lanes.values() {
            lane.stop();
        }
        for lane in lanes.into_values() {
            let _ = lane.handle.await;
        }
        committer.abort();
        if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Sync) {
            debug!(error = %e, "final commit");
        }
        match &outcome {
            Ok(()) => info!("ingest worker stopped"),
            Err(e) => warn!(error = %e, "ingest worker stopping"),
        }
        outcome
    }
}

/// Stops the lanes of partitions this member lost.
fn stop_revoked(consumer: &StreamConsumer<IngestContext>, lanes: &mut HashMap<i32, lane::Lane>) {
    for partition in consumer.context().take_revoked() {
        if let Some(lane) = lanes.remove(&partition) {
            lane.stop();
        }
    }
}

/// Which partitions cannot store their batch yet, and since when (for `/readyz`: a
/// partition stuck past a threshold makes the process unready).
#[derive(Debug, Default)]
pub struct IngestHealth {
    stalled: Mutex<HashMap<i32, Instant>>,
}

impl IngestHealth {
    fn stalled(&self, partition: i32) {
        let mut s = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        s.entry(partition).or_insert_with(Instant::now);
    }

    fn stored(&self, partition: i32) {
        let mut s = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        s.remove(&partition);
    }

    /// The partition stalled the longest, and for how long.
    pub fn longest_stall(&self) -> Option<(i32, Duration)> {
        let s = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        s.iter()
            .map(|(p, since)| (*p, since.elapsed()))
            .max_by_key(|(_, d)| *d)
    }

    /// `Ok` unless a partition has been stuck for longer than `threshold`.
    pub fn check(&self, threshold: Duration) -> std::result::Result<(), String> {
        match self.longest_stall() {
            Some((partition, stuck)) if stuck > threshold => Err(format!(
                "partition {partition} has not stored a batch for {}s",
                stuck.as_secs()
            )),
            _ => Ok(()),
        }
    }
}

fn copy(m: &rdkafka::message::BorrowedMessage<'_>) -> Record {
    Record {
        partition: m.partition(),
        offset: m.offset(),
        timestamp_ms: m.timestamp().to_millis(),
        key: m.key().map(<[u8]>::to_vec),
        payload: m.payload().map(<[u8]>::to_vec),
        headers: m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

impl Shared {
    /// Whether the test crash point fired (then the lane stops before storing offsets).
    fn crash_point_reached(&self) -> bool {
        let fired = self
            .crash_after_commits
            .is_some_and(|limit| IngestStats::get(&self.stats.batches) >= limit);
        if fired {
            self.crashed.store(true, Ordering::SeqCst);
        }
        fired
    }

    /// Dead-letters and ingests one partition's batch, retrying in place until it is
    /// stored (true) or the worker is cancelled (false).
    async fn store_partition_batch(
        &self,
        partition: i32,
        records: Vec<Record>,
        cancel: &CancellationToken,
    ) -> bool {
        let mut items = Vec::with_capacity(records.len());
        let mut dead = Vec::new();
        for record in &records {
            let (item, letter) = self.classify(record);
            if let Some(letter) = letter {
                dead.push((record, letter));
            }
            items.push(item);
        }
        let mut delivered = vec![false; dead.len()];
        let mut backoff = crate::stall_backoff();
        // The first try goes with the other partitions' waiting batches; a retry alone.
        let mut group = Some(&self.group);
        loop {
            match self
                .try_store(&records, &mut items, &dead, &mut delivered, group.take())
                .await
            {
                Ok(()) => {
                    self.health.stored(partition);
                    return true;
                }
                Err(e) => {
                    self.health.stalled(partition);
                    let delay = backoff.next().unwrap_or(Duration::from_secs(5));
                    warn!(error = %e, partition, retry_in_ms = delay.as_millis() as u64,
                        "partition batch not stored; the partition waits");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = cancel.cancelled() => return false,
                    }
                }
            }
        }
    }

    async fn try_store(
        &self,
        records: &[Record],
        items: &mut Vec<IngestItem>,
        dead: &[(&Record, DeadLetter)],
        delivered: &mut [bool],
        group: Option<&group::Group>,
    ) -> Result<()> {
        for ((record, letter), done) in dead.iter().zip(delivered.iter_mut()) {
            if !*done {
                self.dead_letter(record, letter).await?;
                *done = true;
                IngestStats::add(&self.stats.dead_lettered, 1);
            }
        }
        let outcomes = self.ingest_isolating(records, items, group).await?;
        for outcome in outcomes {
            let counter = match (&outcome.decision, outcome.inbox_hit) {
                (_, true) => &self.stats.deduplicated_inbox,
                (IngestDecision::Accepted, false) => &self.stats.accepted,
                (IngestDecision::Deduplicated { .. }, false) => &self.stats.deduplicated_key,
                (IngestDecision::Rejected { .. }, false) => &self.stats.rejected,
            };
            IngestStats::add(counter, 1);
            opgate_metrics::metrics().ingested(
                outcome.decision.as_str(),
                outcome.decision.reason(),
                outcome.inbox_hit,
            );
        }
        Ok(())
    }

    /// Ingests a partition batch in one transaction (with `group`, together with other
    /// partitions' batches: [`group`]); if the ledger refuses it for good (a value it
    /// cannot hold: [`opgate_store::Error::is_deterministic`]), splits the batch in halves,
    /// in order, until the refused records are alone, then dead-letters each of them
    /// (reason `ledger_refused`) and answers it `rejected`. Any other error (the ledger or
    /// the DLQ is down) is returned, and the caller retries the batch: the halves already
    /// committed are then inbox hits.
    async fn ingest_isolating(
        &self,
        records: &[Record],
        items: &mut Vec<IngestItem>,
        mut group: Option<&group::Group>,
    ) -> Result<Vec<IngestOutcome>> {
        let mut outcomes = Vec::with_capacity(items.len());
        // Ranges still to store, the next one last.
        let mut pending = Vec::new();
        pending.push(0..items.len());
        while let Some(range) = pending.pop() {
            let started = Instant::now();
            let result = match group.take() {
                // The whole batch, first, in a group.
                Some(group) => {
                    let (back, answer) = group.ingest(std::mem::take(items)).await;
                    *items = back;
                    let Some(outcomes) = answer else {
                        // Its group failed: the batch goes alone.
                        pending.push(range);
                        continue;
                    };
                    Ok(outcomes)
                }
                None => self.ledger.ingest(&items[range.clone()]).await,
            };
            match result {
                Ok(done) => {
                    debug!(
                        proposals = range.len(),
                        ms = started.elapsed().as_secs_f64() * 1000.0,
                        "batch stored"
                    );
                    IngestStats::add(&self.stats.batches, 1);
                    outcomes.extend(done);
                }
                Err(e) if e.is_deterministic() && range.len() > 1 => {
                    let mid = range.start + range.len() / 2;
                    pending.push(mid..range.end);
                    pending.push(range.start..mid);
                }
                Err(e) if e.is_deterministic() => {
                    let i = range.start;
                    let done = self.refused(&records[i], &mut items[i], &e).await?;
                    IngestStats::add(&self.stats.batches, 1);
                    outcomes.push(done);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(outcomes)
    }

    /// A record the ledger cannot hold: dead-lettered with the database's reason, then
    /// recorded as a rejection that carries nothing of the refused content (its event id
    /// when the ledger takes it, else the record's coordinates).
    async fn refused(
        &self,
        record: &Record,
        item: &mut IngestItem,
        error: &opgate_store::Error,
    ) -> Result<IngestOutcome> {
        warn!(partition = record.partition, offset = record.offset, error = %error,
            "the ledger refused a proposal; dead-lettering it");
        let message = "the ledger refused a value of this proposal (see the opgate log for the database's reason); it was not ingested".to_owned();
        let event_id = item.event_id().to_owned();
        self.dead_letter(
            record,
            &DeadLetter {
                reason: "ledger_refused",
                field: None,
                message: message.clone(),
                event_id: Some(event_id.clone()),
            },
        )
        .await?;
        IngestStats::add(&self.stats.dead_lettered, 1);
        let coordinates = self.coordinates(record);
        let namespace = match &*item {
            IngestItem::Accepted(env) => Some(env.key.namespace.clone()),
            IngestItem::Rejected(r) => r.namespace.clone(),
        };
        let delivery = Delivery {
            principal: None,
            source: Source::Kafka {
                topic: self.proposals.clone(),
                partition: record.partition,
                offset: record.offset,
            },
            traceparent: None,
        };
        for event_id in [event_id, coordinates] {
            let rejected = RejectedProposal {
                event_id,
                delivery: delivery.clone(),
                namespace: namespace.clone(),
                workflow_id: None,
                step: None,
                tool: None,
                entity: None,
                rejection: Rejection {
                    reason: "ledger_refused",
                    message: message.clone(),
                },
                content_fingerprint: None,
            };
            *item = IngestItem::Rejected(Box::new(rejected));
            match self.ledger.ingest(std::slice::from_ref(item)).await {
                Ok(mut done) => {
                    if let Some(outcome) = done.pop() {
                        return Ok(outcome);
                    }
                }
                Err(e) if e.is_deterministic() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Store(opgate_store::Error::Corrupt(format!(
            "the ledger refused even the rejection of {}",
            self.coordinates(record)
        ))))
    }

    /// `kafka:{topic}:{partition}:{offset}`: the event id of a record whose own cannot be used.
    fn coordinates(&self, record: &Record) -> String {
        format!(
            "kafka:{}:{}:{}",
            self.proposals, record.partition, record.offset
        )
    }

    /// Decodes and prepares a record: the ingest item, and a dead letter when the record
    /// is poison (not JSON, schema violation, oversize, unknown tool).
    fn classify(&self, record: &Record) -> (IngestItem, Option<DeadLetter>) {
        let delivery = Delivery {
            principal: None,
            source: Source::Kafka {
                topic: self.proposals.clone(),
                partition: record.partition,
                offset: record.offset,
            },
            traceparent: record
                .header(TRACEPARENT)
                .and_then(|tp| opgate_core::input::traceparent(&tp)),
        };
        let bytes = record.payload.as_deref().unwrap_or_default();
        let mut proposal = match Proposal::decode(bytes, &self.limits) {
            Ok(p) => p,
            Err(e) => {
                let event_id = best_effort_event_id(bytes);
                let letter = DeadLetter {
                    reason: e.reason(),
                    field: e.field().map(str::to_owned),
                    message: e.to_string(),
                    event_id: event_id.clone(),
                };
                let rejected = RejectedProposal {
                    event_id: event_id.unwrap_or_else(|| self.coordinates(record)),
                    delivery,
                    namespace: None,
                    workflow_id: None,
                    step: None,
                    tool: None,
                    entity: None,
                    rejection: Rejection {
                        reason: e.reason(),
                        message: e.to_string(),
                    },
                    content_fingerprint: None,
                };
                return (IngestItem::Rejected(Box::new(rejected)), Some(letter));
            }
        };
        if let Some(agent) = record.header(AGENT_HEADER) {
            if let Err(problem) = opgate_core::input::check_id(&agent) {
                let rejection = Rejection {
                    reason: "schema_violation",
                    message: format!("header `{AGENT_HEADER}` {}", problem.message()),
                };
                let rejected = RejectedProposal::of(&proposal, delivery, rejection);
                return (IngestItem::Rejected(Box::new(rejected)), None);
            }
            match &proposal.agent_id {
                None => proposal.agent_id = Some(agent),
                Some(claimed) if *claimed != agent => {
                    let rejection = Rejection {
                        reason: "agent_mismatch",
                        message: format!(
                            "agent_id `{claimed}` does not match the `{AGENT_HEADER}` header `{agent}`"
                        ),
                    };
                    let rejected = RejectedProposal::of(&proposal, delivery, rejection);
                    return (IngestItem::Rejected(Box::new(rejected)), None);
                }
                Some(_) => {}
            }
        }
        let signature = record.header(SIGNATURE_HEADER);
        if let Err(message) =
            self.signers
                .check(proposal.agent_id.as_deref(), bytes, signature.as_deref())
        {
            let letter = DeadLetter {
                reason: "bad_signature",
                field: Some(SIGNATURE_HEADER.into()),
                message: message.clone(),
                event_id: Some(proposal.event_id.clone()),
            };
            let rejection = Rejection {
                reason: "bad_signature",
                message,
            };
            let rejected = RejectedProposal::of(&proposal, delivery, rejection);
            return (IngestItem::Rejected(Box::new(rejected)), Some(letter));
        }
        let item = IngestItem::from_proposal(&self.registry, &proposal, delivery);
        let letter = match &item {
            IngestItem::Rejected(r) if r.rejection.reason == "unknown_tool" => Some(DeadLetter {
                reason: "unknown_tool",
                field: Some("tool".into()),
                message: r.rejection.message.clone(),
                event_id: Some(proposal.event_id.clone()),
            }),
            _ => None,
        };
        (item, letter)
    }

    /// Writes the original record to the DLQ with the reason in headers, and waits for
    /// the broker's acknowledgement.
    async fn dead_letter(&self, record: &Record, letter: &DeadLetter) -> Result<()> {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key,
                value: value.as_deref(),
            });
        }
        let partition = record.partition.to_string();
        let offset = record.offset.to_string();
        let at = opgate_core::canonical::format_utc(time::OffsetDateTime::now_utc());
        let mut add = |key: &str, value: &str| {
            headers = std::mem::replace(&mut headers, OwnedHeaders::new()).insert(Header {
                key,
                value: Some(value),
            });
        };
        add("opgate.dlq.reason", letter.reason);
        add("opgate.dlq.message", &letter.message);
        if let Some(field) = &letter.field {
            add("opgate.dlq.field", field);
        }
        if let Some(event_id) = &letter.event_id {
            add("opgate.dlq.event_id", event_id);
        }
        add("opgate.dlq.source.topic", &self.proposals);
        add("opgate.dlq.source.partition", &partition);
        add("opgate.dlq.source.offset", &offset);
        add("opgate.dlq.at", &at);
        let mut out = FutureRecord::<[u8], [u8]>::to(&self.dlq_topic).headers(headers);
        if let Some(key) = &record.key {
            out = out.key(key.as_slice());
        }
        if let Some(payload) = &record.payload {
            out = out.payload(payload.as_slice());
        }
        if let Some(ts) = record.timestamp_ms {
            out = out.timestamp(ts);
        }
        self.producer
            .send(out, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| Error::Kafka(e))?;
        warn!(reason = letter.reason, partition = record.partition, offset = record.offset,
            message = %letter.message, "proposal dead-lettered");
        opgate_metrics::metrics()
            .dlq
            .with_label_values(&[letter.reason])
            .inc();
        Ok(())
    }
}

/// The `event_id` of a message that is JSON but not a valid proposal, when readable and
/// itself a valid id (a refused id must not reach the inbox).
fn best_effort_event_id(bytes: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    value
        .get("event_id")?
        .as_str()
        .filter(|s| !s.trim().is_empty() && opgate_core::input::check_id(s).is_ok())
        .map(str::to_owned)
}
