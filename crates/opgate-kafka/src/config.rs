//! `[kafka]` configuration. Any librdkafka property can be passed through `[kafka.client]`
//! (SASL/SSL, MSK, Confluent Cloud need no code change); values may reference the
//! environment as `${NAME}`, so secrets stay out of the file. Secret values are never
//! printed: `Debug` redacts them.

use std::collections::BTreeMap;
use std::fmt;

use opgate_core::envsubst;
use rdkafka::ClientConfig;
use serde::Deserialize;

use crate::{Error, Result};

/// Base names of opgate's topics; the configured prefix is prepended.
pub const PROPOSALS: &str = "opgate.proposals";
/// Results topic base name.
pub const RESULTS: &str = "opgate.results";
/// Dead-letter topic base name.
pub const DLQ: &str = "opgate.dlq";

/// `[kafka]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`, e.g. `b-1.msk:9096,b-2.msk:9096` (may use `${ENV}`).
    pub brokers: String,
    /// Prefix for every topic name, e.g. `prod.` (default none).
    #[serde(default)]
    pub topic_prefix: String,
    /// Consumer group of the ingest workers (default `opgate-ingest`).
    #[serde(default = "default_group")]
    pub group_id: String,
    /// Ingest batching.
    #[serde(default)]
    pub batch: BatchConfig,
    /// Replication factor override for `opgate topics create` (e.g. 1 on a single broker).
    #[serde(default)]
    pub replication_factor: Option<i32>,
    /// librdkafka properties passed through as is (values may use `${ENV}`).
    #[serde(default)]
    pub client: BTreeMap<String, String>,
    /// How long `opgate run` waits at startup for a broker to answer before it exits
    /// non-zero, in milliseconds (default 60000; 0 waits forever). Once started, a broker
    /// outage is waited out (and `/readyz` says so).
    #[serde(default = "default_startup_timeout_ms")]
    pub startup_timeout_ms: u64,
}

fn default_startup_timeout_ms() -> u64 {
    60_000
}

/// Ingest batching: a batch closes at `max_messages` or after `max_wait_ms`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Most records per batch (default 500).
    #[serde(default = "default_max_messages")]
    pub max_messages: usize,
    /// Longest wait for a batch to fill, in milliseconds (default 1: long enough to take
    /// the records one fetch delivered, which reach the lane one by one; 0 takes only what
    /// has arrived; under load, records gather while the lane's previous batch is stored).
    #[serde(default = "default_max_wait_ms")]
    pub max_wait_ms: u64,
    /// `/readyz` turns red once a partition has not been able to store a batch for this
    /// long, in milliseconds (default 60000).
    #[serde(default = "default_unready_after_stall_ms")]
    pub unready_after_stall_ms: u64,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_messages: default_max_messages(),
            max_wait_ms: default_max_wait_ms(),
            unready_after_stall_ms: default_unready_after_stall_ms(),
        }
    }
}

fn default_unready_after_stall_ms() -> u64 {
    60_000
}

fn default_group() -> String {
    "opgate-ingest".to_owned()
}

fn default_max_messages() -> usize {
    500
}

fn default_max_wait_ms() -> u64 {
    1
}

/// Property names whose values are secrets.
fn is_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas",
        "token",
        "ssl.key.pem",
        "ssl.keystore",
        "oauthbearer.config",
    ]
    .iter()
    .any(|s| key.contains(s))
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let client: BTreeMap<&str, &str> = self
            .client
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str(),
                    if is_secret(k) {
                        "<redacted>"
                    } else {
                        v.as_str()
                    },
                )
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic_prefix", &self.topic_prefix)
            .field("group_id", &self.group_id)
            .field("batch", &self.batch)
            .field("replication_factor", &self.replication_factor)
            .field("client", &client)
            .field("startup_timeout_ms", &self.startup_timeout_ms)
            .finish()
    }
}

impl KafkaConfig {
    /// A config for the given brokers with every default.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topic_prefix: String::new(),
            group_id: default_group(),
            batch: BatchConfig::default(),
            replication_factor: None,
            client: BTreeMap::new(),
            startup_timeout_ms: default_startup_timeout_ms(),
        }
    }

    /// The full name of a topic.
    pub fn topic(&self, base: &str) -> String {
        format!("{}{base}", self.topic_prefix)
    }

    /// The base client configuration: brokers and pass-through properties, with `${ENV}`
    /// expanded from the process environment.
    pub fn client_config(&self) -> Result<ClientConfig> {
        self.client_config_with(|name| std::env::var(name).ok())
    }

    /// [`Self::client_config`] with an explicit environment (tests).
    pub fn client_config_with(&self, env: impl Fn(&str) -> Option<String>) -> Result<ClientConfig> {
        let expand = |key: &str, value: &str| {
            envsubst::expand(value, &env)
                .map_err(|e| Error::Config(format!("kafka.client.{key}: {e}")))
        };
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", expand("brokers", &self.brokers)?);
        for (key, value) in &self.client {
            config.set(key, expand(key, value)?);
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_properties_through_and_expands_secrets() {
        let config: KafkaConfig = toml::from_str(
            r#"
brokers = "${BROKERS}"
topic_prefix = "prod."
[client]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "SCRAM-SHA-512"
"sasl.username" = "opgate"
"sasl.password" = "${KAFKA_PASSWORD}"
"#,
        )
        .expect("valid");
        let env = |name: &str| match name {
            "BROKERS" => Some("b1:9096".to_owned()),
            "KAFKA_PASSWORD" => Some("hunter2".to_owned()),
            _ => None,
        };
        let client = config.client_config_with(env).expect("expands");
        assert_eq!(client.get("bootstrap.servers"), Some("b1:9096"));
        assert_eq!(client.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(client.get("sasl.password"), Some("hunter2"));
        assert_eq!(config.topic(PROPOSALS), "prod.opgate.proposals");
        let shown = format!("{config:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("<redacted>"),
            "{shown}"
        );

        let missing = config
            .client_config_with(|_| None)
            .expect_err("unset variable");
        assert!(missing.to_string().contains("BROKERS"), "{missing}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err =
            toml::from_str::<KafkaConfig>("brokers = \"x\"\ngroup = \"g\"").expect_err("typo");
        assert!(err.to_string().contains("group"), "{err}");
    }
}
