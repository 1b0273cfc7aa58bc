//! Is the broker reachable? For `/readyz`.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer as _};

use crate::quiet::QuietContext;
use crate::{KafkaConfig, Result};

/// Asks the brokers for cluster metadata, with one long-lived client.
#[derive(Clone)]
pub struct BrokerProbe {
    client: Arc<BaseConsumer<QuietContext>>,
    timeout: Duration,
}

impl BrokerProbe {
    /// A probe with the config's client properties (SASL/SSL included).
    pub fn new(config: &KafkaConfig, timeout: Duration) -> Result<Self> {
        let client: BaseConsumer<QuietContext> =
            config.client_config()?.create_with_context(QuietContext)?;
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

    /// Waits until a broker answers; gives up with the last error once `deadline` has
    /// passed (`Duration::ZERO`: never gives up). Says once that it is waiting.
    pub async fn wait_until_up(&self, deadline: Duration) -> std::result::Result<(), String> {
        let started = tokio::time::Instant::now();
        let mut said = false;
        loop {
            let err = match self.check().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if !deadline.is_zero() && started.elapsed() >= deadline {
                return Err(err);
            }
            if !said {
                tracing::warn!(error = %err, "waiting for a Kafka broker to answer");
                said = true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
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
