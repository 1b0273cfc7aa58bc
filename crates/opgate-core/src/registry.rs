//! The tool registry: the `[[tools]]` and `[[agents]]` tables of the config file.
//!
//! Tools are declared by people, never discovered from the model. The raw, serde-facing
//! shapes ([`ToolConfig`], [`AgentConfig`]) are validated once into [`Registry`]; every
//! validation error names the tool (or agent) and the field at fault.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::canonical::Normalizer;
use crate::retry::{OnExhausted, RetryPolicy};
use crate::schema::ArgsSchema;
use crate::template::{Placeholder, Template};

/// How a tool's effect behaves under repetition; it decides the retry policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SideEffectClass {
    /// No side effect; safe to repeat.
    Read,
    /// A write inside our own boundary.
    InternalWrite,
    /// An external write that honours an idempotency key.
    ExternalIdempotent,
    /// An external write that does not dedupe.
    ExternalNonIdempotent,
    /// Money, regulated or otherwise irreversible actions.
    Irreversible,
}

impl SideEffectClass {
    /// Every class, for exhaustive tests.
    pub const ALL: [Self; 5] = [
        Self::Read,
        Self::InternalWrite,
        Self::ExternalIdempotent,
        Self::ExternalNonIdempotent,
        Self::Irreversible,
    ];

    /// The config and database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::InternalWrite => "internal_write",
            Self::ExternalIdempotent => "external_idempotent",
            Self::ExternalNonIdempotent => "external_non_idempotent",
            Self::Irreversible => "irreversible",
        }
    }

    /// Parses the config and database spelling.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == text)
    }

    /// True for every class but `read`.
    pub fn is_write(self) -> bool {
        self != Self::Read
    }
}

/// Whether a person must approve before dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    /// Dispatch without approval.
    #[default]
    None,
    /// Wait in `awaiting_approval`.
    Required,
}

/// How the idempotency key is derived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyStrategy {
    /// From tool, declared intent, entity, canonical args and key version.
    #[default]
    Business,
    /// From workflow_id, step and tool; differing args are a key conflict.
    WorkflowStep,
}

/// What to do with arguments the tool does not declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownArgs {
    /// Keep them; they are part of the canonical args and of a hash-derived key.
    #[default]
    Keep,
    /// Reject the proposal, naming the argument.
    Reject,
}

/// How a 5xx answer is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FiveXx {
    /// The provider may have committed: reconcile before anything is resent.
    #[default]
    Unknown,
    /// The provider guarantees a 5xx did not commit: retry with the same key.
    Retryable,
}

/// One normalizer name or a list applied in order, as written in `[tools.args]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum NormalizerConfig {
    /// `amount = "money_minor"`.
    One(String),
    /// `currency = ["trim", "upper"]`.
    Many(Vec<String>),
}

/// `[tools.adapter]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterConfig {
    /// Adapter kind; `http` is the one built in.
    pub kind: String,
    /// HTTP method for dispatch (default POST).
    #[serde(default)]
    pub method: Option<String>,
    /// Dispatch URL (may use `${ENV}` and `{placeholders}`).
    pub url: String,
    /// Extra request headers; values may use `${ENV}` for secrets.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Request timeout in milliseconds (default 5000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Header that carries the idempotency key, when the provider honours one.
    #[serde(default)]
    pub idempotency_header: Option<String>,
    /// How long the provider remembers keys, e.g. `24h`.
    #[serde(default)]
    pub provider_retention: Option<String>,
    /// URL to look an operation up by key (`{key}` placeholder).
    #[serde(default)]
    pub lookup_url: Option<String>,
    /// How a 5xx is read (default `unknown`).
    #[serde(default)]
    pub five_xx: FiveXx,
    /// JSON pointer to the provider's object id in a success body, e.g. `/charge_id`.
    #[serde(default)]
    pub external_id_pointer: Option<String>,
    /// JSON pointer to the part of the body kept as the result (default: all of it).
    #[serde(default)]
    pub result_pointer: Option<String>,
    /// Body field that carries the idempotency key, for providers that dedupe on a body
    /// field (`client_reference`, `client_token`) rather than a header.
    #[serde(default)]
    pub key_body_field: Option<String>,
    /// How long after an attempt a lookup miss is not yet proof that nothing happened
    /// (providers with eventually consistent lookups), e.g. `10s` (default 5s).
    #[serde(default)]
    pub lookup_grace: Option<String>,
}

