//! Hostile records on the Kafka path: bytes that a database cannot hold must never wedge
//! a partition, stop the other partitions or vanish without an answer. Plain `cargo test`
//! runs on librdkafka's mock cluster and SQLite; `--features integration` on a real
//! broker and PostgreSQL (where a NUL or a 3 KB index entry used to wedge ingest).

#![allow(missing_docs)]

mod common;

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use common::*;
use opgate_core::{IngestItem, Limits, Operation};
use opgate_kafka::IngestStats;
use opgate_kafka::config::PROPOSALS;
use opgate_store::{IngestOutcome, Ledger, SharedLedger};
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(120);

/// Produces each (partition, value) in order, waiting for every acknowledgement.
async fn produce_to(env: &Env, records: &[(i32, Vec<u8>)]) {
    let producer = producer(env);
    let topic = env.topic(PROPOSALS);
    for (partition, value) in records {
        producer
            .send(
                FutureRecord::to(&topic)
                    .partition(*partition)
                    .key("k")
                    .payload(value),
                Duration::from_secs(30),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("acknowledged");
    }
}

fn good(event_id: &str, order: &str) -> Vec<u8> {
    json!({"event_id": event_id, "namespace": "acme", "tool": "pay",
        "entity": {"type": "order", "id": order}, "args": {"amount": "1", "currency": "usd"}})
    .to_string()
    .into_bytes()
}

/// Three good records for partition `p`, each for an order of its own.
fn three_good(p: i32) -> Vec<(i32, Vec<u8>)> {
    (0..3)
        .map(|i| (p, good(&format!("p{p}-{i}"), &format!("o{p}-{i}"))))
        .collect()
}

/// The group's committed offset of each partition.
fn committed(env: &Env, partitions: i32) -> Vec<i64> {
    let mut config = env.config.client_config().expect("config");
    config.set("group.id", &env.config.group_id);
    let consumer: BaseConsumer = config.create().expect("consumer");
    let topic = env.topic(PROPOSALS);
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition(&topic, p);
    }
    let offsets = consumer
        .committed_offsets(list, Duration::from_secs(10))
        .expect("committed offsets");
    (0..partitions)
        .map(
            |p| match offsets.find_partition(&topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            },
        )
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nul_record_and_a_3kb_id_between_good_records_are_refused_and_every_partition_moves_on() {
    let env = env(3).await;
    // 3,000 characters of random hex: incompressible, past PostgreSQL's btree entry limit.
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let huge: String = (0..3000)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect();
    let nul = br#"{"event_id": "nul-1", "namespace": "acme", "tool": "pay", "entity": {"type": "order", "id": "o\u0000x"}, "args": {"amount": "1", "currency": "usd"}}"#.to_vec();
    let long = json!({"event_id": huge, "namespace": "acme", "tool": "pay",
        "entity": {"type": "order", "id": "o9"}, "args": {"amount": "1", "currency": "usd"}})
    .to_string()
    .into_bytes();
    let records = vec![
        (0, good("p0-a", "a")),
        (0, nul.clone()),
        (0, good("p0-b", "b")),
        (0, long.clone()),
        (0, good("p0-c", "c")),
        (1, good("p1-a", "d")),
        (1, good("p1-b", "e")),
        (2, good("p2-a", "f")),
    ];
    produce_to(&env, &records).await;
    let worker = start_worker(&env, Limits::default(), 100);
    let stats = worker.stats.clone();
    eventually("every record ingested", WAIT, || async {
        IngestStats::get(&stats.records) >= 8
            && IngestStats::get(&stats.accepted) + IngestStats::get(&stats.rejected) >= 8
    })
    .await;
    eventually("offsets committed on every partition", WAIT, || async {
        committed(&env, 3) == vec![5, 2, 1]
    })
    .await;
    worker.stop().await;

    assert_eq!(IngestStats::get(&stats.accepted), 6, "every good record");
    assert_eq!(IngestStats::get(&stats.rejected), 2);
    assert_eq!(IngestStats::get(&stats.dead_lettered), 2);
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE decision = 'accepted'")
            .await,
        6
    );
    assert_eq!(
        env.count("SELECT COUNT(*) FROM result_outbox WHERE status = 'rejected'")
            .await,
        2,
        "both refused records are answered"
    );
    let letters = read_topic(&env, DLQ_TOPIC, 2, WAIT).await;
    assert_eq!(letters.len(), 2);
    for m in &letters {
        let h = headers_of(m);
        assert_eq!(h["opgate.dlq.reason"], "schema_violation");
        assert_eq!(h["opgate.dlq.source.partition"], "0");
        assert!(
            matches!(h["opgate.dlq.field"].as_str(), "entity.id" | "event_id"),
            "{h:?}"
        );
        assert!(m.payload() == Some(&nul[..]) || m.payload() == Some(&long[..]));
    }
    // The refused ids went nowhere near the inbox: the 3 KB one is answered under the
    // record's coordinates.
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE source_id LIKE 'default/kafka:%'")
            .await,
        1
    );
}

