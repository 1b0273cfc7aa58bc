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

/// The consumers' `session.timeout.ms` on the embedded broker: Apache Kafka's floor
/// (`group.min.session.timeout.ms`), not librdkafka's default of 45 s. The mock cluster
/// ends a rebalance that starts while its group consumes (a member joins, or rejoins)
/// only when its timer fires, one second short of the session timeout, even when every
/// member has rejoined at once (Apache Kafka ends it then); the whole group consumes
/// nothing until then. A member joining late starts one (`examples/group_join.rs`: 44 s
/// with the default, 5 s with this), and so does a race in the mock's coordinator: when
/// the leader's SyncGroup arrives before a follower's, the generation completes without
/// it, the follower's SyncGroup is refused ("Invalid request") and it rejoins (2 of 27
/// `bench e2e --processes 2` runs; the ~400/s two-process runs of 2026-12-02 and
/// 2026-12-07 were such 44 s stops).
const SESSION_TIMEOUT_MS: &str = "6000";

/// A sixth of [`SESSION_TIMEOUT_MS`]: a member misses several heartbeats before the
/// coordinator drops it.
const HEARTBEAT_INTERVAL_MS: &str = "1000";

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

    /// A client configuration for this broker. Consumer group members keep a short
    /// session ([`SESSION_TIMEOUT_MS`]): a member that joins late stops the group that long
    /// on this broker. Consumers ask for records with `fetch.wait.max.ms = 10`: with librdkafka's default (500 ms) records published to
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
            .client
            .insert("session.timeout.ms".into(), SESSION_TIMEOUT_MS.into());
        config
            .client
            .insert("heartbeat.interval.ms".into(), HEARTBEAT_INTERVAL_MS.into());
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use rdkafka::consumer::{BaseConsumer, Consumer};

    use super::*;

    /// A member that joins a group already consuming gets its partitions within the
    /// session timeout the embedded configuration sets, not librdkafka's 45 s (the mock
    /// cluster holds such a rebalance until its timer fires: `examples/group_join.rs`).
    #[test]
    fn a_member_joining_late_waits_seconds_not_most_of_a_minute() {
        let specs = crate::topics::builtin_specs().expect("topic specs");
        let broker = EmbeddedBroker::start(1, "", &specs).expect("embedded broker");
        let kafka = broker.kafka_config();
        let topic = kafka.topic(crate::config::PROPOSALS);
        let member = || -> BaseConsumer {
            let mut config = kafka.client_config().expect("client config");
            config.set("group.id", "late-join");
            let consumer: BaseConsumer = config.create().expect("consumer");
            consumer.subscribe(&[&topic]).expect("subscribe");
            consumer
        };
        let assigned = |c: &BaseConsumer| c.assignment().map(|a| a.count()).unwrap_or(0) > 0;
        let first = member();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !assigned(&first) {
            assert!(
                Instant::now() < deadline,
                "the first member got no partitions"
            );
            first.poll(Duration::from_millis(10));
        }
        let late = member();
        let joined = Instant::now();
        while !(assigned(&late) && assigned(&first)) {
            assert!(
                joined.elapsed() < Duration::from_secs(15),
                "the group was still rebalancing after 15 s"
            );
            first.poll(Duration::from_millis(5));
            late.poll(Duration::from_millis(5));
        }
    }
}