/// `[tools.retry]` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts allowed, the first included (default 5).
    pub max_attempts: Option<u32>,
    /// Base delay in milliseconds (default 200).
    pub base_ms: Option<u64>,
    /// Largest delay in milliseconds (default 30000).
    pub max_ms: Option<u64>,
    /// Longest time from first attempt to giving up, e.g. `10m` (default 10m).
    pub max_elapsed: Option<String>,
    /// Final state when the budget runs out (default `needs_attention`, `failed_permanent` for reads).
    pub on_exhausted: Option<OnExhausted>,
}

/// `[tools.compensation]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompensationConfig {
    /// The declared tool that undoes this one.
    pub tool: String,
    /// Arguments of the compensating call; string values are templates.
    #[serde(default)]
    pub args: Map<String, Value>,
}

/// `exclusive_group` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExclusiveGroupConfig {
    /// Group name shared by the tools that exclude each other.
    pub name: String,
    /// How long one member's operation on an entity excludes the others, e.g. `1h`.
    pub window: String,
}

/// One `[[tools]]` table as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// Tool name, as proposals name it.
    pub name: String,
    /// What the tool does, for people and models (served over MCP).
    #[serde(default)]
    pub description: Option<String>,
    /// JSON Schema (draft 2020-12) of the arguments as proposed: an inline table, or the
    /// path of a JSON file (relative to the config file).
    #[serde(default)]
    pub args_schema: Option<Value>,
    /// Side-effect class.
    pub side_effect_class: SideEffectClass,
    /// Entity type the tool acts on; proposals for another type are rejected.
    #[serde(default)]
    pub entity: Option<String>,
    /// Key template for the `business` strategy.
    #[serde(default)]
    pub key: Option<String>,
    /// Key strategy (default `business`).
    #[serde(default)]
    pub key_strategy: KeyStrategy,
    /// Key version, appended as `:v{n}` (default 1).
    #[serde(default)]
    pub key_version: Option<u32>,
    /// Approval requirement.
    #[serde(default)]
    pub approval: Approval,
    /// Declared intent labels; when present the intent must be one and is part of the key.
    #[serde(default)]
    pub intents: Vec<String>,
    /// Per-argument normalizers.
    #[serde(default)]
    pub args: BTreeMap<String, NormalizerConfig>,
    /// Arguments that must be present (after defaults).
    #[serde(default)]
    pub required: Vec<String>,
    /// Values for absent arguments, applied before normalization.
    #[serde(default)]
    pub defaults: Map<String, Value>,
    /// Undeclared arguments: keep (default) or reject.
    #[serde(default)]
    pub unknown_args: UnknownArgs,
    /// Suppress the same semantic action within this window, e.g. `24h`.
    #[serde(default)]
    pub dedupe_window: Option<String>,
    /// Tools in one group must not both act on an entity within the window.
    #[serde(default)]
    pub exclusive_group: Option<ExclusiveGroupConfig>,
    /// How the tool is called.
    #[serde(default)]
    pub adapter: Option<AdapterConfig>,
    /// Retry budget.
    #[serde(default)]
    pub retry: RetryConfig,
    /// How to undo the tool's effect.
    #[serde(default)]
    pub compensation: Option<CompensationConfig>,
}

/// One `[[agents]]` table: which tools an agent may propose.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The agent id proposals carry in `agent_id`.
    pub id: String,
    /// Tools this agent may propose.
    pub tools: Vec<String>,
    /// When set, ingest requires its Kafka records to carry header `opgate-signature`:
    /// the hex HMAC-SHA256 of the record's value under this secret (`${VAR}` expanded by
    /// the ingest worker).
    #[serde(default)]
    pub signing_secret: Option<String>,
}

