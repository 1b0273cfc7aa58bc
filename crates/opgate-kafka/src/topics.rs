//! Topics as code: the specs in `topics/*.toml`, embedded at build time, and the admin
//! step that creates missing topics and reports drift on existing ones.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use serde::Deserialize;

use crate::config::KafkaConfig;
use crate::{Error, Result};

/// One topic's spec, as written in `topics/<name>.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicSpec {
    /// Base name (the configured prefix is prepended).
    pub name: String,
    /// Partition count.
    pub partitions: i32,
    /// Replication factor.
    pub replication_factor: i32,
    /// Topic configs (`cleanup.policy`, `retention.ms`, ...).
    #[serde(default)]
    pub config: BTreeMap<String, String>,
}

const SPECS: [(&str, &str); 3] = [
    (
        "opgate.proposals.toml",
        include_str!("../../../topics/opgate.proposals.toml"),
    ),
    (
        "opgate.results.toml",
        include_str!("../../../topics/opgate.results.toml"),
    ),
    (
        "opgate.dlq.toml",
        include_str!("../../../topics/opgate.dlq.toml"),
    ),
];

/// The three topic specs of this build.
pub fn builtin_specs() -> Result<Vec<TopicSpec>> {
    SPECS
        .iter()
        .map(|(file, text)| {
            toml::from_str(text).map_err(|e| Error::Config(format!("topics/{file}: {e}")))
        })
        .collect()
}

/// What `ensure_topics` found for one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicStatus {
    /// Created now.
    Created,
    /// Existed and matches the spec.
    Matches,
    /// Existed but differs; each entry says how.
    Drift(Vec<String>),
}

/// Creates missing topics and verifies existing ones (idempotent). The replication factor
/// comes from `[kafka] replication_factor` when set, else from the spec.
pub async fn ensure_topics(
    config: &KafkaConfig,
    specs: &[TopicSpec],
) -> Result<Vec<(String, TopicStatus)>> {
    let client_config = config.client_config()?;
    let admin: AdminClient<DefaultClientContext> = client_config.create()?;
    let probe: BaseConsumer = client_config.create()?;
    let timeout = Duration::from_secs(15);
    let metadata = tokio::task::spawn_blocking(move || probe.fetch_metadata(None, timeout))
        .await
        .map_err(|e| Error::Admin(format!("metadata task: {e}")))??;
    let existing: BTreeMap<String, usize> = metadata
        .topics()
        .iter()
        .map(|t| (t.name().to_owned(), t.partitions().len()))
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(timeout));
    let mut report = Vec::new();
    for spec in specs {
        let name = config.topic(&spec.name);
        let replication = config.replication_factor.unwrap_or(spec.replication_factor);
        match existing.get(&name) {
            None => {
                let mut topic =
                    NewTopic::new(&name, spec.partitions, TopicReplication::Fixed(replication));
                for (k, v) in &spec.config {
                    topic = topic.set(k, v);
                }
                for result in admin.create_topics([&topic], &options).await? {
                    match result {
                        Ok(_) => {}
                        // Another process created it between our metadata read and now.
                        Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {}
                        Err((t, code)) => {
                            return Err(Error::Admin(format!("creating {t}: {code}")));
                        }
                    }
                }
                report.push((name, TopicStatus::Created));
            }
            Some(partitions) => {
                let mut drift = Vec::new();
                if *partitions != spec.partitions as usize {
                    drift.push(format!(
                        "partitions: {partitions} (spec {})",
                        spec.partitions
                    ));
                }
                drift.extend(config_drift(&admin, &options, &name, spec).await);
                report.push((
                    name,
                    if drift.is_empty() {
                        TopicStatus::Matches
                    } else {
                        TopicStatus::Drift(drift)
                    },
                ));
            }
        }
    }
    Ok(report)
}

/// Differences between a topic's configs and its spec; a broker that cannot describe
/// configs is reported as such rather than hidden.
async fn config_drift(
    admin: &AdminClient<DefaultClientContext>,
    options: &AdminOptions,
    name: &str,
    spec: &TopicSpec,
) -> Vec<String> {
    let described = match admin
        .describe_configs([&ResourceSpecifier::Topic(name)], options)
        .await
    {
        Ok(mut results) => match results.pop() {
            Some(Ok(resource)) => resource,
            Some(Err(code)) => return vec![format!("configs not verifiable: {code}")],
            None => return vec!["configs not verifiable: empty answer".to_owned()],
        },
        Err(e) => return vec![format!("configs not verifiable: {e}")],
    };
    spec.config
        .iter()
        .filter_map(|(key, want)| {
            let have = described.get(key).and_then(|entry| entry.value.clone());
            (have.as_deref() != Some(want.as_str())).then(|| {
                format!(
                    "{key}: {} (spec {want})",
                    have.as_deref().unwrap_or("unset")
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_specs_parse_and_name_the_three_topics() {
        let specs = builtin_specs().expect("valid specs");
        let names: Vec<_> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                crate::config::PROPOSALS,
                crate::config::RESULTS,
                crate::config::DLQ
            ]
        );
        for spec in &specs {
            assert!(spec.partitions > 0 && spec.replication_factor > 0);
            assert_eq!(
                spec.config.get("cleanup.policy").map(String::as_str),
                Some("delete")
            );
        }
    }
}
