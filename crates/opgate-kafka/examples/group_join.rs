//! How long a consumer group on the embedded broker (librdkafka's mock cluster) stops
//! consuming when a second member joins after the first got its partitions, with nothing
//! of opgate in between.
//!
//! Member A subscribes to the proposals topic and polls until it has its partitions;
//! `LATE_MS` later (default 500) member B subscribes. Prints how long B waited for its
//! partitions and how long A held none (the whole group consumes nothing meanwhile).
//! `SESSION_TIMEOUT_MS` sets both members' `session.timeout.ms` (librdkafka's default,
//! 45,000, otherwise; `heartbeat.interval.ms` is a sixth of it).
//!
//! `cargo run --release -p opgate-kafka --example group_join`
//!
//! Measured (BENCHMARKS.md, 2026-12-07 evening): the mock cluster's coordinator ends a
//! rebalance that a member's join started only when its timer fires, one second short of
//! the session timeout, even when every member rejoined at once (Apache Kafka ends it as
//! soon as every known member has rejoined). With the default session timeout that is
//! ~44 s with no partition consumed.

#![allow(missing_docs)]

use std::time::{Duration, Instant};

use opgate_kafka::EmbeddedBroker;
use opgate_kafka::config::PROPOSALS;
use rdkafka::consumer::{BaseConsumer, Consumer};

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn member(kafka: &opgate_kafka::KafkaConfig, group: &str, session_ms: Option<u64>) -> BaseConsumer {
    let mut config = kafka.client_config().expect("client config");
    config
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false");
    if let Some(ms) = session_ms {
        config
            .set("session.timeout.ms", ms.to_string())
            .set("heartbeat.interval.ms", (ms / 6).max(100).to_string());
    }
    config.create().expect("consumer")
}

fn partitions(consumer: &BaseConsumer) -> usize {
    consumer.assignment().map(|a| a.count()).unwrap_or(0)
}

fn main() {
    let late = Duration::from_millis(env("LATE_MS").unwrap_or(500));
    let session_ms: Option<u64> = env("SESSION_TIMEOUT_MS");
    let specs = opgate_kafka::topics::builtin_specs().expect("topic specs");
    let broker = EmbeddedBroker::start(1, "", &specs).expect("embedded broker");
    // The embedded broker's own client settings, without its session timeout: this
    // program measures what a given one does.
    let mut kafka = broker.kafka_config();
    kafka.client.remove("session.timeout.ms");
    kafka.client.remove("heartbeat.interval.ms");
    let topic = kafka.topic(PROPOSALS);
    let group = format!("join-{:08x}", rand::random::<u32>());

    let a = member(&kafka, &group, session_ms);
    a.subscribe(&[&topic]).expect("subscribe");
    let started = Instant::now();
    while partitions(&a) == 0 {
        a.poll(Duration::from_millis(10));
    }
    println!(
        "A has {} partitions after {} ms alone",
        partitions(&a),
        started.elapsed().as_millis()
    );
    let until = Instant::now() + late;
    while Instant::now() < until {
        a.poll(Duration::from_millis(10));
    }

    let b = member(&kafka, &group, session_ms);
    b.subscribe(&[&topic]).expect("subscribe");
    let joined = Instant::now();
    let mut a_lost: Option<Instant> = None;
    let mut a_back: Option<Instant> = None;
    let deadline = joined + Duration::from_secs(120);
    while partitions(&b) == 0 || a_back.is_none() {
        if Instant::now() > deadline {
            eprintln!("no assignment for both members within 120 s");
            std::process::exit(1);
        }
        a.poll(Duration::from_millis(5));
        b.poll(Duration::from_millis(5));
        match (partitions(&a), a_lost) {
            (0, None) => a_lost = Some(Instant::now()),
            (n, Some(lost)) if n > 0 && a_back.is_none() => {
                a_back = Some(Instant::now());
                println!(
                    "A held no partition for {} ms",
                    (Instant::now() - lost).as_millis()
                );
            }
            _ => {}
        }
    }
    println!(
        "B has {} partitions {} ms after it subscribed (session.timeout.ms {}); A has {}",
        partitions(&b),
        joined.elapsed().as_millis(),
        session_ms.map_or("librdkafka's default".to_owned(), |ms| ms.to_string()),
        partitions(&a)
    );
    drop(broker);
}
