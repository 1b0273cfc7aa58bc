//! The embedded broker: librdkafka's mock cluster, in process, for `opgate dev` and tests.
//!
//! It speaks the Kafka protocol on loopback, so any outside client (kcat, Python) can use
//! its bootstrap address. The mock cluster handle is not `Send`, so it lives on a thread
//! of its own; the [`EmbeddedBroker`] handle sends that thread commands, which is also
//! how tests inject faults (broker down, request errors).

use std::sync::mpsc;
use std::thread::JoinHandle;

use rdkafka::ClientConfig;
use rdkafka::client::Client;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{BaseProducer, Producer as _};
use rdkafka::types::{RDKafkaApiKey, RDKafkaErrorCode, RDKafkaRespErr};

use crate::topics::TopicSpec;
use crate::{Error, Result};

type Reply = mpsc::Sender<KafkaResult<()>>;

enum Command {
    BrokerDown(i32, Reply),
    BrokerUp(i32, Reply),
    RequestErrors(RDKafkaApiKey, Vec<RDKafkaRespErr>, Reply),
    ClearRequestErrors(RDKafkaApiKey, Reply),
    CreateTopic(String, i32, Reply),
    TopicError(String, RDKafkaRespErr, Reply),
}

/// How long the embedded broker holds a new consumer group's first join for more members
/// (Kafka's `group.initial.rebalance.delay.ms`). librdkafka's mock cluster holds it
/// 3,000 ms, Apache Kafka's default: every process that subscribes to an empty group
/// waited three seconds before its first record (`bench e2e`: 3.4 s to the first result,
/// a fifth of a 20,000-operation run). Development brokers are set to 0 for this reason;
/// a short hold still lets processes started together join in one rebalance.
const GROUP_JOIN_DELAY_MS: i32 = 200;

/// Sets the mock cluster's `group.initial.rebalance.delay.ms`, which the Rust binding does
/// not expose (librdkafka's `rd_kafka_mock_group_initial_rebalance_delay_ms`).
#[allow(unsafe_code)]
fn set_group_join_delay<C: rdkafka::ClientContext>(client: &Client<C>, delay_ms: i32) {
    // SAFETY: `client` is a live librdkafka handle for the duration of both calls;
    // `rd_kafka_handle_mock_cluster` returns its mock cluster or null, checked before use;
    // the setter only stores an integer in the cluster's defaults.
    unsafe {
        let cluster = rdkafka::bindings::rd_kafka_handle_mock_cluster(client.native_ptr());
        if !cluster.is_null() {
            rdkafka::bindings::rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, delay_ms);
        }
    }
}

