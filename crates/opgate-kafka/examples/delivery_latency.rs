//! How long a record takes from the producer's send to a consumer's poll, with nothing
//! of opgate in between: the broker's and the clients' share of a proposal's latency.
//! Produces `RECORDS` records (default 10,000) at `RATE` per second (default 1,430, what
//! `bench e2e --rate 1000` offers) over the proposals topic's partitions, keyed over 1,000
//! entities, and prints p50 / p99 send -> poll.
//!
//! `cargo run --release -p opgate-kafka --example delivery_latency` (the embedded broker,
//! as `bench e2e` runs it), or with a broker address as the argument. `LINGER_MS` sets
//! the producer's `linger.ms` (librdkafka's default otherwise), `FETCH_WAIT_MS` the
//! consumer's `fetch.wait.max.ms` (the embedded broker's client setting otherwise).

#![allow(missing_docs)]

use std::time::{Duration, Instant};

use opgate_kafka::config::PROPOSALS;
use opgate_kafka::{EmbeddedBroker, KafkaConfig};
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::main]
async fn main() {
    let records: usize = env("RECORDS").unwrap_or(10_000);
    let rate: f64 = env("RATE").unwrap_or(1_430.0);
    let specs = opgate_kafka::topics::builtin_specs().expect("topic specs");
    let (mut kafka, _broker) = match std::env::args().nth(1) {
        Some(brokers) => {
            let mut kafka = KafkaConfig::new(brokers);
            kafka.topic_prefix = format!("latency-{:08x}.", rand::random::<u32>());
            kafka.replication_factor = Some(1);
            opgate_kafka::topics::ensure_topics(&kafka, &specs)
                .await
                .expect("topics");
            (kafka, None)
        }
        None => {
            let broker = EmbeddedBroker::start(1, "", &specs).expect("embedded broker");
            (broker.kafka_config(), Some(broker))
        }
    };
    if let Some(ms) = env::<u64>("FETCH_WAIT_MS") {
        kafka
            .client
            .insert("fetch.wait.max.ms".into(), ms.to_string());
    }
    let topic = kafka.topic(PROPOSALS);

    let mut consumer_config = kafka.client_config().expect("client config");
    consumer_config
        .set("group.id", format!("latency-{:08x}", rand::random::<u32>()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = consumer_config.create().expect("consumer");
    consumer.subscribe(&[&topic]).expect("subscribe");
    // Join the group before the clock starts.
    while consumer.assignment().expect("assignment").count() == 0 {
        consumer.poll(Duration::from_millis(100));
    }
    let reader = std::thread::spawn(move || {
        let mut latencies = Vec::with_capacity(records);
        // A broker that loses records must not hang the probe: it says how many came.
        let deadline = Instant::now() + Duration::from_secs_f64(records as f64 / rate + 60.0);
        while latencies.len() < records {
            if Instant::now() > deadline {
                eprintln!("only {} of {records} records arrived", latencies.len());
                std::process::exit(1);
            }
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                let sent: u128 = std::str::from_utf8(m.payload().unwrap_or_default())
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .expect("a send time");
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("clock")
                    .as_micros();
                latencies.push(now.saturating_sub(sent) as f64 / 1000.0);
            }
        }
        latencies
    });

    let mut producer_config = kafka.client_config().expect("client config");
    if let Some(ms) = env::<u64>("LINGER_MS") {
        producer_config.set("linger.ms", ms.to_string());
    }
    let producer: FutureProducer = producer_config.create().expect("producer");
    let started = Instant::now();
    let mut pending = Vec::with_capacity(records);
    for i in 0..records {
        tokio::time::sleep_until((started + Duration::from_secs_f64(i as f64 / rate)).into()).await;
        let sent = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros()
            .to_string();
        let key = format!("order:{}", i % 1000);
        pending.push(
            producer
                .send_result(FutureRecord::to(&topic).key(&key).payload(&sent))
                .map_err(|(e, _)| e)
                .expect("enqueue"),
        );
    }
    for p in pending {
        p.await.expect("delivery").map_err(|(e, _)| e).expect("ack");
    }
    let mut latencies = tokio::task::spawn_blocking(move || reader.join().expect("reader"))
        .await
        .expect("join");
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    println!(
        "{records} records at {rate:.0}/s: send -> poll p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    );
}