/// A fake database error with a SQLSTATE, as the ledger would raise for a value it
/// cannot hold.
#[derive(Debug)]
struct Refused(&'static str);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refused with SQLSTATE {}", self.0)
    }
}

impl std::error::Error for Refused {}

impl sqlx::error::DatabaseError for Refused {
    fn message(&self) -> &str {
        "unsupported Unicode escape sequence"
    }
    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(self.0))
    }
    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }
    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }
    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }
    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

/// A ledger that refuses, like PostgreSQL refuses a NUL, every batch holding a proposal
/// whose `args.note` is `refuse-me` — a value opgate's own checks let through — and,
/// while `stall` is set, times out (a transient error) on every batch holding a proposal
/// for an entity whose id starts with `stuck`; while `lock` is set, a batch holding a
/// proposal for an entity whose id starts with `locked` waits as if for a row lock: a
/// plain ingest until `lock` is cleared, a bounded one for its bound, then fails as
/// PostgreSQL's `lock_timeout` does (SQLSTATE 55P03). It notes the partitions of every
/// ingest call (before its answer) and takes `slow` over each that holds a record of one
/// of the `slow_partitions`.
struct Refusing {
    inner: SharedLedger,
    stall: Arc<std::sync::atomic::AtomicBool>,
    lock: Arc<std::sync::atomic::AtomicBool>,
    slow: Duration,
    slow_partitions: Vec<i32>,
    calls: Arc<std::sync::Mutex<Vec<Vec<i32>>>>,
    /// Ingest calls in the ledger now, and the most there were at once.
    in_ledger: Arc<AtomicUsize>,
    most_in_ledger: Arc<AtomicUsize>,
}

/// One ingest call counted in the ledger until dropped.
struct InLedger(Arc<AtomicUsize>);

impl Drop for InLedger {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Refusing {
    fn new(inner: SharedLedger) -> Self {
        Self {
            inner,
            stall: Arc::default(),
            lock: Arc::default(),
            slow: Duration::ZERO,
            slow_partitions: Vec::new(),
            calls: Arc::default(),
            in_ledger: Arc::default(),
            most_in_ledger: Arc::default(),
        }
    }

    fn enter(&self) -> InLedger {
        let now = self
            .in_ledger
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        self.most_in_ledger
            .fetch_max(now, std::sync::atomic::Ordering::SeqCst);
        InLedger(self.in_ledger.clone())
    }

