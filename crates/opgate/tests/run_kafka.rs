//! `opgate topics create` and `opgate run` as real processes against PostgreSQL and a
//! real Kafka-protocol broker (`OPGATE_TEST_KAFKA_BROKERS`, e.g. tansu): a proposal
//! published to `opgate.proposals` is dispatched once to the simulated provider, and
//! its answers — accepted, then completed, and a key dedupe for a rephrased copy — are
//! read back from `opgate.results`. SIGTERM ends the process with status 0.

#![cfg(feature = "integration")]
#![allow(missing_docs)]

mod support;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opgate_sim::{Sim, SimConfig};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};
use uuid::Uuid;

const TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = ["trim", "upper"]
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/payments"
timeout_ms = 1000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${OPGATE_SIM_URL}/payments?idempotency_key={key}"
external_id_pointer = "/charge_id"
"#;

fn brokers() -> String {
    std::env::var("OPGATE_TEST_KAFKA_BROKERS").unwrap_or_else(|_| {
        panic!("set OPGATE_TEST_KAFKA_BROKERS (e.g. 127.0.0.1:9092, a tansu or Kafka broker)")
    })
}

/// Every message of a topic from the beginning until `done` says so or the time is up.
fn read_until(
    brokers: &str,
    topic: &str,
    timeout: Duration,
    mut done: impl FnMut(&[Value]) -> bool,
) -> Vec<Value> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("reader-{}", Uuid::now_v7()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("reader");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let mut list = TopicPartitionList::new();
    for p in 0..metadata.topics()[0].partitions().len() as i32 {
        list.add_partition_offset(topic, p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&list).expect("assign");
    let started = Instant::now();
    let mut seen = Vec::new();
    while started.elapsed() < timeout && !done(&seen) {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            seen.push(serde_json::from_slice(m.payload().unwrap_or_default()).expect("JSON"));
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proposal_through_kafka_is_answered_on_the_results_topic() {
    let brokers = brokers();
    let dir = std::env::temp_dir().join(format!("opgate-run-kafka-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = opgate_testkit::database_url(&dir).await;
    opgate_store::migrate(&url).await.expect("migrate");
    let sim = Sim::new(SimConfig::default());
    let (sim_addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("sim");
    let prefix = format!("t{}.", Uuid::now_v7().simple());
    let config = dir.join("opgate.toml");
    // The brokers come from the environment (OPGATE_KAFKA_BROKERS), layered over the file.
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{url}\"\n[kafka]\nbrokers = \"unset:9092\"\ntopic_prefix = \"{prefix}\"\n\
             group_id = \"ingest-{prefix}\"\nreplication_factor = 1\n{TOOLS}"
        ),
    )
    .expect("config");
    let opgate = |args: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_opgate"));
        cmd.args(args)
            .arg("--config")
            .arg(&config)
            .env("OPGATE_KAFKA_BROKERS", &brokers)
            .env("OPGATE_SIM_URL", format!("http://{sim_addr}"))
            .env("RUST_LOG", "warn");
        cmd
    };

    let created = opgate(&["topics", "create"])
        .output()
        .expect("topics create");
    let out = String::from_utf8_lossy(&created.stdout);
    assert!(
        created.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&created.stderr)
    );
    assert!(
        out.contains(&format!("{prefix}opgate.proposals: created")),
        "{out}"
    );

    let log = std::fs::File::create(dir.join("opgate.log")).expect("log");
    let mut child = support::Reaped::spawn(
        opgate(&["run", "--roles", "ingest,relay,dispatch,reconcile"])
            .args(["--set", "worker.lease_ms=5000"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log)),
    );

    // One record per batch: tansu 0.6 counts a multi-record batch as one offset.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("batch.num.messages", "1")
        .create()
        .expect("producer");
    let topic = format!("{prefix}opgate.proposals");
    for (event, amount, currency) in [
        ("evt-1", json!("49.00"), "usd"),
        ("evt-2", json!(49), " USD"),
    ] {
        let payload = json!({"event_id": event, "tool": "capture_payment",
            "entity": {"type": "order", "id": "order_123"},
            "args": {"amount": amount, "currency": currency}})
        .to_string();
        producer
            .send(
                FutureRecord::to(&topic)
                    .key("order:order_123")
                    .payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }

    let results_topic = format!("{prefix}opgate.results");
    let reader_brokers = brokers.clone();
    let results = tokio::task::spawn_blocking(move || {
        read_until(
            &reader_brokers,
            &results_topic,
            Duration::from_secs(90),
            |seen| {
                let completed = seen
                    .iter()
                    .any(|r| r["event_id"] == "evt-1" && r["status"] == "completed_success");
                let deduped = seen.iter().any(|r| r["event_id"] == "evt-2");
                completed && deduped
            },
        )
    })
    .await
    .expect("reader");
    let by_event: BTreeMap<String, Vec<&Value>> =
        results.iter().fold(BTreeMap::new(), |mut m, r| {
            m.entry(r["event_id"].as_str().unwrap_or_default().to_owned())
                .or_default()
                .push(r);
            m
        });
    let first = by_event.get("evt-1").expect("evt-1 answered");
    let statuses: Vec<&str> = first.iter().filter_map(|r| r["status"].as_str()).collect();
    assert_eq!(
        statuses.first().copied(),
        Some("pending_dispatch"),
        "{results:?}"
    );
    assert!(statuses.contains(&"completed_success"), "{results:?}");
    let operation = &first[0]["operation_id"];
    let dedupe = by_event.get("evt-2").expect("evt-2 answered");
    assert_eq!(dedupe[0]["dedupe"]["hit"], true, "{results:?}");
    assert_eq!(dedupe[0]["dedupe"]["reason"], "key", "{results:?}");
    assert_eq!(&dedupe[0]["operation_id"], operation, "{results:?}");
    assert_eq!(sim.effects().total, 1, "one charge");

    let status = support::terminate(&mut child, "opgate run");
    assert!(status.success(), "{status}");
}