/// The `tools` and `agents` part of a config file; other tables are ignored here.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RegistryConfig {
    /// `[[tools]]`.
    #[serde(default)]
    pub tools: Vec<ToolConfig>,
    /// `[[agents]]`; when empty no allowlist applies.
    #[serde(default)]
    pub agents: Vec<AgentConfig>,
}

/// A validated adapter description (the tools crate turns it into a client).
#[derive(Debug, Clone)]
pub struct Adapter {
    /// The config as written, with defaults still unapplied for adapter-specific fields.
    pub config: AdapterConfig,
    /// Request timeout.
    pub timeout: Duration,
    /// Provider key retention, when the provider honours idempotency keys.
    pub provider_retention: Option<Duration>,
    /// Parsed dispatch URL.
    pub url: Template,
    /// Parsed lookup URL.
    pub lookup_url: Option<Template>,
    /// How long a lookup miss is not yet proof.
    pub lookup_grace: Duration,
}

/// A validated compensation.
#[derive(Debug, Clone)]
pub struct Compensation {
    /// The compensating tool.
    pub tool: String,
    /// Argument templates (string values) and literals.
    pub args: Map<String, Value>,
}

/// A validated exclusive group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExclusiveGroup {
    /// Group name.
    pub name: String,
    /// Exclusion window.
    pub window: Duration,
}

/// A validated tool.
#[derive(Debug, Clone)]
pub struct Tool {
    /// Tool name.
    pub name: String,
    /// What the tool does.
    pub description: Option<String>,
    /// The arguments' schema, checked before normalization.
    pub args_schema: Option<ArgsSchema>,
    /// Side-effect class.
    pub side_effect_class: SideEffectClass,
    /// Required entity type, if any.
    pub entity: Option<String>,
    /// Key strategy.
    pub key_strategy: KeyStrategy,
    /// Parsed key template for the business strategy.
    pub key_template: Option<Template>,
    /// Key version.
    pub key_version: u32,
    /// Approval requirement.
    pub approval: Approval,
    /// Declared intents (empty: intent is recorded only).
    pub intents: Vec<String>,
    /// Normalizers per argument.
    pub args: BTreeMap<String, Vec<Normalizer>>,
    /// Required arguments.
    pub required: Vec<String>,
    /// Defaults for absent arguments.
    pub defaults: Map<String, Value>,
    /// Undeclared-argument policy.
    pub unknown_args: UnknownArgs,
    /// Dedupe window.
    pub dedupe_window: Option<Duration>,
    /// Exclusive group.
    pub exclusive_group: Option<ExclusiveGroup>,
    /// Adapter description.
    pub adapter: Option<Adapter>,
    /// Retry budget.
    pub retry: RetryPolicy,
    /// Compensation.
    pub compensation: Option<Compensation>,
}

impl Tool {
    /// True when `name` is declared through `args`, `required` or `defaults`.
    pub fn declares_arg(&self, name: &str) -> bool {
        self.args.contains_key(name)
            || self.required.iter().any(|r| r == name)
            || self.defaults.contains_key(name)
    }

    /// How a 5xx answer is read (default `unknown` when no adapter is declared).
    pub fn five_xx(&self) -> FiveXx {
        self.adapter
            .as_ref()
            .map(|a| a.config.five_xx)
            .unwrap_or_default()
    }
}

