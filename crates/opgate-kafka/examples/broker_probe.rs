//! A minimal check of a Kafka-protocol broker's consumer-group behaviour, independent
//! of opgate's code paths: produce 400 records over 4 partitions; a first group member
//! reads some, commits and leaves; a second member of the same group must read the
//! rest; a fresh group must read all 400.
//!
//! `cargo run -p opgate-kafka --example broker_probe -- 127.0.0.1:9092`

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use opgate_kafka::KafkaConfig;
use opgate_kafka::topics::{TopicSpec, ensure_topics};
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

fn consumer(brokers: &str, group: &str) -> BaseConsumer {
    rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "session.timeout.ms",
            std::env::var("SESSION_MS").unwrap_or_else(|_| "45000".into()),
        )
        .set(
            "heartbeat.interval.ms",
            std::env::var("HEARTBEAT_MS").unwrap_or_else(|_| "3000".into()),
        )
        .create()
        .expect("consumer")
}

fn read(
    c: &BaseConsumer,
    topic: &str,
    stop_after: usize,
    window: Duration,
) -> BTreeMap<i32, usize> {
    c.subscribe(&[topic]).expect("subscribe");
    let started = Instant::now();
    let mut counts = BTreeMap::new();
    let mut total = 0;
    while started.elapsed() < window && total < stop_after {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(100)) {
            *counts.entry(m.partition()).or_insert(0) += 1;
            total += 1;
            c.store_offset_from_message(&m).expect("store");
        }
    }
    counts
}

#[tokio::main]
async fn main() {
    let brokers = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9092".into());
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    let first_reads: usize = std::env::args()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let topic = format!("probe{}", std::process::id());
    let mut config = KafkaConfig::new(brokers.clone());
    config.replication_factor = Some(1);
    let spec = TopicSpec {
        name: topic.clone(),
        partitions: 4,
        replication_factor: 1,
        config: Default::default(),
    };
    println!(
        "create: {:?}",
        ensure_topics(&config, &[spec]).await.expect("create")
    );
    let producer: FutureProducer = config
        .client_config()
        .expect("config")
        .set("linger.ms", "20")
        .create()
        .expect("producer");
    // Produce in a burst, so the producer sends multi-record batches (as any busy
    // producer does); `sequential` sends one record per request instead.
    let sequential = std::env::args().any(|a| a == "sequential");
    let mut pending = Vec::new();
    for i in 0..n {
        let key = format!("k{i}");
        let record = FutureRecord::to(&topic).key(&key).payload("v");
        if sequential {
            producer
                .send(record, Duration::from_secs(10))
                .await
                .expect("produce");
        } else {
            pending.push(
                producer
                    .send_result(record)
                    .map_err(|(e, _)| e)
                    .expect("enqueue"),
            );
        }
    }
    for p in pending {
        p.await.expect("delivered").expect("acknowledged");
    }
    let probe = consumer(&brokers, "watermarks");
    for p in 0..4 {
        let w = probe.fetch_watermarks(&topic, p, Duration::from_secs(5));
        println!("partition {p} watermarks (low, high): {w:?}");
    }
    let group = format!("g{}", std::process::id());
    let first = consumer(&brokers, &group);
    let a = read(&first, &topic, first_reads, Duration::from_secs(20));
    if std::env::args().nth(4).as_deref() != Some("no-commit") {
        first
            .commit_consumer_state(CommitMode::Sync)
            .expect("commit");
    }
    drop(first);
    let second = consumer(&brokers, &group);
    let b = read(&second, &topic, n, Duration::from_secs(20));
    drop(second);
    // The same with a StreamConsumer (what opgate's worker uses), as a third member.
    let stream: rdkafka::consumer::StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "session.timeout.ms",
            std::env::var("SESSION_MS").unwrap_or_else(|_| "45000".into()),
        )
        .set(
            "heartbeat.interval.ms",
            std::env::var("HEARTBEAT_MS").unwrap_or_else(|_| "3000".into()),
        )
        .create()
        .expect("stream consumer");
    stream.subscribe(&[&topic]).expect("subscribe");
    let mut d: BTreeMap<i32, usize> = BTreeMap::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(20) {
        match tokio::time::timeout(Duration::from_millis(500), stream.recv()).await {
            Ok(Ok(m)) => *d.entry(m.partition()).or_insert(0) += 1,
            Ok(Err(e)) => println!("stream error: {e}"),
            Err(_) => {}
        }
    }
    println!(
        "stream member (same group, nothing committed by the second): {d:?} = {}",
        d.values().sum::<usize>()
    );
    drop(stream);
    // Two live members of one group; one leaves mid-stream; the other must get the rest.
    let topic2 = format!("{topic}-rebalance");
    let spec2 = TopicSpec {
        name: topic2.clone(),
        partitions: 4,
        replication_factor: 1,
        config: Default::default(),
    };
    ensure_topics(&config, &[spec2]).await.expect("create");
    for i in 0..n {
        let key = format!("k{i}");
        producer
            .send(
                FutureRecord::to(&topic2).key(&key).payload("v"),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }
    let group2 = format!("{group}-rebalance");
    let (b2, t2) = (brokers.clone(), topic2.clone());
    let (g2a, g2b) = (group2.clone(), group2.clone());
    let leaver = std::thread::spawn(move || {
        let c = consumer(&b2, &g2a);
        let counts = read(&c, &t2, first_reads, Duration::from_secs(20));
        c.commit_consumer_state(CommitMode::Sync).ok();
        counts
    });
    let (b3, t3) = (brokers.clone(), topic2.clone());
    let stayer = std::thread::spawn(move || {
        let c = consumer(&b3, &g2b);
        read(&c, &t3, n, Duration::from_secs(40))
    });
    let l = leaver.join().expect("leaver");
    let st = stayer.join().expect("stayer");
    println!(
        "rebalance: leaver {l:?} = {}, stayer {st:?} = {} (together expected >= {n})",
        l.values().sum::<usize>(),
        st.values().sum::<usize>()
    );
    let fresh = consumer(&brokers, &format!("fresh{}", std::process::id()));
    let c = read(&fresh, &topic, n, Duration::from_secs(20));
    let sum = |m: &BTreeMap<i32, usize>| m.values().sum::<usize>();
    println!(
        "first member  (stops after {first_reads}): {a:?} = {}",
        sum(&a)
    );
    println!(
        "second member (same group): {b:?} = {} (expected {})",
        sum(&b),
        n - sum(&a)
    );
    println!(
        "fresh group:                {c:?} = {} (expected {n})",
        sum(&c)
    );
}
