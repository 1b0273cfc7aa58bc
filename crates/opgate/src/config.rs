//! The config file (`opgate.toml`): `[database]`, `[kafka]`, `[limits]`, `[worker]`,
//! `[api]`, `[[tools]]`, `[[agents]]`. Unknown keys are refused so a typo is an error that
//! names the key. `${NAME}` references are expanded from the environment where a value is
//! used (database URL, Kafka properties, token secrets), never written back or logged.
//!
//! Layers, later ones winning: the file, then `OPGATE_<KEY>` environment variables for
//! the keys in [`ENV_KEYS`] (`worker.lease_ms` is `OPGATE_WORKER_LEASE_MS`), then
//! `--set key=value` flags for any key outside the `[[tools]]`/`[[agents]]` arrays.

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
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Lease per claim in milliseconds (default 60000; must exceed twice every tool timeout).
    pub lease_ms: Option<u64>,
    /// Operations claimed per round (default 64).
    pub batch: Option<usize>,
    /// Calls in flight overall, until recorded (default 256).
    pub concurrency: Option<usize>,
    /// Calls in flight per tool (default 16).
    pub per_tool: Option<usize>,
    /// Per tool, at most how many operations a claim may take beyond the free `per_tool`
    /// permits; they wait for one. A claim takes one wave (`per_tool`) ahead, more when
    /// the tool's calls are shorter than about twice a claim
    /// (`opgate_worker::claim_ahead`), never more waves than the lease can send
    /// (`opgate_worker::waves_in_lease`); default 4 x `per_tool`, 0 claims only what can
    /// be sent now.
    pub prefetch: Option<usize>,
    /// Most call outcomes recorded in one ledger transaction (default 128; 1 records each
    /// outcome in its own transaction).
    pub record_batch: Option<usize>,
    /// With the ingest and dispatch roles in one process, the ingest transaction claims
    /// the ready operations it creates for this process's dispatcher, as far as it has
    /// room to send them at once (default true; `opgate_store::handoff`). False leaves
    /// every operation to the dispatcher's own claim.
    pub claim_at_ingest: Option<bool>,
    /// Longest pause between two lookups of one unknown outcome (default 30000).
    pub reconcile_max_backoff_ms: Option<u64>,
    /// Inbox rows and published results older than this are
    /// deleted by the relay role's reaper (default `8d`: longer than the proposals
    /// topic's 7-day retention, so a redelivered record still finds its inbox row).
    pub reap_after: Option<String>,
    /// How often the reaper runs (default `10m`).
    pub reap_every: Option<String>,
}

impl WorkerConfig {
    /// `(reap_after, reap_every)`, parsed; errors name the key.
    pub fn reaping(&self) -> anyhow::Result<(std::time::Duration, std::time::Duration)> {
        let parse = |key: &str, value: &Option<String>, default: &str| {
            opgate_core::registry::parse_duration(value.as_deref().unwrap_or(default))
                .map_err(|m| anyhow::anyhow!("worker.{key}: {m}"))
        };
        Ok((
            parse("reap_after", &self.reap_after, "8d")?,
            parse("reap_every", &self.reap_every, "10m")?,
        ))
    }
}

/// One `[[api.tokens]]` entry.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenConfig {
    /// Who holds it (the principal: recorded as the actor of what it does).
    pub name: String,
    /// `agent`, `viewer` or `operator`.
    pub role: opgate_api::Role,
    /// The secret; use `${NAME}` so it stays out of the file.
    #[serde(default)]
    pub secret: Option<String>,
    /// Several secrets (rotation: add the new one, move the clients, drop the old one).
    #[serde(default)]
    pub secrets: Vec<String>,
    /// SHA-256 digests (hex) of secrets, so the file need not hold them.
    #[serde(default)]
    pub secret_sha256: Vec<String>,
    /// For an agent token: the `agent_id` its proposals carry.
    #[serde(default)]
    pub agent_id: Option<String>,
    /// For an agent token: the namespaces it may propose in and read.
    #[serde(default)]
    pub namespaces: Vec<String>,
}

impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConfig")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("secrets", &"<redacted>")
            .field("agent_id", &self.agent_id)
            .field("namespaces", &self.namespaces)
            .finish()
    }
}

impl TokenConfig {
    /// The token as the API holds it: `${ENV}` expanded, secrets hashed.
    pub fn token(&self) -> anyhow::Result<opgate_api::Token> {
        let expand = |v: &str| {
            opgate_core::envsubst::expand(v, |n| std::env::var(n).ok())
                .with_context(|| format!("api.tokens `{}`", self.name))
        };
        let secrets = self
            .secret
            .iter()
            .chain(&self.secrets)
            .map(|s| expand(s))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let sha256 = self
            .secret_sha256
            .iter()
            .map(|s| expand(s))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let agent = match (&self.agent_id, self.namespaces.is_empty()) {
            (None, true) => None,
            (agent_id, _) => Some(opgate_api::AgentScope {
                agent_id: agent_id.clone().unwrap_or_default(),
                namespaces: self.namespaces.clone(),
            }),
        };
        Ok(opgate_api::Token::new(
            &self.name, self.role, &secrets, &sha256, agent,
        )?)
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
    /// The tokens with `${ENV}` expanded and secrets hashed; a short or empty secret,
    /// or one shared by two tokens, is refused.
    pub fn tokens(&self) -> anyhow::Result<Vec<opgate_api::Token>> {
        let tokens = self
            .tokens
            .iter()
            .map(TokenConfig::token)
            .collect::<anyhow::Result<Vec<_>>>()?;
        opgate_api::auth::check_tokens(&tokens)?;
        Ok(tokens)
    }
}

/// `[metrics]`: a `/metrics` listener without tokens, for processes without the api role.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `GET /metrics` on (an internal interface).
    pub listen: std::net::SocketAddr,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    api: Option<ApiConfig>,
    telemetry: Option<crate::telemetry::TelemetryConfig>,
    metrics: Option<MetricsConfig>,
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
    /// `[metrics]`.
    pub metrics: Option<MetricsConfig>,
    /// `[telemetry]` (OTLP trace export).
    pub telemetry: Option<crate::telemetry::TelemetryConfig>,
    /// The tool registry.
    pub registry: Registry,
}

/// The keys the environment may set, as `OPGATE_` + the key upper-cased with `.` as `_`.
pub const ENV_KEYS: &[&str] = &[
    "database.url",
    "kafka.brokers",
    "kafka.group_id",
    "kafka.topic_prefix",
    "kafka.replication_factor",
    "kafka.batch.max_messages",
    "kafka.batch.max_wait_ms",
    "api.listen",
    "metrics.listen",
    "worker.lease_ms",
    "worker.batch",
    "worker.concurrency",
    "worker.per_tool",
    "worker.prefetch",
    "worker.record_batch",
    "worker.reconcile_max_backoff_ms",
    "worker.reap_after",
    "worker.reap_every",
    "limits.max_message_bytes",
    "limits.max_args_bytes",
    "limits.max_args_depth",
];

/// The environment variable for a key.
pub fn env_name(key: &str) -> String {
    format!("OPGATE_{}", key.to_uppercase().replace('.', "_"))
}