/// A configuration error, naming where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The TOML does not parse or has the wrong shape.
    #[error("config: {0}")]
    Toml(String),
    /// A tool field is invalid.
    #[error("tool `{tool}`: field `{field}`: {message}")]
    Tool {
        /// Tool name (or `#N` when the name itself is missing).
        tool: String,
        /// Field path inside the tool table.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// An agent field is invalid.
    #[error("agent `{agent}`: field `{field}`: {message}")]
    Agent {
        /// Agent id.
        agent: String,
        /// Field.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// The validated set of tools and agent allowlists.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    tools: BTreeMap<String, Tool>,
    agents: BTreeMap<String, BTreeSet<String>>,
    signing: BTreeMap<String, String>,
}

impl Registry {
    /// Parses and validates the `[[tools]]` and `[[agents]]` of a TOML document.
    pub fn from_toml(text: &str) -> Result<Self, RegistryError> {
        let config: RegistryConfig =
            toml::from_str(text).map_err(|e| RegistryError::Toml(e.to_string()))?;
        Self::from_config(config)
    }

    /// Validates already deserialized tables.
    pub fn from_config(config: RegistryConfig) -> Result<Self, RegistryError> {
        let names: BTreeSet<&str> = config.tools.iter().map(|t| t.name.as_str()).collect();
        let mut tools = BTreeMap::new();
        for raw in &config.tools {
            let tool = validate_tool(raw, &names)?;
            if tools.insert(tool.name.clone(), tool).is_some() {
                return Err(tool_err(&raw.name, "name", "declared twice"));
            }
        }
        let mut agents = BTreeMap::new();
        let mut signing = BTreeMap::new();
        for agent in config.agents {
            if agents.contains_key(&agent.id) {
                return Err(RegistryError::Agent {
                    agent: agent.id.clone(),
                    field: "id".into(),
                    message: "declared twice".into(),
                });
            }
            if let Some(secret) = agent.signing_secret {
                signing.insert(agent.id.clone(), secret);
            }
            if let Some(unknown) = agent.tools.iter().find(|t| !tools.contains_key(*t)) {
                return Err(RegistryError::Agent {
                    agent: agent.id.clone(),
                    field: "tools".into(),
                    message: format!("tool `{unknown}` is not declared"),
                });
            }
            agents.insert(agent.id, agent.tools.into_iter().collect());
        }
        Ok(Self {
            tools,
            agents,
            signing,
        })
    }

    /// A tool by name.
    pub fn tool(&self, name: &str) -> Option<&Tool> {
        self.tools.get(name)
    }

    /// Every tool, by name.
    pub fn tools(&self) -> impl Iterator<Item = &Tool> {
        self.tools.values()
    }

    /// The agents whose Kafka proposals must be signed, with their secrets as written
    /// (possibly `${VAR}`).
    pub fn signing_secrets(&self) -> impl Iterator<Item = (&str, &str)> {
        self.signing.iter().map(|(a, s)| (a.as_str(), s.as_str()))
    }

    /// Whether `agent` may propose `tool`: `Ok(())`, or the rejection reason code.
    pub fn allows(&self, agent: Option<&str>, tool: &str) -> Result<(), &'static str> {
        if self.agents.is_empty() {
            return Ok(());
        }
        match agent.and_then(|a| self.agents.get(a)) {
            None => Err("unknown_agent"),
            Some(allowed) if allowed.contains(tool) => Ok(()),
            Some(_) => Err("tool_not_allowed"),
        }
    }
}

fn tool_err(tool: &str, field: &str, message: impl Into<String>) -> RegistryError {
    RegistryError::Tool {
        tool: tool.to_owned(),
        field: field.to_owned(),
        message: message.into(),
    }
}

/// Parses a human duration such as `24h`, `10m` or `500ms`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like \"10m\" or \"24h\" ({e})"))
}

