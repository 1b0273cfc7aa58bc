//! opgate's Kafka path, and the only crate that names rdkafka.
//!
//! - [`ingest::IngestWorker`]: a consumer-group member on `opgate.proposals`. It decodes
//!   each record ([`opgate_core::Proposal::decode`]), prepares it against the tool registry
//!   ([`opgate_core::IngestItem::from_proposal`]), dead-letters what cannot be processed,
//!   ingests each partition's batch in one ledger transaction and only then stores and
//!   commits offsets, in order.
//! - [`relay::ResultsRelay`]: drains the ledger's result outbox to `opgate.results` with
//!   an idempotent producer and marks rows published once the broker acknowledged them.
//! - [`topics`]: topic specs as code and `opgate topics create`.
//! - [`embedded::EmbeddedBroker`]: librdkafka's mock cluster for `opgate dev` and tests.
//! - [`config::KafkaConfig`]: `[kafka]`, with librdkafka properties passed through.
//! - [`probe::BrokerProbe`]: the broker check behind `/readyz` and the startup wait.
//! - [`quiet`]: repeating client errors logged once, then summarized.

pub mod config;
pub mod embedded;
pub mod ingest;
pub mod probe;
pub mod quiet;
pub mod relay;
pub mod topics;

pub use config::KafkaConfig;
pub use embedded::EmbeddedBroker;
pub use ingest::{IngestHealth, IngestStats, IngestWorker};
pub use probe::BrokerProbe;
pub use relay::ResultsRelay;

/// Errors of the Kafka path.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kafka client error.
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A ledger error.
    #[error("ledger: {0}")]
    Store(#[from] opgate_store::Error),
    /// Invalid configuration.
    #[error("config: {0}")]
    Config(String),
    /// A topic administration failure.
    #[error("topics: {0}")]
    Admin(String),
    /// A partition task panicked; the member stops without committing past its batch.
    #[error("a partition task failed: {0}")]
    PartitionTask(String),
    /// A test crash point fired.
    #[error("crash point reached")]
    Crashed,
    /// The embedded broker failed.
    #[error("embedded broker: {0}")]
    Embedded(String),
}

/// `Result` with this crate's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The in-process retry for a batch that cannot be stored yet (ledger or DLQ down):
/// jittered exponential delays capped at 5 s, for as long as it takes. The partition does
/// not move on meanwhile: nothing is skipped.
pub(crate) fn stall_backoff() -> impl Iterator<Item = std::time::Duration> {
    use backon::BackoffBuilder as _;
    backon::ExponentialBuilder::default()
        .with_min_delay(std::time::Duration::from_millis(50))
        .with_max_delay(std::time::Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
        .build()
}
