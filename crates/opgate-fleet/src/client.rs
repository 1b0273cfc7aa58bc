//! Kafka client helpers for the benchmarks: publish records, then wait until every
//! operation's final result is on `opgate.results`.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, bail};
use opgate_kafka::KafkaConfig;
use opgate_kafka::config::{PROPOSALS, RESULTS};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{Offset, TopicPartitionList};

/// Publishes (key, value) records to the proposals topic and waits for every ack.
pub async fn publish(config: &KafkaConfig, records: &[(String, Vec<u8>)]) -> anyhow::Result<()> {
    publish_paced(config, records, None).await.map(drop)
}

/// Publishes (key, value) records to the proposals topic at `rate` records per second
/// (catching up when behind), then waits for every ack; returns when each record was
/// handed to the producer (the wall clock, as an agent's send would be).
pub async fn publish_at_rate(
    config: &KafkaConfig,
    records: &[(String, Vec<u8>)],
    rate: f64,
) -> anyhow::Result<Vec<SystemTime>> {
    publish_paced(config, records, Some(rate)).await
}

/// Publishes every record (the `i`-th no sooner than `i / rate` seconds after the first,
/// when a rate is given), then waits for every ack; returns each record's send time.
async fn publish_paced(
    config: &KafkaConfig,
    records: &[(String, Vec<u8>)],
    rate: Option<f64>,
) -> anyhow::Result<Vec<SystemTime>> {
    let producer: FutureProducer = config.client_config()?.create()?;
    let topic = config.topic(PROPOSALS);
    if rate.is_some() {
        // Connect and learn the partitions' leaders before the clock starts: records sent
        // before that wait in the client and leave as one burst when it connects (seen:
        // the first 64 records of a 1,000 records/s run reaching ingest at once), which
        // is not the offered rate.
        let (producer, topic) = (producer.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), Duration::from_secs(30))
        })
        .await?
        .context("the proposals topic's metadata")?;
    }
    let started = tokio::time::Instant::now();
    let mut pending = Vec::with_capacity(records.len());
    let mut sent = Vec::with_capacity(records.len());
    for (i, (key, value)) in records.iter().enumerate() {
        if let Some(rate) = rate {
            let due = Duration::from_secs_f64(i as f64 / rate.max(1e-9));
            tokio::time::sleep_until(started + due).await;
        }
        sent.push(SystemTime::now());
        pending.push(
            producer
                .send_result(FutureRecord::to(&topic).key(key).payload(value))
                .map_err(|(e, _)| e)?,
        );
    }
    for p in pending {
        p.await.context("producer dropped")?.map_err(|(e, _)| e)?;
    }
    Ok(sent)
}

/// Reads `opgate.results` from the beginning (blocking; run it on a blocking thread)
/// until `expected` distinct operations of `namespace` have a final result; returns when
/// the first and the last of those arrived.
pub fn wait_for_final_results(
    config: &KafkaConfig,
    namespace: &str,
    expected: usize,
    timeout: Duration,
) -> anyhow::Result<(Instant, Instant)> {
    let results = config.topic(RESULTS);
    let mut client = config.client_config()?;
    client
        .set(
            "group.id",
            format!("bench-reader-{:x}", rand::random::<u64>()),
        )
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = client.create()?;
    let metadata = consumer.fetch_metadata(Some(&results), Duration::from_secs(10))?;
    let partitions = metadata.topics()[0].partitions().len() as i32;
    let mut list = TopicPartitionList::new();
    for p in 0..partitions {
        list.add_partition_offset(&results, p, Offset::Beginning)?;
    }
    consumer.assign(&list)?;
    let mut settled = HashSet::new();
    let mut first = None;
    let deadline = Instant::now() + timeout;
    while settled.len() < expected {
        if Instant::now() > deadline {
            bail!(
                "only {} of {expected} operations settled in {} s",
                settled.len(),
                timeout.as_secs()
            );
        }
        let Some(m) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = m?;
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap_or_default())?;
        let terminal = matches!(
            v["status"].as_str(),
            Some("completed_success" | "completed_noop" | "failed_permanent" | "needs_attention")
        );
        let mine = v["namespace"].as_str() == Some(namespace);
        if let (true, true, Some(id)) = (terminal, mine, v["operation_id"].as_str()) {
            first.get_or_insert_with(Instant::now);
            settled.insert(id.to_owned());
        }
    }
    Ok((first.unwrap_or_else(Instant::now), Instant::now()))
}