    /// An ingest call's body (the caller counts it in the ledger).
    async fn ingest_counted(
        &self,
        batch: &[IngestItem],
    ) -> opgate_store::Result<Vec<IngestOutcome>> {
        self.calls.lock().expect("calls").push(partitions_of(batch));
        if partitions_of(batch)
            .iter()
            .any(|p| self.slow_partitions.contains(p))
        {
            tokio::time::sleep(self.slow).await;
        }
        while self.locked(batch) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let poisoned = batch.iter().any(|item| {
            matches!(item, IngestItem::Accepted(env) if env.canonical_args["note"] == "refuse-me")
        });
        if poisoned {
            return Err(opgate_store::Error::Database(sqlx::Error::Database(
                Box::new(Refused("22P05")),
            )));
        }
        let stalled = self.stall.load(std::sync::atomic::Ordering::SeqCst)
            && batch.iter().any(|item| {
                matches!(item, IngestItem::Accepted(env) if env.entity.id.starts_with("stuck"))
            });
        if stalled {
            return Err(opgate_store::Error::Database(sqlx::Error::PoolTimedOut));
        }
        let bug = batch.iter().any(
            |item| matches!(item, IngestItem::Accepted(env) if env.entity.id.starts_with("panic")),
        );
        assert!(!bug, "a bug in the ledger adapter");
        self.inner.ingest(batch).await
    }