/// A running mock cluster. Dropping it stops the cluster.
#[derive(Debug)]
pub struct EmbeddedBroker {
    bootstrap: String,
    brokers: i32,
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl EmbeddedBroker {
    /// Starts a cluster of `brokers` brokers and creates the given topics (with the
    /// given prefix) with their partition counts; replication is capped by the broker count.
    pub fn start(brokers: i32, prefix: &str, topics: &[TopicSpec]) -> Result<Self> {
        let (ready_tx, ready_rx) = mpsc::channel::<KafkaResult<String>>();
        let (commands, command_rx) = mpsc::channel::<Command>();
        let topics: Vec<(String, i32, i32)> = topics
            .iter()
            .map(|t| {
                (
                    format!("{prefix}{}", t.name),
                    t.partitions,
                    t.replication_factor.min(brokers),
                )
            })
            .collect();
        let thread = std::thread::Builder::new()
            .name("opgate-embedded-broker".into())
            .spawn(move || {
                // The cluster belongs to a client made for it, which this thread keeps.
                let owner: BaseProducer = match ClientConfig::new()
                    .set("test.mock.num.brokers", brokers.to_string())
                    .create()
                {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let Some(cluster) = owner.client().mock_cluster() else {
                    let _ = ready_tx.send(Err(KafkaError::MockCluster(RDKafkaErrorCode::Fail)));
                    return;
                };
                set_group_join_delay(owner.client(), GROUP_JOIN_DELAY_MS);
                for (name, partitions, replication) in &topics {
                    if let Err(e) = cluster.create_topic(name, *partitions, *replication) {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                }
                let _ = ready_tx.send(Ok(cluster.bootstrap_servers()));
                // Serve commands until every handle is gone.
                for command in command_rx {
                    match command {
                        Command::BrokerDown(id, reply) => drop(reply.send(cluster.broker_down(id))),
                        Command::BrokerUp(id, reply) => drop(reply.send(cluster.broker_up(id))),
                        Command::RequestErrors(api, errors, reply) => {
                            cluster.request_errors(api, &errors);
                            drop(reply.send(Ok(())));
                        }
                        Command::ClearRequestErrors(api, reply) => {
                            cluster.clear_request_errors(api);
                            drop(reply.send(Ok(())));
                        }
                        Command::CreateTopic(name, partitions, reply) => {
                            drop(reply.send(cluster.create_topic(&name, partitions, 1)));
                        }
                        Command::TopicError(name, error, reply) => {
                            drop(reply.send(cluster.topic_error(&name, error)));
                        }
                    }
                }
            })
            .map_err(|e| Error::Embedded(format!("spawning the broker thread: {e}")))?;
        let bootstrap = ready_rx
            .recv()
            .map_err(|_| Error::Embedded("the broker thread ended before it was ready".into()))??;
        Ok(Self {
            bootstrap,
            brokers,
            commands: Some(commands),
            thread: Some(thread),
        })
    }

    /// The `bootstrap.servers` list, e.g. `127.0.0.1:39527`.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }

    /// A client configuration for this broker. Consumers ask for records with
    /// `fetch.wait.max.ms = 10`: with librdkafka's default (500 ms) records published to
    /// the mock cluster reached the ingest worker in bursts about every half second
    /// (`bench e2e --rate 500 --ops-per-entity 1`: consume -> dispatch p50 201 ms; 11 ms
    /// with this setting). A Kafka broker answers a waiting fetch as soon as data arrives,
    /// so production configurations keep the default.
    pub fn kafka_config(&self) -> crate::KafkaConfig {
        let mut config = crate::KafkaConfig::new(self.bootstrap.clone());
        config
            .client
            .insert("fetch.wait.max.ms".into(), "10".into());
        config
    }

    /// Number of brokers.
    pub fn brokers(&self) -> i32 {
        self.brokers
    }

    fn send(&self, make: impl FnOnce(Reply) -> Command) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        self.commands
            .as_ref()
            .ok_or_else(|| Error::Embedded("stopped".into()))?
            .send(make(tx))
            .map_err(|_| Error::Embedded("the broker thread is gone".into()))?;
        rx.recv()
            .map_err(|_| Error::Embedded("the broker thread is gone".into()))?
            .map_err(Error::from)
    }

    /// Takes a broker down (its listener closes; clients see disconnects).
    pub fn broker_down(&self, id: i32) -> Result<()> {
        self.send(|r| Command::BrokerDown(id, r))
    }

    /// Brings a broker back.
    pub fn broker_up(&self, id: i32) -> Result<()> {
        self.send(|r| Command::BrokerUp(id, r))
    }

    /// Makes the next requests of one API fail with these errors, in order.
    pub fn request_errors(&self, api: RDKafkaApiKey, errors: &[RDKafkaRespErr]) -> Result<()> {
        let errors = errors.to_vec();
        self.send(|r| Command::RequestErrors(api, errors, r))
    }

    /// Clears injected request errors of one API.
    pub fn clear_request_errors(&self, api: RDKafkaApiKey) -> Result<()> {
        self.send(|r| Command::ClearRequestErrors(api, r))
    }

    /// Makes every request on a topic fail with `error` until set back to `NoError`.
    pub fn topic_error(&self, name: &str, error: RDKafkaRespErr) -> Result<()> {
        let name = name.to_owned();
        self.send(|r| Command::TopicError(name, error, r))
    }

    /// Creates another topic.
    pub fn create_topic(&self, name: &str, partitions: i32) -> Result<()> {
        let name = name.to_owned();
        self.send(|r| Command::CreateTopic(name, partitions, r))
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
