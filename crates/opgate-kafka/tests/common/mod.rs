//! Fixtures for the Kafka-path tests: a broker (librdkafka's mock cluster by default; a
//! real Kafka-protocol broker from `OPGATE_TEST_KAFKA_BROKERS` under the `integration`
//! feature), a ledger (SQLite by default; PostgreSQL under `integration`), producers,
//! a results reader and a polling helper.

#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opgate_core::{Limits, Registry};
use opgate_kafka::config::{DLQ, PROPOSALS, RESULTS};
use opgate_kafka::topics::{TopicSpec, builtin_specs};
use opgate_kafka::{EmbeddedBroker, IngestStats, IngestWorker, KafkaConfig};
use opgate_store::SharedLedger;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub const TOOLS: &str = r#"
[[tools]]
name = "pay"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"

[[tools]]
name = "email"
side_effect_class = "external_non_idempotent"
[tools.args]
to = "email"
"#;

pub struct Env {
    /// The mock cluster, when the test runs on it.
    pub broker: Option<EmbeddedBroker>,
    pub config: KafkaConfig,
    pub ledger: SharedLedger,
    pub registry: Arc<Registry>,
    pub db: opgate_testkit::TestLedger,
}

impl Env {
    pub async fn count(&self, sql: &str) -> i64 {
        self.db.count(sql).await
    }

    pub fn topic(&self, base: &str) -> String {
        self.config.topic(base)
    }

    /// The embedded broker, for fault injection (mock-cluster runs only).
    pub fn mock(&self) -> &EmbeddedBroker {
        self.broker
            .as_ref()
            .expect("this test injects faults with the mock cluster")
    }
}

fn specs(proposal_partitions: i32) -> Vec<TopicSpec> {
    builtin_specs()
        .expect("specs")
        .into_iter()
        .map(|mut s| {
            if s.name == PROPOSALS {
                s.partitions = proposal_partitions;
            }
            s.replication_factor = 1;
            s
        })
        .collect()
}

/// A fresh broker (or fresh topics on the real one) and a fresh ledger.
pub async fn env(proposal_partitions: i32) -> Env {
    // RUST_LOG=opgate_kafka=debug shows what the workers do.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let registry = Arc::new(Registry::from_toml(TOOLS).expect("registry"));
    let db = opgate_testkit::TestLedger::new().await;
    let ledger = db.ledger.clone();
    let prefix = format!("t{}.", Uuid::now_v7().simple());
    let (broker, brokers) = broker(&prefix, proposal_partitions).await;
    let mut config = KafkaConfig::new(brokers);
    config.topic_prefix = prefix;
    config.group_id = format!("opgate-test-{}", Uuid::now_v7().simple());
    config.replication_factor = Some(1);
    Env {
        broker,
        config,
        ledger,
        registry,
        db,
    }
}

#[cfg(not(feature = "integration"))]
async fn broker(prefix: &str, partitions: i32) -> (Option<EmbeddedBroker>, String) {
    let broker = EmbeddedBroker::start(1, prefix, &specs(partitions)).expect("mock cluster");
    let brokers = broker.bootstrap_servers().to_owned();
    (Some(broker), brokers)
}

#[cfg(feature = "integration")]
async fn broker(prefix: &str, partitions: i32) -> (Option<EmbeddedBroker>, String) {
    let brokers = kafka_brokers().await;
    let mut config = KafkaConfig::new(brokers.clone());
    config.topic_prefix = prefix.to_owned();
    config.replication_factor = Some(1);
    let report = opgate_kafka::topics::ensure_topics(&config, &specs(partitions))
        .await
        .expect("create topics on the real broker");
    for (name, status) in report {
        assert_eq!(status, opgate_kafka::topics::TopicStatus::Created, "{name}");
    }
    (None, brokers)
}

/// `OPGATE_TEST_KAFKA_BROKERS`, or an Apache Kafka container when a Docker engine answers;
/// otherwise the test fails naming the variable.
#[cfg(feature = "integration")]
async fn kafka_brokers() -> String {
    use testcontainers_modules::kafka::apache::{KAFKA_PORT, Kafka};
    use testcontainers_modules::testcontainers::ContainerAsync;
    use testcontainers_modules::testcontainers::runners::AsyncRunner;
    use tokio::sync::OnceCell;

    if let Ok(brokers) = std::env::var("OPGATE_TEST_KAFKA_BROKERS") {
        return brokers;
    }
    static CONTAINER: OnceCell<ContainerAsync<Kafka>> = OnceCell::const_new();
    let container = CONTAINER
        .get_or_try_init(|| async { Kafka::default().start().await })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "set OPGATE_TEST_KAFKA_BROKERS (e.g. 127.0.0.1:9092, a tansu or Kafka broker); \
                 no Docker engine answered for testcontainers either: {e}"
            )
        });
    let port = container
        .get_host_port_ipv4(KAFKA_PORT)
        .await
        .expect("port");
    format!("127.0.0.1:{port}")
}