    fn locked(&self, batch: &[IngestItem]) -> bool {
        self.lock.load(std::sync::atomic::Ordering::SeqCst)
            && batch.iter().any(|item| {
                matches!(item, IngestItem::Accepted(env) if env.entity.id.starts_with("locked"))
            })
    }
}

/// The partitions an ingest call carried, in order, each once.
fn partitions_of(batch: &[IngestItem]) -> Vec<i32> {
    let mut partitions: Vec<i32> = batch
        .iter()
        .filter_map(|item| {
            let delivery = match item {
                IngestItem::Accepted(env) => &env.delivery,
                IngestItem::Rejected(rejected) => &rejected.delivery,
            };
            match delivery.source {
                opgate_core::Source::Kafka { partition, .. } => Some(partition),
                opgate_core::Source::Http => None,
            }
        })
        .collect();
    partitions.sort_unstable();
    partitions.dedup();
    partitions
}

#[async_trait::async_trait]
impl Ledger for Refusing {
    async fn ingest(&self, batch: &[IngestItem]) -> opgate_store::Result<Vec<IngestOutcome>> {
        let _in_ledger = self.enter();
        self.ingest_counted(batch).await
    }
    async fn ingest_waiting_at_most(
        &self,
        batch: &[IngestItem],
        lock_wait: Duration,
    ) -> opgate_store::Result<Vec<IngestOutcome>> {
        let _in_ledger = self.enter();
        if self.locked(batch) {
            self.calls.lock().expect("calls").push(partitions_of(batch));
            tokio::time::sleep(lock_wait).await;
            return Err(opgate_store::Error::Database(sqlx::Error::Database(
                Box::new(Refused("55P03")),
            )));
        }
        self.ingest_counted(batch).await
    }
    async fn ingest_and_claim(
        &self,
        batch: &[IngestItem],
        lock_wait: Duration,
        r: &opgate_store::ClaimRequest,
    ) -> opgate_store::Result<(Vec<IngestOutcome>, Vec<opgate_store::Claim>)> {
        // These tests run no dispatcher beside the ingest: nothing offers a claim.
        let _ = (batch, lock_wait, r);
        Err(opgate_store::Error::Corrupt(
            "no dispatcher runs beside this ingest".into(),
        ))
    }
    async fn claim(
        &self,
        r: &opgate_store::ClaimRequest,
    ) -> opgate_store::Result<Vec<opgate_store::Claim>> {
        self.inner.claim(r).await
    }
    async fn record(
        &self,
        r: &[opgate_store::Recording],
    ) -> opgate_store::Result<Vec<opgate_store::Result<Operation>>> {
        self.inner.record(r).await
    }
    async fn claim_reconcile(
        &self,
        r: &opgate_store::ClaimRequest,
    ) -> opgate_store::Result<Vec<opgate_store::Claim>> {
        self.inner.claim_reconcile(r).await
    }
    async fn apply(&self, c: &opgate_store::Command) -> opgate_store::Result<Operation> {
        self.inner.apply(c).await
    }
    async fn compensate(
        &self,
        r: &opgate_store::CompensationRequest,
    ) -> opgate_store::Result<(Operation, Operation)> {
        self.inner.compensate(r).await
    }
    async fn claim_results(
        &self,
        r: &opgate_store::ClaimRequest,
    ) -> opgate_store::Result<Vec<opgate_store::OutboxRow>> {
        self.inner.claim_results(r).await
    }
    async fn mark_published(&self, ids: &[i64]) -> opgate_store::Result<()> {
        self.inner.mark_published(ids).await
    }
    async fn operation(&self, id: Uuid) -> opgate_store::Result<Option<Operation>> {
        self.inner.operation(id).await
    }
    async fn operation_by_key(
        &self,
        ns: &str,
        key: &str,
    ) -> opgate_store::Result<Option<Operation>> {
        self.inner.operation_by_key(ns, key).await
    }
    async fn ids_between(&self, lo: Uuid, hi: Uuid, n: i64) -> opgate_store::Result<Vec<Uuid>> {
        self.inner.ids_between(lo, hi, n).await
    }
    async fn results(&self, id: Uuid) -> opgate_store::Result<Vec<opgate_store::ResultRecord>> {
        self.inner.results(id).await
    }
    async fn activity(
        &self,
        since: time::OffsetDateTime,
    ) -> opgate_store::Result<opgate_store::Activity> {
        self.inner.activity(since).await
    }
    async fn events(&self, id: Uuid) -> opgate_store::Result<Vec<opgate_store::OperationEvent>> {
        self.inner.events(id).await
    }
    async fn attempts(&self, id: Uuid) -> opgate_store::Result<Vec<opgate_store::Attempt>> {
        self.inner.attempts(id).await
    }
    async fn list(&self, f: &opgate_store::ListFilter) -> opgate_store::Result<opgate_store::Page> {
        self.inner.list(f).await
    }
    async fn reap(&self, r: Duration) -> opgate_store::Result<opgate_store::ReapStats> {
        self.inner.reap(r).await
    }
    async fn stats(&self) -> opgate_store::Result<opgate_store::LedgerStats> {
        self.inner.stats().await
    }
    async fn schema_status(&self) -> opgate_store::Result<opgate_store::SchemaStatus> {
        self.inner.schema_status().await
    }
    fn changes(&self) -> opgate_store::Changes {
        self.inner.changes()
    }
    fn claimable_changes(&self) -> opgate_store::Changes {
        self.inner.claimable_changes()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_value_the_ledger_refuses_is_isolated_dead_lettered_and_answered() {
    let mut env = env(1).await;
    env.ledger = Arc::new(Refusing::new(env.ledger.clone()));
    let refused = |event_id: &str| {
        json!({"event_id": event_id, "namespace": "acme", "tool": "email",
            "entity": {"type": "user", "id": event_id}, "args": {"to": "a@example.com", "note": "refuse-me"}})
        .to_string()
        .into_bytes()
    };
    let mut records: Vec<(i32, Vec<u8>)> = (0..20)
        .map(|i| (0, good(&format!("g{i}"), &format!("o{i}"))))
        .collect();
    records.insert(3, (0, refused("bad-1")));
    records.insert(15, (0, refused("bad-2")));
    produce_to(&env, &records).await;
    // One batch of all 22 records: the refusal must be bisected out of it.
    let worker = start_worker(&env, Limits::default(), 100);
    let stats = worker.stats.clone();
    eventually("every record answered", WAIT, || async {
        IngestStats::get(&stats.accepted) + IngestStats::get(&stats.rejected) >= 22
    })
    .await;
    eventually("the offset moved past the batch", WAIT, || async {
        committed(&env, 1) == vec![22]
    })
    .await;
    worker.stop().await;
    assert_eq!(IngestStats::get(&stats.accepted), 20);
    assert_eq!(IngestStats::get(&stats.rejected), 2);
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE decision = 'rejected' AND source_id IN ('acme/bad-1', 'acme/bad-2')")
            .await,
        2,
        "answered under their own event ids"
    );
    let letters = read_topic(&env, DLQ_TOPIC, 2, WAIT).await;
    assert_eq!(letters.len(), 2);
    for m in &letters {
        let h = headers_of(m);
        assert_eq!(h["opgate.dlq.reason"], "ledger_refused");
        assert!(matches!(
            h["opgate.dlq.event_id"].as_str(),
            "bad-1" | "bad-2"
        ));
    }
    relay_all(&env).await;
    let results = read_topic(&env, RESULTS_TOPIC, 22, WAIT).await;
    let refusals = results
        .iter()
        .map(json_of)
        .filter(|r| r["status"] == "rejected")
        .collect::<Vec<_>>();
    assert_eq!(refusals.len(), 2);
    for r in refusals {
        assert_eq!(r["error"]["category"], "ledger_refused", "{r}");
    }
}

/// Group commit (ingest/group.rs): batches that wait while the ledger is busy go into
/// one transaction together, and a refusal in such a group stays its partition's. The
/// ledger takes 4 s over partitions 1's and 2's batches, produced one after the other, so
/// they fill both transactions in flight; partitions 3's and 0's batches, produced next,
/// wait together and go into one group. That group is refused (partition 0 holds a value
/// the ledger cannot take): each batch is then ingested alone, partition 0's refused record
/// is split out and dead-lettered, and every other record is accepted and committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_batches_share_a_transaction_and_a_refusal_in_it_stays_its_partitions() {
    let mut env = env(4).await;
    let ledger = Arc::new(Refusing {
        slow: Duration::from_secs(4),
        slow_partitions: vec![1, 2],
        ..Refusing::new(env.ledger.clone())
    });
    let calls = ledger.calls.clone();
    env.ledger = ledger;
    let worker = start_worker(&env, Limits::default(), 100);
    let stats = worker.stats.clone();
    for p in [1, 2] {
        produce_to(&env, &three_good(p)).await;
        eventually("the partition's batch is in the ledger", WAIT, || async {
            calls.lock().expect("calls").concat().contains(&p)
        })
        .await;
    }
    let refused = json!({"event_id": "bad-0", "namespace": "acme", "tool": "email",
        "entity": {"type": "user", "id": "u0"}, "args": {"to": "a@example.com", "note": "refuse-me"}})
    .to_string()
    .into_bytes();
    let mut late = three_good(3);
    late.extend([
        (0, good("p0-0", "o0-0")),
        (0, refused),
        (0, good("p0-2", "o0-2")),
    ]);
    produce_to(&env, &late).await;
    eventually("every record answered", WAIT, || async {
        IngestStats::get(&stats.accepted) + IngestStats::get(&stats.rejected) >= 12
    })
    .await;
    eventually(
        "every partition's offset moved past its batch",
        WAIT,
        || async { committed(&env, 4) == vec![3, 3, 3, 3] },
    )
    .await;
    worker.stop().await;