fn validate_tool(raw: &ToolConfig, names: &BTreeSet<&str>) -> Result<Tool, RegistryError> {
    let name = raw.name.as_str();
    let err = |field: &str, message: String| tool_err(name, field, message);
    if name.trim().is_empty() || name.contains(':') {
        return Err(err(
            "name",
            "must be non-empty and must not contain `:`".into(),
        ));
    }
    let duration =
        |field: &str, text: &Option<String>| -> Result<Option<Duration>, RegistryError> {
            text.as_deref()
                .map(parse_duration)
                .transpose()
                .map_err(|m| err(field, m))
        };

    let mut args = BTreeMap::new();
    for (arg, spec) in &raw.args {
        let list = match spec {
            NormalizerConfig::One(one) => vec![one.clone()],
            NormalizerConfig::Many(many) => many.clone(),
        };
        let parsed = list
            .iter()
            .map(|n| {
                Normalizer::parse(n).ok_or_else(|| {
                    err(
                        &format!("args.{arg}"),
                        format!(
                            "unknown normalizer `{n}` (known: {})",
                            Normalizer::NAMES.join(", ")
                        ),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        args.insert(arg.clone(), parsed);
    }

    let args_schema = match &raw.args_schema {
        None => None,
        Some(Value::String(path)) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| err("args_schema", format!("reading {path}: {e}")))?;
            let schema = serde_json::from_str(&text)
                .map_err(|e| err("args_schema", format!("{path} is not JSON: {e}")))?;
            Some(
                ArgsSchema::compile(schema)
                    .map_err(|m| err("args_schema", format!("{path}: {m}")))?,
            )
        }
        Some(inline) => {
            Some(ArgsSchema::compile(inline.clone()).map_err(|m| err("args_schema", m))?)
        }
    };
    let mut tool = Tool {
        name: name.to_owned(),
        description: raw.description.clone(),
        args_schema,
        side_effect_class: raw.side_effect_class,
        entity: raw.entity.clone(),
        key_strategy: raw.key_strategy,
        key_template: None,
        key_version: raw.key_version.unwrap_or(1),
        approval: raw.approval,
        intents: raw.intents.clone(),
        args,
        required: raw.required.clone(),
        defaults: raw.defaults.clone(),
        unknown_args: raw.unknown_args,
        dedupe_window: duration("dedupe_window", &raw.dedupe_window)?,
        exclusive_group: None,
        adapter: None,
        retry: RetryPolicy::default_for(raw.side_effect_class),
        compensation: None,
    };
    if tool.key_version == 0 {
        return Err(err("key_version", "must be 1 or more".into()));
    }

    if let Some(source) = &raw.key {
        if tool.key_strategy == KeyStrategy::WorkflowStep {
            return Err(err(
                "key",
                "a key template only applies to the `business` key strategy".into(),
            ));
        }
        let template = Template::parse(source).map_err(|e| err("key", e.to_string()))?;
        for ph in template.placeholders() {
            let problem = match ph {
                Placeholder::Arg(arg) if !tool.declares_arg(arg) => Some(format!(
                    "placeholder `{ph}` is not provided by any declared arg (declare it under [tools.args], `required` or `defaults`)"
                )),
                Placeholder::Intent if tool.intents.is_empty() => Some(
                    "placeholder `{intent}` needs `intents` to be declared (undeclared intents are not part of the key)"
                        .to_owned(),
                ),
                Placeholder::Key | Placeholder::Result(_) => {
                    Some(format!("placeholder `{ph}` cannot be used in a key"))
                }
                _ => None,
            };
            if let Some(message) = problem {
                return Err(err("key", message));
            }
        }
        tool.key_template = Some(template);
    }

    if let Some(group) = &raw.exclusive_group {
        tool.exclusive_group = Some(ExclusiveGroup {
            name: group.name.clone(),
            window: parse_duration(&group.window).map_err(|m| err("exclusive_group.window", m))?,
        });
    }

    if let Some(adapter) = &raw.adapter {
        if adapter.kind != "http" {
            return Err(err(
                "adapter.kind",
                format!("unknown adapter kind `{}` (known: http)", adapter.kind),
            ));
        }
        let url = Template::parse(&adapter.url).map_err(|e| err("adapter.url", e.to_string()))?;
        if let Some(bad) = url
            .placeholders()
            .find(|p| matches!(p, Placeholder::Result(_)))
        {
            return Err(err(
                "adapter.url",
                format!("placeholder `{bad}` is not available at dispatch"),
            ));
        }
        if raw.side_effect_class == SideEffectClass::ExternalNonIdempotent {
            // The class says the provider does not dedupe: settings that only make sense
            // for a provider that does would turn an ambiguous attempt into a blind resend.
            if adapter.five_xx == FiveXx::Retryable {
                return Err(err(
                    "adapter.five_xx",
                    "`retryable` would resend a call whose 500 may have been committed, and an external_non_idempotent provider cannot dedupe the resend; use `unknown` (or declare the class external_idempotent if the provider honours the key)".into(),
                ));
            }
            if adapter.provider_retention.is_some() {
                return Err(err(
                    "adapter.provider_retention",
                    "an external_non_idempotent tool does not honour keys, so no retention makes a resend safe; if the provider dedupes on `idempotency_header`, declare the class external_idempotent".into(),
                ));
            }
        }
        let lookup_url = adapter
            .lookup_url
            .as_deref()
            .map(Template::parse)
            .transpose()
            .map_err(|e| err("adapter.lookup_url", e.to_string()))?;
        // A lookup by key finds nothing unless the key was sent: it would take every
        // effect for "never happened" and let the reconciler resend it.
        let looks_up_key = lookup_url
            .as_ref()
            .is_some_and(|t| t.placeholders().any(|p| matches!(p, Placeholder::Key)));
        if looks_up_key && adapter.idempotency_header.is_none() && adapter.key_body_field.is_none()
        {
            return Err(err(
                "adapter.lookup_url",
                "looks the provider up by `{key}`, but the key is never sent: set `idempotency_header` or `key_body_field` (else every lookup misses and an effect that happened would be taken for one that did not)".into(),
            ));
        }
        tool.adapter = Some(Adapter {
            config: adapter.clone(),
            timeout: Duration::from_millis(adapter.timeout_ms.unwrap_or(5_000)),
            provider_retention: duration(
                "adapter.provider_retention",
                &adapter.provider_retention,
            )?,
            url,
            lookup_url,
            lookup_grace: duration("adapter.lookup_grace", &adapter.lookup_grace)?
                .unwrap_or(Duration::from_secs(5)),
        });
    }

    let retry = &raw.retry;
    let defaults = tool.retry;
    tool.retry = RetryPolicy {
        max_attempts: retry.max_attempts.unwrap_or(defaults.max_attempts),
        base: retry
            .base_ms
            .map(Duration::from_millis)
            .unwrap_or(defaults.base),
        max_delay: retry
            .max_ms
            .map(Duration::from_millis)
            .unwrap_or(defaults.max_delay),
        max_elapsed: duration("retry.max_elapsed", &retry.max_elapsed)?
            .unwrap_or(defaults.max_elapsed),
        on_exhausted: retry.on_exhausted.unwrap_or(defaults.on_exhausted),
    };
    if tool.retry.max_attempts == 0 {
        return Err(err("retry.max_attempts", "must be 1 or more".into()));
    }
    if tool.retry.base > tool.retry.max_delay {
        return Err(err("retry.base_ms", "must not exceed retry.max_ms".into()));
    }

    if let Some(comp) = &raw.compensation {
        if !names.contains(comp.tool.as_str()) {
            return Err(err(
                "compensation.tool",
                format!("compensation tool `{}` is not declared", comp.tool),
            ));
        }
        for (arg, value) in &comp.args {
            let Value::String(text) = value else { continue };
            let template = Template::parse(text)
                .map_err(|e| err(&format!("compensation.args.{arg}"), e.to_string()))?;
            if let Some(Placeholder::Arg(a)) = template
                .placeholders()
                .find(|p| matches!(p, Placeholder::Arg(a) if !tool.declares_arg(a)))
            {
                return Err(err(
                    &format!("compensation.args.{arg}"),
                    format!("placeholder `{{args.{a}}}` is not provided by any declared arg"),
                ));
            }
        }
        tool.compensation = Some(Compensation {
            tool: comp.tool.clone(),
            args: comp.args.clone(),
        });
    }
    Ok(tool)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of DESIGN.md section 4, plus the refund tool it names.
    pub(crate) const DESIGN_EXAMPLE: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
key_version = 1
approval = "none"
[tools.args]
amount = "money_minor"
currency = "upper"
email = "email"
[tools.adapter]
kind = "http"
url = "http://127.0.0.1:9400/payments"
timeout_ms = 2000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "http://127.0.0.1:9400/payments?idempotency_key={key}"
five_xx = "unknown"
[tools.retry]
max_attempts = 5
base_ms = 200
max_ms = 30000
max_elapsed = "10m"
on_exhausted = "needs_attention"
[tools.compensation]
tool = "refund_payment"
args = { charge_id = "{result.charge_id}" }

[[tools]]
name = "refund_payment"
side_effect_class = "irreversible"
entity = "order"
[tools.args]
charge_id = "trim"
"#;

    fn expect_err(toml: &str) -> RegistryError {
        Registry::from_toml(toml).expect_err("should be invalid")
    }

    #[test]
    fn accepts_the_design_example() {
        let registry = Registry::from_toml(DESIGN_EXAMPLE).expect("valid");
        let tool = registry.tool("capture_payment").expect("declared");
        assert_eq!(tool.side_effect_class, SideEffectClass::Irreversible);
        assert_eq!(tool.retry.max_attempts, 5);
        assert_eq!(tool.retry.max_elapsed, Duration::from_secs(600));
        assert_eq!(tool.retry.on_exhausted, OnExhausted::NeedsAttention);
        let adapter = tool.adapter.as_ref().expect("adapter");
        assert_eq!(
            adapter.provider_retention,
            Some(Duration::from_secs(86_400))
        );
        assert_eq!(adapter.timeout, Duration::from_millis(2000));
        assert_eq!(
            tool.compensation.as_ref().map(|c| c.tool.as_str()),
            Some("refund_payment")
        );
    }

    fn one_tool(body: &str) -> String {
        one_tool_of("external_idempotent", body)
    }

    fn one_tool_of(class: &str, body: &str) -> String {
        format!("[[tools]]\nname = \"t\"\nside_effect_class = \"{class}\"\n{body}")
    }

    #[test]
    fn each_error_names_the_tool_and_field() {
        let cases = [
            (
                one_tool("[tools.args]\namount = \"money\""),
                "args.amount",
                "unknown normalizer `money`",
            ),
            (
                one_tool("[tools.args]\namount = [\"trim\", \"shout\"]"),
                "args.amount",
                "unknown normalizer `shout`",
            ),
            (
                one_tool("key = \"x:{args.amout}\"\n[tools.args]\namount = \"money_minor\""),
                "key",
                "`{args.amout}` is not provided",
            ),
            (one_tool("key = \"x:{intent}\""), "key", "needs `intents`"),
            (
                one_tool("key = \"x:{colour}\""),
                "key",
                "unknown placeholder",
            ),
            (
                one_tool("dedupe_window = \"soon\""),
                "dedupe_window",
                "not a duration",
            ),
            (
                one_tool("[tools.retry]\nmax_elapsed = \"10 parsecs\""),
                "retry.max_elapsed",
                "not a duration",
            ),
            (
                one_tool("[tools.retry]\nmax_attempts = 0"),
                "retry.max_attempts",
                "1 or more",
            ),
            (
                one_tool("[tools.compensation]\ntool = \"undo\""),
                "compensation.tool",
                "`undo` is not declared",
            ),
            (
                one_tool("[tools.adapter]\nkind = \"grpc\"\nurl = \"x\""),
                "adapter.kind",
                "unknown adapter kind",
            ),
            (
                one_tool(
                    "[tools.adapter]\nkind = \"http\"\nurl = \"x\"\nprovider_retention = \"forever\"",
                ),
                "adapter.provider_retention",
                "not a duration",
            ),
            (
                one_tool("key_strategy = \"workflow_step\"\nkey = \"x\""),
                "key",
                "only applies",
            ),
            (one_tool("key_version = 0"), "key_version", "1 or more"),
            (
                one_tool_of(
                    "external_non_idempotent",
                    "[tools.adapter]\nkind = \"http\"\nurl = \"x\"\nfive_xx = \"retryable\"",
                ),
                "adapter.five_xx",
                "may have been committed",
            ),
            (
                one_tool_of(
                    "external_non_idempotent",
                    "[tools.adapter]\nkind = \"http\"\nurl = \"x\"\nidempotency_header = \"Idempotency-Key\"\nprovider_retention = \"24h\"",
                ),
                "adapter.provider_retention",
                "does not honour keys",
            ),
            (
                // Retention alone (no header) is refused too: it promises nothing.
                one_tool_of(
                    "external_non_idempotent",
                    "[tools.adapter]\nkind = \"http\"\nurl = \"x\"\nprovider_retention = \"24h\"",
                ),
                "adapter.provider_retention",
                "does not honour keys",
            ),
            (
                // A lookup by a key that never reaches the provider always misses.
                one_tool_of(
                    "external_non_idempotent",
                    "[tools.adapter]\nkind = \"http\"\nurl = \"x\"\nlookup_url = \"x?ref={key}\"",
                ),
                "adapter.lookup_url",
                "the key is never sent",
            ),
        ];
        for (toml, field, fragment) in cases {
            match expect_err(&toml) {
                RegistryError::Tool {
                    tool,
                    field: f,
                    message,
                } => {
                    assert_eq!(tool, "t");
                    assert_eq!(f, field, "{message}");
                    assert!(message.contains(fragment), "{field}: {message}");
                }
                other => panic!("{field}: unexpected {other:?}"),
            }
        }
    }

    #[test]
    fn shape_errors_come_from_toml_with_the_key() {
        let err = expect_err(&one_tool("retries = 3"));
        assert!(
            matches!(&err, RegistryError::Toml(m) if m.contains("retries")),
            "{err}"
        );
        let err = expect_err("[[tools]]\nname = \"t\"\nside_effect_class = \"sometimes\"");
        assert!(
            matches!(&err, RegistryError::Toml(m) if m.contains("sometimes")),
            "{err}"
        );
    }

    #[test]
    fn duplicate_tools_and_bad_agents_are_refused() {
        let twice = format!("{}\n{}", one_tool(""), one_tool(""));
        assert!(matches!(expect_err(&twice), RegistryError::Tool { field, .. } if field == "name"));
        let agent = format!(
            "{}\n[[agents]]\nid = \"bot\"\ntools = [\"nope\"]",
            one_tool("")
        );
        assert!(matches!(expect_err(&agent), RegistryError::Agent { agent, .. } if agent == "bot"));
        let twice = format!(
            "{}\n[[agents]]\nid = \"bot\"\ntools = [\"t\"]\nsigning_secret = \"s\"\n[[agents]]\nid = \"bot\"\ntools = [\"t\"]",
            one_tool("")
        );
        assert!(
            matches!(expect_err(&twice), RegistryError::Agent { agent, field, .. } if agent == "bot" && field == "id"),
            "a second table for one agent would silently replace the first"
        );
    }

    #[test]
    fn agent_allowlists() {
        let open = Registry::from_toml(&one_tool("")).expect("valid");
        assert_eq!(open.allows(None, "t"), Ok(()));
        let toml = format!(
            "{}\n[[tools]]\nname = \"u\"\nside_effect_class = \"read\"\n[[agents]]\nid = \"bot\"\ntools = [\"t\"]",
            one_tool("")
        );
        let closed = Registry::from_toml(&toml).expect("valid");
        assert_eq!(closed.allows(Some("bot"), "t"), Ok(()));
        assert_eq!(closed.allows(Some("bot"), "u"), Err("tool_not_allowed"));
        assert_eq!(closed.allows(Some("other"), "t"), Err("unknown_agent"));
        assert_eq!(closed.allows(None, "t"), Err("unknown_agent"));
    }
}