/// A message to produce.
pub struct Out {
    pub key: String,
    pub value: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

pub fn proposal(event_id: &str, order: &str, amount: &str) -> Out {
    let value = json!({"event_id": event_id, "namespace": "acme", "tool": "pay",
        "entity": {"type": "order", "id": order}, "args": {"amount": amount, "currency": "usd"}});
    Out {
        key: format!("order:{order}"),
        value: value.to_string().into_bytes(),
        headers: vec![],
    }
}

pub fn raw(key: &str, value: &[u8]) -> Out {
    Out {
        key: key.to_owned(),
        value: value.to_vec(),
        headers: vec![],
    }
}

pub fn producer(env: &Env) -> FutureProducer {
    let mut config = env.config.client_config().expect("config");
    config
        .set("enable.idempotence", "true")
        .set("linger.ms", "5");
    // tansu 0.6 counts a multi-record batch as one offset in its high watermark, so a
    // consumer resuming from a committed offset inside a batch is served nothing
    // (examples/broker_probe.rs shows it): on the real broker, one record per batch.
    #[cfg(feature = "integration")]
    config.set("batch.num.messages", "1");
    config.create().expect("producer")
}

/// Produces in order (per key) and waits for every acknowledgement.
pub async fn produce(env: &Env, messages: &[Out]) {
    let producer = producer(env);
    let topic = env.topic(PROPOSALS);
    let mut pending = Vec::with_capacity(messages.len());
    for m in messages {
        loop {
            let mut headers = OwnedHeaders::new();
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v),
                });
            }
            let record = FutureRecord::to(&topic)
                .key(&m.key)
                .payload(&m.value)
                .headers(headers);
            match producer.send_result(record) {
                Ok(f) => {
                    pending.push(f);
                    break;
                }
                Err((e, _)) => {
                    assert!(format!("{e}").contains("Queue full"), "produce: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
    for f in pending {
        f.await.expect("not cancelled").expect("acknowledged");
    }
}

pub struct Running {
    pub cancel: CancellationToken,
    pub handle: JoinHandle<opgate_kafka::Result<()>>,
    pub stats: Arc<IngestStats>,
}

impl Running {
    /// Graceful stop: the worker finishes, commits and leaves the group.
    pub async fn stop(self) {
        self.cancel.cancel();
        self.handle.await.expect("join").expect("worker ok");
    }
}

pub fn start_worker(env: &Env, limits: Limits, max_messages: usize) -> Running {
    start_worker_with(env, limits, max_messages, None)
}

/// A worker; `crash_after` makes it die after that many ledger commits.
pub fn start_worker_with(
    env: &Env,
    limits: Limits,
    max_messages: usize,
    crash_after: Option<u64>,
) -> Running {
    let mut config = env.config.clone();
    config.batch.max_messages = max_messages;
    // A killed member is noticed after the session timeout; keep tests quick.
    config
        .client
        .insert("session.timeout.ms".into(), "6000".into());
    config
        .client
        .insert("heartbeat.interval.ms".into(), "500".into());
    let mut worker = IngestWorker::new(&config, env.ledger.clone(), env.registry.clone(), limits)
        .expect("worker");
    if let Some(n) = crash_after {
        worker = worker.crash_after_commits(n);
    }
    let stats = worker.stats();
    let cancel = CancellationToken::new();
    let handle = tokio::spawn(worker.run(cancel.clone()));
    Running {
        cancel,
        handle,
        stats,
    }
}

/// Polls `check` until it holds or `timeout` passes; panics with `what` on timeout.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads every message of a topic from the beginning until `expected` were seen and the
/// topic stayed quiet for a moment (so extra copies would be seen too), or `timeout`.
pub async fn read_topic(
    env: &Env,
    base: &str,
    expected: usize,
    timeout: Duration,
) -> Vec<OwnedMessage> {
    let topic = env.topic(base);
    let config = env.config.client_config().expect("config");
    tokio::task::spawn_blocking(move || {
        let mut config = config;
        config
            .set("group.id", format!("reader-{}", Uuid::now_v7()))
            .set("enable.auto.commit", "false");
        let consumer: BaseConsumer = config.create().expect("reader");
        let metadata = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .expect("metadata");
        let partitions = metadata.topics()[0].partitions().len() as i32;
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(&topic, p, Offset::Beginning)
                .expect("tpl");
        }
        consumer.assign(&list).expect("assign");
        let start = Instant::now();
        let mut out = Vec::new();
        let mut quiet_since = Instant::now();
        while start.elapsed() < timeout {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    out.push(m.detach());
                    quiet_since = Instant::now();
                }
                Some(Err(e)) => eprintln!("reader: {e}"),
                None if out.len() >= expected
                    && quiet_since.elapsed() > Duration::from_millis(700) =>
                {
                    break;
                }
                None => {}
            }
        }
        out
    })
    .await
    .expect("reader task")
}

pub fn json_of(m: &OwnedMessage) -> Value {
    serde_json::from_slice(m.payload().unwrap_or_default()).expect("result is JSON")
}

pub fn headers_of(m: &OwnedMessage) -> BTreeMap<String, String> {
    m.headers()
        .map(|hs| {
            hs.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Drains the result outbox to the results topic until it is empty.
pub async fn relay_all(env: &Env) -> usize {
    let relay = opgate_kafka::ResultsRelay::new(
        &env.config,
        env.ledger.clone(),
        "test-relay",
        500,
        opgate_kafka::ResultsRelay::default_lease(&env.config).expect("lease"),
    )
    .expect("relay");
    let mut total = 0;
    loop {
        let n = relay.relay_once().await.expect("relay round").marked;
        if n == 0 {
            return total;
        }
        total += n;
    }
}

pub const RESULTS_TOPIC: &str = RESULTS;
pub const DLQ_TOPIC: &str = DLQ;