    let calls = calls.lock().expect("calls").clone();
    assert!(
        calls.iter().any(|c| c.len() >= 2 && c.contains(&0)),
        "partition 0's batch went into a group with another partition's: {calls:?}"
    );
    assert_eq!(IngestStats::get(&stats.accepted), 11, "every good record");
    assert_eq!(IngestStats::get(&stats.rejected), 1);
    assert_eq!(IngestStats::get(&stats.deduplicated_inbox), 0);
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE decision = 'accepted'")
            .await,
        11
    );
    let letters = read_topic(&env, DLQ_TOPIC, 1, WAIT).await;
    assert_eq!(letters.len(), 1);
    let h = headers_of(&letters[0]);
    assert_eq!(h["opgate.dlq.reason"], "ledger_refused");
    assert_eq!(h["opgate.dlq.event_id"], "bad-0");
}

/// While groups commit within the group commit's `SECOND_AFTER` (250 ms), one is in the
/// ledger at a time, and the batches that arrive meanwhile wait and go in together: here
/// partition 0's group takes 150 ms, and 1, 2 and 3, produced while it is in the ledger,
/// follow it instead of joining it. (A slow group does get company: the lock test below.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_group_joins_the_ledger_only_beside_a_slow_one() {
    let mut env = env(4).await;
    let mut refusing = Refusing::new(env.ledger.clone());
    refusing.slow = Duration::from_millis(150);
    refusing.slow_partitions = vec![0];
    let ledger = Arc::new(refusing);
    let (calls, most) = (ledger.calls.clone(), ledger.most_in_ledger.clone());
    env.ledger = ledger;
    let worker = start_worker(&env, Limits::default(), 100);
    produce_to(&env, &three_good(0)).await;
    eventually("partition 0 is in the ledger", WAIT, || async {
        calls.lock().expect("calls").concat().contains(&0)
    })
    .await;
    let mut others = three_good(1);
    others.extend(three_good(2));
    others.extend(three_good(3));
    produce_to(&env, &others).await;
    eventually("every partition committed", WAIT, || async {
        committed(&env, 4) == [3, 3, 3, 3]
    })
    .await;
    worker.stop().await;
    assert_eq!(
        most.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one group in the ledger at a time: {:?}",
        calls.lock().expect("calls")
    );
}