impl Config {
    /// Reads a config file and layers the environment (`env`, see [`ENV_KEYS`]) and
    /// `--set key=value` flags over it, then validates the result. Errors name the key
    /// and where its value came from.
    pub fn load_layered(
        path: &Path,
        env: impl Fn(&str) -> Option<String>,
        sets: &[String],
    ) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut doc: toml::Table = toml::from_str(&text)
            .map_err(anyhow::Error::from)
            .with_context(|| format!("in {}", path.display()))?;
        schema_paths_beside(&mut doc, path);
        // The layers: OPGATE_<KEY> variables, then `--set` flags (the later wins).
        let mut layers = Vec::new();
        for key in ENV_KEYS {
            let name = env_name(key);
            if let Some(value) = env(&name) {
                layers.push(Layer {
                    source: name,
                    key: (*key).to_owned(),
                    value,
                });
            }
        }
        for set in sets {
            let (key, value) = set
                .split_once('=')
                .with_context(|| format!("--set {set}: expected key=value"))?;
            layers.push(Layer {
                source: format!("--set {}", key.trim()),
                key: key.trim().to_owned(),
                value: value.to_owned(),
            });
        }
        let file_doc = doc.clone();
        for layer in &layers {
            layer.apply(&mut doc)?;
        }
        // Every string value's `${NAME}`s, expanded after layering (so no key takes one
        // literally, and a key a layer overrides needs none of the file's variables);
        // every unset one named at once.
        let mut missing = Vec::new();
        expand_strings(&mut doc, &env, &mut missing);
        let parsed = Self::parse(&toml::to_string(&doc)?);
        // A layer whose value its key refuses is named alone, with the key's complaint.
        let failed = parsed.is_err();
        let culprit = || {
            failed
                .then(|| bad_layer(&file_doc, &layers, &env))
                .flatten()
        };
        if !missing.is_empty() {
            let mut problems = vec![format!(
                "environment variables referenced but not set: {}",
                missing.join(", ")
            )];
            problems.extend(culprit());
            anyhow::bail!("{}: {}", path.display(), problems.join("; "));
        }
        let e = match parsed {
            Ok(config) => return Ok(config),
            Err(e) => e,
        };
        if let Some(culprit) = culprit() {
            anyhow::bail!("{}: {culprit}", path.display());
        }
        // The layered text is re-serialized, so its line numbers are not the file's:
        // when the file alone has the error, report it against the file's own text.
        let sources: Vec<&str> = layers.iter().map(|l| l.source.as_str()).collect();
        match Self::parse(&text) {
            Err(in_file) if sources.is_empty() || !same_error(&e, &in_file) => {
                Err(in_file).with_context(|| format!("in {}", path.display()))
            }
            _ => Err(e).with_context(|| match sources.is_empty() {
                true => format!("in {}", path.display()),
                false => format!("in {} with {}", path.display(), sources.join(", ")),
            }),
        }
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
            metrics: file.metrics,
            telemetry: file.telemetry,
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

/// Whether two errors say the same thing apart from where (line numbers, snippets).
/// One override of a config key: an `OPGATE_<KEY>` variable or a `--set` flag.
struct Layer {
    source: String,
    key: String,
    value: String,
}

impl Layer {
    fn apply(&self, doc: &mut toml::Table) -> anyhow::Result<()> {
        set_key(doc, &self.key, &self.value)
            .with_context(|| format!("{} ({})", self.source, self.key))
    }
}

/// The first layer that, over the file alone, makes the config invalid where the file
/// is not: `OPGATE_WORKER_LEASE_MS (worker.lease_ms): invalid type: string "abc",
/// expected u64` — the key's complaint without the re-serialized text around it.
fn bad_layer(
    file_doc: &toml::Table,
    layers: &[Layer],
    env: &impl Fn(&str) -> Option<String>,
) -> Option<String> {
    let parse = |doc: &toml::Table| {
        let mut doc = doc.clone();
        expand_strings(&mut doc, env, &mut Vec::new());
        toml::to_string(&doc)
            .map_err(anyhow::Error::from)
            .and_then(|t| Config::parse(&t))
    };
    let alone = parse(file_doc).err();
    layers.iter().find_map(|layer| {
        let mut doc = file_doc.clone();
        layer.apply(&mut doc).ok()?;
        let err = parse(&doc).err()?;
        if alone.as_ref().is_some_and(|a| same_error(a, &err)) {
            return None;
        }
        let complaint = err
            .downcast_ref::<toml::de::Error>()
            .map_or_else(|| format!("{err:#}"), |t| t.message().to_owned());
        Some(format!("{} ({}): {complaint}", layer.source, layer.key))
    })
}

fn same_error(a: &anyhow::Error, b: &anyhow::Error) -> bool {
    let last = |e: &anyhow::Error| {
        format!("{e:#}")
            .lines()
            .last()
            .unwrap_or_default()
            .to_owned()
    };
    last(a) == last(b)
}

/// Expands `${NAME}` in every string of a TOML document (keys untouched).
fn expand_strings(
    doc: &mut toml::Table,
    env: &impl Fn(&str) -> Option<String>,
    missing: &mut Vec<String>,
) {
    fn walk(
        value: &mut toml::Value,
        env: &impl Fn(&str) -> Option<String>,
        missing: &mut Vec<String>,
    ) {
        match value {
            toml::Value::String(s) if s.contains("${") => {
                *s = opgate_core::envsubst::expand_keeping_escapes(s, env, missing);
            }
            toml::Value::Array(items) => items.iter_mut().for_each(|v| walk(v, env, missing)),
            toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| walk(v, env, missing)),
            _ => {}
        }
    }
    doc.iter_mut().for_each(|(_, v)| walk(v, env, missing));
}

