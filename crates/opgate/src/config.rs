//! The config file (`opgate.toml`): `[database]`, `[kafka]`, `[limits]`, `[[tools]]`,
//! `[[agents]]`. Unknown top-level tables are refused so a typo is an error that names
//! the key. `${NAME}` references are expanded from the environment where a value is used
//! (database URL, Kafka properties), never written back or logged.

use std::path::Path;

use anyhow::Context as _;
use opgate_core::{Limits, Registry};
use opgate_kafka::KafkaConfig;
use serde::Deserialize;

/// `[database]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `postgres://...` or `sqlite://PATH` (may use `${ENV}`).
    pub url: String,
}

/// `[limits]`: proposal decoding limits.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Largest message, bytes (default 1 MiB).
    pub max_message_bytes: Option<usize>,
    /// Largest `args`, bytes (default 64 KiB).
    pub max_args_bytes: Option<usize>,
    /// Deepest `args` nesting (default 16).
    pub max_args_depth: Option<usize>,
}

/// `[worker]`: dispatcher and reconciler settings.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Lease per claim in milliseconds (default 60000; must exceed twice every tool timeout).
    pub lease_ms: Option<u64>,
    /// Operations claimed per round (default 16).
    pub batch: Option<usize>,
    /// Calls in flight overall (default 64).
    pub concurrency: Option<usize>,
    /// Calls in flight per tool (default 16).
    pub per_tool: Option<usize>,
    /// Longest pause between two lookups of one unknown outcome (default 30000).
    pub reconcile_max_backoff_ms: Option<u64>,
}

/// One `[[api.tokens]]` entry.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds it (recorded as the actor of commands).
    pub name: String,
    /// `viewer` or `operator`.
    pub role: opgate_api::Role,
    /// The secret; use `${NAME}` so it stays out of the file.
    pub secret: String,
}

impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConfig")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// `[api]`: the admin HTTP API.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Address to listen on (default 127.0.0.1:8080).
    #[serde(default = "default_listen")]
    pub listen: std::net::SocketAddr,
    /// Bearer tokens.
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
}

fn default_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 8080))
}

impl ApiConfig {
    /// The tokens with `${ENV}` expanded; an empty secret is refused.
    pub fn tokens(&self) -> anyhow::Result<Vec<opgate_api::Token>> {
        self.tokens
            .iter()
            .map(|t| {
                let secret = opgate_core::envsubst::expand(&t.secret, |n| std::env::var(n).ok())
                    .with_context(|| format!("api.tokens `{}`", t.name))?;
                anyhow::ensure!(
                    !secret.trim().is_empty(),
                    "api.tokens `{}`: the secret is empty",
                    t.name
                );
                Ok(opgate_api::Token {
                    name: t.name.clone(),
                    secret,
                    role: t.role,
                })
            })
            .collect()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    api: Option<ApiConfig>,
    database: Option<DatabaseConfig>,
    kafka: Option<KafkaConfig>,
    limits: Option<LimitsConfig>,
    worker: Option<WorkerConfig>,
    // Validated by `Registry::from_toml`; listed so unknown top-level keys are refused.
    #[serde(default, rename = "tools")]
    _tools: Vec<toml::Value>,
    #[serde(default, rename = "agents")]
    _agents: Vec<toml::Value>,
}

/// A loaded, validated config.
#[derive(Debug)]
pub struct Config {
    /// `[database]`.
    pub database: Option<DatabaseConfig>,
    /// `[kafka]`.
    pub kafka: Option<KafkaConfig>,
    /// Decoding limits.
    pub limits: Limits,
    /// `[worker]`.
    pub worker: WorkerConfig,
    /// `[api]`.
    pub api: Option<ApiConfig>,
    /// The tool registry.
    pub registry: Registry,
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    /// Parses and validates config text.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: File = toml::from_str(text)?;
        let registry = Registry::from_toml(text)?;
        let defaults = Limits::default();
        let limits = file.limits.map_or(defaults, |l| Limits {
            max_message_bytes: l.max_message_bytes.unwrap_or(defaults.max_message_bytes),
            max_args_bytes: l.max_args_bytes.unwrap_or(defaults.max_args_bytes),
            max_args_depth: l.max_args_depth.unwrap_or(defaults.max_args_depth),
        });
        Ok(Self {
            database: file.database,
            kafka: file.kafka,
            limits,
            worker: file.worker.unwrap_or_default(),
            api: file.api,
            registry,
        })
    }

    /// The database URL with `${ENV}` expanded.
    pub fn database_url(&self) -> anyhow::Result<String> {
        let db = self
            .database
            .as_ref()
            .context("the config has no [database] table (url = \"postgres://...\")")?;
        opgate_core::envsubst::expand(&db.url, |n| std::env::var(n).ok()).context("database.url")
    }

    /// `[kafka]`, required.
    pub fn kafka(&self) -> anyhow::Result<&KafkaConfig> {
        self.kafka
            .as_ref()
            .context("the config has no [kafka] table (brokers = \"host:9092\")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_config_is_valid() {
        let text = include_str!("../../../opgate.example.toml");
        let config = Config::parse(text).expect("the shipped example config is valid");
        assert!(config.registry.tool("capture_payment").is_some());
        assert!(config.kafka.is_some());
    }

    #[test]
    fn errors_name_the_key() {
        let err = Config::parse("[databse]\nurl = \"x\"").expect_err("typo");
        assert!(format!("{err:#}").contains("databse"), "{err:#}");
        let err = Config::parse("[kafka]\nbrokers = \"x\"\nbatch = { max_mesages = 1 }")
            .expect_err("typo");
        assert!(format!("{err:#}").contains("max_mesages"), "{err:#}");
        let err = Config::parse(
            "[[tools]]\nname = \"t\"\nside_effect_class = \"read\"\n[tools.args]\na = \"nope\"",
        )
        .expect_err("bad normalizer");
        assert!(
            format!("{err:#}").contains("tool `t`: field `args.a`"),
            "{err:#}"
        );
    }
}