/// A batch waiting for a lock keeps neither its group nor the group commit's places in the
/// ledger (shared by every partition) for longer than the group's lock bound: partitions
/// 0 and 1 wait for a lock that is not released, each in a group of its own, the two
/// groups in flight (1's beside 0's once 0's has waited `SECOND_AFTER`); once the bound
/// runs out they wait alone, and partitions 2 and 3,
/// produced after them, are ingested and committed meanwhile. When the lock goes, 0 and 1
/// catch up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_waiting_for_a_lock_holds_up_only_its_partition() {
    let mut env = env(4).await;
    let ledger = Arc::new(Refusing::new(env.ledger.clone()));
    ledger.lock.store(true, std::sync::atomic::Ordering::SeqCst);
    let (calls, lock) = (ledger.calls.clone(), ledger.lock.clone());
    env.ledger = ledger;
    // Each in a group of its own: 0's is in the ledger before 1's is produced.
    let worker = start_worker(&env, Limits::default(), 100);
    let stats = worker.stats.clone();
    for p in 0..2 {
        produce_to(&env, &[(p, good(&format!("l{p}"), &format!("locked-{p}")))]).await;
        eventually("the partition waits for the lock", WAIT, || async {
            calls.lock().expect("calls").concat().contains(&p)
        })
        .await;
    }
    let mut others = three_good(2);
    others.extend(three_good(3));
    produce_to(&env, &others).await;
    eventually(
        "partitions 2 and 3 committed while 0 and 1 wait",
        WAIT,
        || async { committed(&env, 4)[2..] == [3, 3] },
    )
    .await;
    assert_eq!(IngestStats::get(&stats.accepted), 6);
    assert!(
        committed(&env, 4)[..2].iter().all(|&at| at < 1),
        "0 and 1 wait"
    );
    lock.store(false, std::sync::atomic::Ordering::SeqCst);
    eventually("partitions 0 and 1 catch up", WAIT, || async {
        committed(&env, 4) == vec![1, 1, 3, 3]
    })
    .await;
    worker.stop().await;
    assert_eq!(IngestStats::get(&stats.accepted), 8);
    assert_eq!(IngestStats::get(&stats.deduplicated_inbox), 0);
}

