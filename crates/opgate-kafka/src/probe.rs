//! Is the broker reachable? For `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer as _};

use crate::{KafkaConfig, Result};

/// Asks the brokers for cluster metadata, with one long-lived client.
#[derive(Clone)]
pub struct BrokerProbe {
    client: Arc<BaseConsumer>,
    timeout: Duration,
}

impl BrokerProbe {
    /// A probe with the config's client properties (SASL/SSL included).
    pub fn new(config: &KafkaConfig, timeout: Duration) -> Result<Self> {
        let client: BaseConsumer = config.client_config()?.create()?;
        Ok(Self {
            client: Arc::new(client),
            timeout,
        })
    }

    /// `Ok` when a broker answered a metadata request within the timeout.
    pub async fn check(&self) -> std::result::Result<(), String> {
        let client = self.client.clone();
        let timeout = self.timeout;
        tokio::task::spawn_blocking(move || {
            client
                .fetch_metadata(None, timeout)
                .map(|m| {
                    tracing::trace!(brokers = m.brokers().len(), "broker probe ok");
                })
                .map_err(|e| format!("no broker answered within {timeout:?}: {e}"))
        })
        .await
        .map_err(|e| e.to_string())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn answers_for_a_live_broker_and_fails_for_a_closed_port() {
        let broker = crate::EmbeddedBroker::start(1, "", &[]).expect("mock cluster");
        let up = BrokerProbe::new(
            &KafkaConfig::new(broker.bootstrap_servers()),
            Duration::from_secs(5),
        )
        .expect("probe");
        assert_eq!(up.check().await, Ok(()));
        // Nothing listens on port 1.
        let down = BrokerProbe::new(&KafkaConfig::new("127.0.0.1:1"), Duration::from_millis(500))
            .expect("probe");
        let err = down.check().await.expect_err("unreachable");
        assert!(err.contains("no broker answered"), "{err}");
    }
}