/// A tool's `args_schema` given as a file path is relative to the config file.
fn schema_paths_beside(doc: &mut toml::Table, config: &Path) {
    let dir = config.parent().unwrap_or(Path::new(""));
    let Some(toml::Value::Array(tools)) = doc.get_mut("tools") else {
        return;
    };
    for tool in tools.iter_mut() {
        if let Some(toml::Value::String(file)) = tool.get_mut("args_schema")
            && Path::new(file.as_str()).is_relative()
        {
            *file = dir.join(&*file).display().to_string();
        }
    }
}

/// Keys whose values are strings however they are spelled (a group id may be `12345`).
const STRING_KEYS: &[&str] = &[
    "database.url",
    "kafka.brokers",
    "kafka.group_id",
    "kafka.topic_prefix",
    "api.listen",
    "metrics.listen",
    "worker.reap_after",
    "worker.reap_every",
];

/// Sets `a.b.c` in a TOML document, creating tables on the way. `kafka.client.<property>`
/// sets one librdkafka property (dots and all) to a string; the keys in [`STRING_KEYS`]
/// are strings; any other value's type is read from its spelling: an integer,
/// `true`/`false`, or else a string.
fn set_key(doc: &mut toml::Table, key: &str, raw: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = match key.strip_prefix("kafka.client.") {
        Some(property) if !property.is_empty() => vec!["kafka", "client", property],
        _ => key.split('.').collect(),
    };
    let string_valued =
        parts.len() == 3 && parts[..2] == ["kafka", "client"] || STRING_KEYS.contains(&key);
    anyhow::ensure!(
        !parts.iter().any(|p| p.is_empty()),
        "`{key}` is not a key (a.b.c)"
    );
    let (last, tables) = parts.split_last().context("empty key")?;
    let mut table = doc;
    for (i, part) in tables.iter().enumerate() {
        let entry = table
            .entry((*part).to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry.as_table_mut().with_context(|| {
            format!(
                "`{}` is not a table (tools and agents are set in the file only)",
                parts[..=i].join(".")
            )
        })?;
    }
    let value = if string_valued {
        toml::Value::String(raw.to_owned())
    } else if let Ok(n) = raw.parse::<i64>() {
        toml::Value::Integer(n)
    } else if let Ok(b) = raw.parse::<bool>() {
        toml::Value::Boolean(b)
    } else {
        toml::Value::String(raw.to_owned())
    };
    table.insert((*last).to_owned(), value);
    Ok(())
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
    fn the_deploy_config_is_valid() {
        let text = include_str!("../../../deploy/opgate.toml");
        let config = Config::parse(text).expect("deploy/opgate.toml is valid");
        assert!(config.registry.tool("write_off_balance").is_some());
        assert!(config.metrics.is_some() && config.api.is_some());
    }

    #[test]
    fn tokens_are_hashed_scoped_and_checked() {
        let config = Config::parse(
            r#"
[api]
[[api.tokens]]
name = "bot"
role = "agent"
agent_id = "support-bot"
namespaces = ["acme"]
secrets = ["new-secret-0123456789", "old-secret-0123456789"]
[[api.tokens]]
name = "ops"
role = "operator"
secret_sha256 = ["9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
"#,
        )
        .expect("config");
        let tokens = config.api.as_ref().expect("api").tokens().expect("tokens");
        assert_eq!(tokens[0].digests.len(), 2, "both secrets of a rotation");
        let scope = tokens[0].agent.as_ref().expect("scope");
        assert_eq!(
            (scope.agent_id.as_str(), scope.namespaces.len()),
            ("support-bot", 1)
        );
        assert_eq!(tokens[1].role, opgate_api::Role::Operator);
        // An agent without namespaces, an operator bound to an agent: refused, naming it.
        for bad in [
            "name = \"b\"\nrole = \"agent\"\nagent_id = \"x\"\nsecret = \"0123456789abcdef\"",
            "name = \"b\"\nrole = \"operator\"\nagent_id = \"x\"\nsecret = \"0123456789abcdef\"",
            "name = \"b\"\nrole = \"viewer\"\nsecret = \"short\"",
        ] {
            let config = Config::parse(&format!("[api]\n[[api.tokens]]\n{bad}")).expect("parses");
            let err = config.api.as_ref().expect("api").tokens().expect_err(bad);
            assert!(err.to_string().contains("api.tokens `b`"), "{err}");
        }
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

    fn file(text: &str) -> tempfile_path::Path {
        tempfile_path::Path::with(text)
    }

    /// A config file in the temp dir, removed on drop.
    #[test]
    fn an_args_schema_file_is_read_beside_the_config_and_a_bad_schema_is_named() {
        let dir = std::env::temp_dir().join(format!("opgate-schema-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(dir.join("schemas")).expect("dir");
        std::fs::write(
            dir.join("schemas/pay.json"),
            r#"{"type": "object", "properties": {"amount": {"type": "string", "pattern": "^[0-9]"}}}"#,
        )
        .expect("schema");
        let tool = "[[tools]]\nname = \"pay\"\nside_effect_class = \"irreversible\"\n";
        let path = dir.join("opgate.toml");
        std::fs::write(&path, format!("{tool}args_schema = \"schemas/pay.json\"\n"))
            .expect("config");
        let config = Config::load_layered(&path, |_| None, &[]).expect("loads");
        let schema = config
            .registry
            .tool("pay")
            .and_then(|t| t.args_schema.as_ref())
            .expect("the schema file was read");
        let args = serde_json::json!({"amount": "-1"});
        let err = schema
            .check(args.as_object().expect("object"))
            .expect_err("refused");
        assert!(err.contains("`/amount`"), "{err}");
        // A schema that is not valid JSON Schema names the tool and field.
        let err = Config::parse(&format!(
            "{tool}[tools.args_schema]\ntype = \"object\"\nproperties = {{ amount = {{ type = 5 }} }}\n"
        ))
        .expect_err("invalid schema");
        assert!(
            format!("{err:#}").contains("tool `pay`: field `args_schema`"),
            "{err:#}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_config_error_is_reported_at_the_file_s_own_line() {
        let mut text = String::from("[worker]\nbatch = 4\n\n");
        for n in 0..12 {
            text.push_str(&format!(
                "[[tools]]\nname = \"t{n}\"\nside_effect_class = \"read\"\n\n"
            ));
        }
        let bad_line = text.lines().count() + 3;
        text.push_str("[[tools]]\nname = \"bad\"\nside_effect_class = \"irreversable\"\n");
        let f = file(&text);
        let err = Config::load_layered(&f.0, |_| None, &[]).expect_err("typo");
        let err = format!("{err:#}");
        assert!(err.contains(&format!("line {bad_line}")), "{err}");
        assert!(err.contains("irreversable"), "{err}");
        // An unknown key in one table, reported where it is.
        let f = file("[kafka]\nbrokers = \"b\"\n\n[worker]\nbatch = 4\nlease_msx = 1\n");
        let err = format!(
            "{:#}",
            Config::load_layered(&f.0, |_| None, &["worker.batch=8".into()]).expect_err("typo")
        );
        assert!(err.contains("lease_msx") && err.contains("line 6"), "{err}");
    }

    #[test]
    fn every_unset_variable_is_named_at_once_and_every_string_is_expanded() {
        let f = file(
            "[database]\nurl = \"${DB}\"\n[kafka]\nbrokers = \"${BROKERS}\"\ntopic_prefix = \"${PFX}\"\n[api]\n[[api.tokens]]\nname = \"a\"\nrole = \"viewer\"\nsecret = \"${DB}${TOKEN}\"\n",
        );
        let err = format!(
            "{:#}",
            Config::load_layered(&f.0, |_| None, &[]).expect_err("unset")
        );
        let listed = err.rsplit("not set: ").next().unwrap_or_default();
        let mut names: Vec<&str> = listed.split(", ").collect();
        names.sort_unstable();
        assert_eq!(names, ["BROKERS", "DB", "PFX", "TOKEN"], "{err}");
        let env = |n: &str| match n {
            "DB" => Some("sqlite://x.db".to_owned()),
            "BROKERS" => Some("k:9092".to_owned()),
            "PFX" => Some("prod.".to_owned()),
            "TOKEN" => Some("-0123456789abcdef".to_owned()),
            _ => None,
        };
        let config = Config::load_layered(&f.0, env, &[]).expect("all set");
        let kafka = config.kafka().expect("kafka");
        assert_eq!(kafka.topic_prefix, "prod.", "expanded, not taken literally");
        assert_eq!(kafka.brokers, "k:9092");
        assert_eq!(config.database_url().expect("url"), "sqlite://x.db");
    }

    mod tempfile_path {
        pub struct Path(pub std::path::PathBuf);
        impl Path {
            pub fn with(text: &str) -> Self {
                let path = std::env::temp_dir()
                    .join(format!("opgate-config-{}.toml", uuid::Uuid::now_v7()));
                std::fs::write(&path, text).expect("write config");
                Self(path)
            }
        }
        impl Drop for Path {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn environment_and_flags_layer_over_the_file() {
        let f =
            file("[database]\nurl = \"sqlite://file.db\"\n[worker]\nlease_ms = 9000\nbatch = 4\n");
        let env = |name: &str| match name {
            "OPGATE_DATABASE_URL" => Some("postgres://db/opgate".to_owned()),
            "OPGATE_WORKER_LEASE_MS" => Some("7000".to_owned()),
            "OPGATE_KAFKA_BROKERS" => Some("k1:9092,k2:9092".to_owned()),
            _ => None,
        };
        let config = Config::load_layered(
            &f.0,
            env,
            &[
                "worker.lease_ms=5000".into(),
                "api.listen=0.0.0.0:9000".into(),
            ],
        )
        .expect("layered config");
        assert_eq!(config.database_url().expect("url"), "postgres://db/opgate");
        assert_eq!(
            config.worker.lease_ms,
            Some(5000),
            "--set beats the environment"
        );
        assert_eq!(
            config.worker.batch,
            Some(4),
            "the file where nothing overrides"
        );
        assert_eq!(config.kafka().expect("kafka").brokers, "k1:9092,k2:9092");
        assert_eq!(
            config.api.expect("api").listen,
            "0.0.0.0:9000".parse().expect("addr")
        );
    }

    #[test]
    fn string_keys_and_librdkafka_properties_stay_strings() {
        let f = file("[kafka]\nbrokers = \"k:9092\"\n");
        let env = |name: &str| (name == "OPGATE_KAFKA_GROUP_ID").then(|| "12345".to_owned());
        let config = Config::load_layered(
            &f.0,
            env,
            &[
                "kafka.client.linger.ms=5".into(),
                "kafka.client.security.protocol=SASL_SSL".into(),
            ],
        )
        .expect("layered");
        let kafka = config.kafka().expect("kafka");
        assert_eq!(kafka.group_id, "12345");
        let client = kafka.client_config_with(|_| None).expect("client config");
        assert_eq!(client.get("linger.ms"), Some("5"));
        assert_eq!(client.get("security.protocol"), Some("SASL_SSL"));
    }

    #[test]
    fn a_bad_layered_value_names_the_key_and_its_source() {
        let f = file("[worker]\nlease_ms = 9000\n");
        let env = |name: &str| (name == "OPGATE_WORKER_LEASE_MS").then(|| "soon".to_owned());
        let err = Config::load_layered(&f.0, env, &[]).expect_err("not a number");
        let text = format!("{err:#}");
        assert!(text.contains("lease_ms"), "{text}");
        assert!(text.contains("OPGATE_WORKER_LEASE_MS"), "{text}");
        assert!(
            text.contains(
                "OPGATE_WORKER_LEASE_MS (worker.lease_ms): invalid type: string \"soon\""
            ),
            "the key's complaint, without the re-serialized text: {text}"
        );
        assert!(!text.contains("line "), "{text}");
        // With a variable of the file unset as well, both are said, and a key a layer
        // overrides needs none of the file's variables.
        let f2 = file(
            "[database]\nurl = \"${DB_URL}\"\n[kafka]\nbrokers = \"${BROKERS}\"\n[worker]\nlease_ms = 9000\n",
        );
        let env = |name: &str| match name {
            "OPGATE_WORKER_LEASE_MS" => Some("soon".to_owned()),
            "OPGATE_DATABASE_URL" => Some("sqlite://x.db".to_owned()),
            _ => None,
        };
        let text = format!(
            "{:#}",
            Config::load_layered(&f2.0, env, &[]).expect_err("two problems")
        );
        assert!(
            text.contains("not set: BROKERS;") && !text.contains("DB_URL"),
            "{text}"
        );
        assert!(
            text.contains("OPGATE_WORKER_LEASE_MS (worker.lease_ms)"),
            "{text}"
        );
        let config = Config::load_layered(
            &f2.0,
            |_| None,
            &[
                "database.url=sqlite://y.db".into(),
                "kafka.brokers=k:1".into(),
            ],
        )
        .expect("every variable's key overridden");
        assert_eq!(config.database_url().expect("url"), "sqlite://y.db");
        let err = Config::load_layered(&f.0, |_| None, &["worker.lease_msx=1".into()])
            .expect_err("unknown key");
        let text = format!("{err:#}");
        assert!(
            text.contains("lease_msx") && text.contains("--set worker.lease_msx"),
            "{text}"
        );
        let err = Config::load_layered(&f.0, |_| None, &["tools.name=x".into()])
            .expect_err("tools is an array");
        assert!(format!("{err:#}").contains("--set tools.name"), "{err:#}");
        // Variables that are not config keys are never read as config.
        let config = Config::load_layered(
            &f.0,
            |name: &str| (name == "OPGATE_TOKEN").then(|| "secret".to_owned()),
            &[],
        )
        .expect("unrelated variables are ignored");
        assert_eq!(config.worker.lease_ms, Some(9000));
    }
}