/// Each partition is its own pipeline: while partition 0 cannot store its batch (the
/// ledger keeps timing out on it), partitions 1 and 2 are ingested and their offsets
/// committed; the stall is reported for `/readyz`; once the ledger answers, partition 0
/// catches up with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_partition_does_not_stop_the_others() {
    let mut env = env(3).await;
    let stall = Arc::new(std::sync::atomic::AtomicBool::new(true));
    env.ledger = Arc::new(Refusing {
        stall: stall.clone(),
        ..Refusing::new(env.ledger.clone())
    });
    let mut records = vec![(0, good("s0", "stuck-0")), (0, good("s1", "stuck-1"))];
    records.extend((0..5).map(|i| (1, good(&format!("a{i}"), &format!("a{i}")))));
    records.extend((0..5).map(|i| (2, good(&format!("b{i}"), &format!("b{i}")))));
    produce_to(&env, &records).await;
    let mut config = env.config.clone();
    config.batch.max_messages = 100;
    let worker = opgate_kafka::IngestWorker::new(
        &config,
        env.ledger.clone(),
        env.registry.clone(),
        Limits::default(),
    )
    .expect("worker");
    let stats = worker.stats();
    let health = worker.health();
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(worker.run(cancel.clone()));
    eventually(
        "partitions 1 and 2 committed while 0 is stuck",
        WAIT,
        || async { committed(&env, 3)[1..] == [5, 5] },
    )
    .await;
    assert_eq!(IngestStats::get(&stats.accepted), 10);
    assert!(committed(&env, 3)[0] < 2, "partition 0 has not moved");
    // Partition 0's lane reports the stall once its first store has failed, which on a
    // busy machine can come after the other partitions' commits.
    eventually("the stall is reported", WAIT, || async {
        health.longest_stall().is_some()
    })
    .await;
    let (partition, _) = health.longest_stall().expect("the stall is reported");
    assert_eq!(partition, 0);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(
        health.check(Duration::from_secs(1)).is_err(),
        "unready past the threshold"
    );
    assert!(health.check(Duration::from_secs(600)).is_ok());
    stall.store(false, std::sync::atomic::Ordering::SeqCst);
    eventually("partition 0 catches up", WAIT, || async {
        committed(&env, 3) == vec![2, 5, 5]
    })
    .await;
    assert_eq!(IngestStats::get(&stats.accepted), 12);
    assert!(health.longest_stall().is_none());
    cancel.cancel();
    running.await.expect("join").expect("worker ok");
}

/// Issue 9, item 10: a partition task that panics stops the member; nothing commits past
/// the batch it never stored (before, the panic was only logged and later batches
/// committed offsets past it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_partition_stops_the_member_without_committing_past_it() {
    let mut env = env(1).await;
    env.ledger = Arc::new(Refusing::new(env.ledger.clone()));
    let records = vec![
        (0, good("g1", "o1")),
        (0, good("p1", "panic-1")),
        (0, good("g2", "o2")),
    ];
    produce_to(&env, &records).await;
    let worker = start_worker(&env, Limits::default(), 100);
    let ended = tokio::time::timeout(WAIT, worker.handle)
        .await
        .expect("the member stops")
        .expect("join");
    assert!(
        matches!(ended, Err(opgate_kafka::Error::PartitionTask(_))),
        "{ended:?}"
    );
    let at = committed(&env, 1)[0];
    assert!(at <= 1, "committed {at}: past the batch that panicked");
    // The next member re-reads it (and, with the bug fixed, stores it).
    env.ledger = env.db.ledger.clone();
    let next = start_worker(&env, Limits::default(), 100);
    let stats = next.stats.clone();
    eventually("the next member stores all three", WAIT, || async {
        IngestStats::get(&stats.accepted) + IngestStats::get(&stats.deduplicated_inbox) >= 3
    })
    .await;
    next.stop().await;
    assert_eq!(committed(&env, 1), vec![3]);
}
