//! The proposal: what an agent asks opgate to do, as published on `opgate.proposals`.
//!
//! Decoding is strict and names the field at fault, because the error travels back to
//! the agent (a result message) and to a person (the DLQ). Unknown top-level fields are
//! refused: a typo such as `arguments` for `args` must not silently drop the arguments.

use serde_json::{Map, Value};

use crate::input;

/// Size and shape limits applied while decoding a proposal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest accepted message, in bytes.
    pub max_message_bytes: usize,
    /// Largest accepted `args` object, in bytes of its compact JSON encoding.
    pub max_args_bytes: usize,
    /// Deepest accepted nesting of `args` (the `args` object itself is depth 1).
    pub max_args_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 1024 * 1024,
            max_args_bytes: 64 * 1024,
            max_args_depth: 16,
        }
    }
}

/// The business entity a proposal acts on; it scopes the key and serializes mutations.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Entity {
    /// Entity type, e.g. `order`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Entity id, e.g. `order_123`.
    pub id: String,
}

/// A decoded, shape-checked proposal. Tool-specific validation happens in
/// [`crate::envelope::prepare`].
#[derive(Debug, Clone, PartialEq)]
pub struct Proposal {
    /// Unique id of this proposal event; the inbox dedupes redeliveries on it.
    pub event_id: String,
    /// Tenant or environment scope of the idempotency key.
    pub namespace: String,
    /// The agent that proposed it.
    pub agent_id: Option<String>,
    /// The agent workflow this proposal belongs to.
    pub workflow_id: Option<String>,
    /// The run of the workflow.
    pub run_id: Option<String>,
    /// The step within the workflow.
    pub step: Option<u64>,
    /// The registered tool to call.
    pub tool: String,
    /// The intent label, e.g. `collect_payment_for_order`.
    pub intent: Option<String>,
    /// The entity acted on.
    pub entity: Entity,
    /// Raw arguments, always a JSON object.
    pub args: Map<String, Value>,
}

/// The namespace used when a proposal names none.
pub const DEFAULT_NAMESPACE: &str = "default";

const FIELDS: &[&str] = &[
    "event_id",
    "namespace",
    "agent_id",
    "workflow_id",
    "run_id",
    "step",
    "tool",
    "intent",
    "entity",
    "args",
];

/// Why a message is not a valid proposal. Every variant names the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposalError {
    /// The bytes are not JSON (or not UTF-8).
    #[error("message is not valid JSON: {0}")]
    NotJson(String),
    /// The message is larger than the limit.
    #[error("message is {actual} bytes, more than the limit of {max}")]
    MessageTooLarge {
        /// Limit in bytes.
        max: usize,
        /// Size seen.
        actual: usize,
    },
    /// A required field is absent or null.
    #[error("field `{field}` is missing")]
    Missing {
        /// Field path.
        field: String,
    },
    /// A field has the wrong JSON type.
    #[error("field `{field}` must be {expected}")]
    WrongType {
        /// Field path.
        field: String,
        /// What was expected, e.g. "a string".
        expected: &'static str,
    },
    /// A string field is empty or only whitespace.
    #[error("field `{field}` must not be empty")]
    Empty {
        /// Field path.
        field: String,
    },
    /// A field whose value is not allowed.
    #[error("field `{field}` {message}")]
    Invalid {
        /// Field path.
        field: String,
        /// What is wrong.
        message: &'static str,
    },
    /// A field opgate does not know.
    #[error("field `{field}` is not a proposal field")]
    UnknownField {
        /// Field path.
        field: String,
    },
    /// `args` is larger than the limit.
    #[error("field `args` is {actual} bytes, more than the limit of {max}")]
    ArgsTooLarge {
        /// Limit in bytes.
        max: usize,
        /// Size seen.
        actual: usize,
    },
    /// An object has the same key twice (`{"amount": "1.00", "amount": "1000.00"}`).
    #[error("field `{field}` appears twice in one object; duplicate keys are ambiguous")]
    DuplicateKey {
        /// Path of the repeated key.
        field: String,
    },
    /// `args` nests deeper than the limit.
    #[error("field `args` nests {actual} levels deep, more than the limit of {max}")]
    ArgsTooDeep {
        /// Limit in levels.
        max: usize,
        /// Depth seen.
        actual: usize,
    },
}

impl ProposalError {
    /// A stable, machine-readable reason for DLQ records and result messages.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson(_) => "not_json",
            Self::MessageTooLarge { .. } | Self::ArgsTooLarge { .. } | Self::ArgsTooDeep { .. } => {
                "oversize"
            }
            Self::Missing { .. }
            | Self::WrongType { .. }
            | Self::Empty { .. }
            | Self::Invalid { .. }
            | Self::DuplicateKey { .. }
            | Self::UnknownField { .. } => "schema_violation",
        }
    }

    /// The field at fault, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Missing { field }
            | Self::WrongType { field, .. }
            | Self::Empty { field }
            | Self::Invalid { field, .. }
            | Self::DuplicateKey { field }
            | Self::UnknownField { field } => Some(field),
            Self::ArgsTooLarge { .. } | Self::ArgsTooDeep { .. } => Some("args"),
            Self::NotJson(_) | Self::MessageTooLarge { .. } => None,
        }
    }
}

impl Proposal {
    /// Decodes a proposal from the bytes of a Kafka message value or an HTTP body.
    pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Self, ProposalError> {
        if bytes.len() > limits.max_message_bytes {
            return Err(ProposalError::MessageTooLarge {
                max: limits.max_message_bytes,
                actual: bytes.len(),
            });
        }
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| ProposalError::NotJson(e.to_string()))?;
        input::find_duplicate_key(bytes).map_err(|field| ProposalError::DuplicateKey { field })?;
        Self::from_value(value, limits)
    }

    /// Decodes a proposal from an already parsed JSON value.
    pub fn from_value(value: Value, limits: &Limits) -> Result<Self, ProposalError> {
        let Value::Object(mut obj) = value else {
            return Err(ProposalError::WrongType {
                field: "(message)".into(),
                expected: "a JSON object",
            });
        };
        if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(ProposalError::UnknownField {
                field: input::printable(unknown),
            });
        }
        let args = match obj.remove("args") {
            None | Some(Value::Null) => return Err(missing("args")),
            Some(Value::Object(args)) => args,
            Some(_) => return Err(wrong_type("args", "a JSON object")),
        };
        check_args_limits(&args, limits)?;
        if let Some(field) = obj
            .iter()
            .find_map(|(k, v)| input::find_nul(v, k))
            .or_else(|| input::find_nul(&Value::Object(args.clone()), "args"))
        {
            return Err(ProposalError::Invalid {
                field,
                message: "must not contain NUL (U+0000)",
            });
        }
        let proposal = Self {
            event_id: required_str(&mut obj, "event_id")?,
            namespace: match optional_str(&mut obj, "namespace")? {
                None => DEFAULT_NAMESPACE.to_owned(),
                Some(ns) if valid_namespace(&ns) => ns,
                Some(_) => {
                    return Err(ProposalError::Invalid {
                        field: "namespace".into(),
                        message: "must be 1-64 characters of A-Z a-z 0-9 . _ -",
                    });
                }
            },
            agent_id: optional_str(&mut obj, "agent_id")?,
            workflow_id: optional_str(&mut obj, "workflow_id")?,
            run_id: optional_str(&mut obj, "run_id")?,
            step: match obj.remove("step") {
                None | Some(Value::Null) => None,
                // The ledger stores steps as signed 64-bit integers.
                Some(Value::Number(n)) => Some(
                    n.as_u64()
                        .filter(|s| i64::try_from(*s).is_ok())
                        .ok_or_else(|| wrong_type("step", "an integer from 0 to 2^63-1"))?,
                ),
                Some(_) => return Err(wrong_type("step", "an integer from 0 to 2^63-1")),
            },
            tool: required_str(&mut obj, "tool")?,
            intent: optional_str(&mut obj, "intent")?,
            entity: decode_entity(obj.remove("entity"))?,
            args,
        };
        proposal.check_ids()?;
        Ok(proposal)
    }

    /// Every id is at most [`input::MAX_ID_BYTES`] and free of control characters: ids
    /// land in keys, provider headers, database indexes and log lines.
    fn check_ids(&self) -> Result<(), ProposalError> {
        let ids = [
            ("event_id", Some(&self.event_id)),
            ("namespace", Some(&self.namespace)),
            ("agent_id", self.agent_id.as_ref()),
            ("workflow_id", self.workflow_id.as_ref()),
            ("run_id", self.run_id.as_ref()),
            ("tool", Some(&self.tool)),
            ("intent", self.intent.as_ref()),
            ("entity.type", Some(&self.entity.kind)),
            ("entity.id", Some(&self.entity.id)),
        ];
        for (field, value) in ids {
            if let Some(Err(problem)) = value.map(|v| input::check_id(v)) {
                return Err(ProposalError::Invalid {
                    field: field.to_owned(),
                    message: problem.message(),
                });
            }
        }
        Ok(())
    }

    /// The Kafka key agents use for this proposal: `{entity_type}:{entity_id}`.
    pub fn kafka_key(&self) -> String {
        format!("{}:{}", self.entity.kind, self.entity.id)
    }

    /// sha256 of the proposal's canonical content (every field, args in canonical JSON
    /// as sent): a redelivery has the same; the same event id with another fingerprint is
    /// an `event_id_conflict`, never mapped to the first decision.
    pub fn content_fingerprint(&self) -> String {
        let content = serde_json::json!({
            "namespace": self.namespace,
            "agent_id": self.agent_id,
            "workflow_id": self.workflow_id,
            "run_id": self.run_id,
            "step": self.step,
            "tool": self.tool,
            "intent": self.intent,
            "entity": {"type": self.entity.kind, "id": self.entity.id},
            "args": self.args,
        });
        crate::key::sha256_hex(crate::canonical::canonical_json(&content).as_bytes())
    }
}

/// Namespaces scope keys at providers too (`{namespace}/{key}`), so they are restricted
/// to characters that cannot imitate a separator.
pub fn valid_namespace(ns: &str) -> bool {
    (1..=64).contains(&ns.len())
        && ns
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn missing(field: &str) -> ProposalError {
    ProposalError::Missing {
        field: field.to_owned(),
    }
}

fn wrong_type(field: &str, expected: &'static str) -> ProposalError {
    ProposalError::WrongType {
        field: field.to_owned(),
        expected,
    }
}

fn non_empty(field: &str, value: Value) -> Result<String, ProposalError> {
    match value {
        Value::String(s) if s.trim().is_empty() => Err(ProposalError::Empty {
            field: field.to_owned(),
        }),
        Value::String(s) => Ok(s),
        _ => Err(wrong_type(field, "a string")),
    }
}

fn required_str(obj: &mut Map<String, Value>, field: &str) -> Result<String, ProposalError> {
    match obj.remove(field) {
        None | Some(Value::Null) => Err(missing(field)),
        Some(v) => non_empty(field, v),
    }
}

fn optional_str(
    obj: &mut Map<String, Value>,
    field: &str,
) -> Result<Option<String>, ProposalError> {
    match obj.remove(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => non_empty(field, v).map(Some),
    }
}

fn decode_entity(value: Option<Value>) -> Result<Entity, ProposalError> {
    let mut obj = match value {
        None | Some(Value::Null) => return Err(missing("entity")),
        Some(Value::Object(obj)) => obj,
        Some(_) => return Err(wrong_type("entity", "an object with `type` and `id`")),
    };
    if let Some(unknown) = obj.keys().find(|k| *k != "type" && *k != "id") {
        return Err(ProposalError::UnknownField {
            field: format!("entity.{}", input::printable(unknown)),
        });
    }
    Ok(Entity {
        kind: required_str(&mut obj, "type").map_err(|e| prefix(e, "entity"))?,
        id: required_str(&mut obj, "id").map_err(|e| prefix(e, "entity"))?,
    })
}

fn prefix(err: ProposalError, parent: &str) -> ProposalError {
    match err {
        ProposalError::Missing { field } => ProposalError::Missing {
            field: format!("{parent}.{field}"),
        },
        ProposalError::WrongType { field, expected } => ProposalError::WrongType {
            field: format!("{parent}.{field}"),
            expected,
        },
        ProposalError::Empty { field } => ProposalError::Empty {
            field: format!("{parent}.{field}"),
        },
        other => other,
    }
}

fn check_args_limits(args: &Map<String, Value>, limits: &Limits) -> Result<(), ProposalError> {
    fn depth(value: &Value) -> usize {
        match value {
            Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
            Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }
    let actual = 1 + args.values().map(depth).max().unwrap_or(0);
    if actual > limits.max_args_depth {
        return Err(ProposalError::ArgsTooDeep {
            max: limits.max_args_depth,
            actual,
        });
    }
    let size = serde_json::to_vec(args)
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    if size > limits.max_args_bytes {
        return Err(ProposalError::ArgsTooLarge {
            max: limits.max_args_bytes,
            actual: size,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const EXAMPLE: &str = r#"{"event_id": "evt-7f3a", "namespace": "acme", "agent_id": "support-bot",
        "workflow_id": "wf-1", "run_id": "run-1", "step": 3,
        "tool": "capture_payment", "intent": "collect_payment_for_order",
        "entity": {"type": "order", "id": "order_123"},
        "args": {"amount": "49.00", "currency": "usd"}}"#;

    fn decode(value: Value) -> Result<Proposal, ProposalError> {
        Proposal::decode(value.to_string().as_bytes(), &Limits::default())
    }

    fn example() -> Value {
        serde_json::from_str(EXAMPLE).expect("example is json")
    }

    fn with(mut base: Value, path: &[&str], value: Option<Value>) -> Value {
        let (last, parents) = path.split_last().expect("path");
        let mut cursor = &mut base;
        for p in parents {
            cursor = cursor.get_mut(*p).expect("parent");
        }
        let obj = cursor.as_object_mut().expect("object");
        match value {
            Some(v) => obj.insert((*last).to_owned(), v),
            None => obj.remove(*last),
        };
        base
    }

    #[test]
    fn decodes_the_design_example() {
        let p = Proposal::decode(EXAMPLE.as_bytes(), &Limits::default()).expect("valid");
        assert_eq!(p.event_id, "evt-7f3a");
        assert_eq!(p.namespace, "acme");
        assert_eq!(p.step, Some(3));
        assert_eq!(p.entity.id, "order_123");
        assert_eq!(p.kafka_key(), "order:order_123");
        assert_eq!(p.args.get("currency"), Some(&json!("usd")));
    }

    #[test]
    fn namespace_defaults() {
        let p = decode(with(example(), &["namespace"], None)).expect("valid");
        assert_eq!(p.namespace, DEFAULT_NAMESPACE);
    }

    #[test]
    fn each_bad_input_names_its_field() {
        let cases: Vec<(Value, &str, &str)> = vec![
            (with(example(), &["tool"], None), "tool", "missing"),
            (with(example(), &["tool"], Some(json!(7))), "tool", "type"),
            (
                with(example(), &["tool"], Some(json!("  "))),
                "tool",
                "empty",
            ),
            (with(example(), &["event_id"], None), "event_id", "missing"),
            (with(example(), &["entity"], None), "entity", "missing"),
            (
                with(example(), &["entity", "id"], Some(json!(""))),
                "entity.id",
                "empty",
            ),
            (
                with(example(), &["entity", "type"], None),
                "entity.type",
                "missing",
            ),
            (
                with(example(), &["entity", "colour"], Some(json!("x"))),
                "entity.colour",
                "unknown",
            ),
            (
                with(example(), &["args"], Some(json!([1, 2]))),
                "args",
                "type",
            ),
            (with(example(), &["args"], None), "args", "missing"),
            (with(example(), &["step"], Some(json!(-1))), "step", "type"),
            (with(example(), &["step"], Some(json!(1.5))), "step", "type"),
            (
                with(example(), &["step"], Some(json!(u64::MAX))),
                "step",
                "type",
            ),
            (
                with(example(), &["arguments"], Some(json!({}))),
                "arguments",
                "unknown",
            ),
        ];
        for (input, field, kind) in cases {
            let err = decode(input).expect_err(field);
            assert_eq!(err.field(), Some(field), "{err}");
            assert_eq!(err.reason(), "schema_violation", "{err}");
            let matches_kind = matches!(
                (&err, kind),
                (ProposalError::Missing { .. }, "missing")
                    | (ProposalError::WrongType { .. }, "type")
                    | (ProposalError::Empty { .. }, "empty")
                    | (ProposalError::UnknownField { .. }, "unknown")
                    | (ProposalError::Invalid { .. }, "invalid")
            );
            assert!(matches_kind, "{field}: expected {kind}, got {err:?}");
            assert!(err.to_string().contains(field), "{err}");
        }
    }

    /// DESIGN.md section 9: NUL anywhere, control characters and over-long values in
    /// ids, duplicate keys — each refused, naming the field.
    #[test]
    fn hostile_input_is_refused_naming_the_field() {
        let long = "x".repeat(257);
        let mut cases: Vec<(String, &str)> = Vec::new();
        for (path, field) in [
            (&["event_id"][..], "event_id"),
            (&["agent_id"][..], "agent_id"),
            (&["workflow_id"][..], "workflow_id"),
            (&["run_id"][..], "run_id"),
            (&["tool"][..], "tool"),
            (&["intent"][..], "intent"),
            (&["entity", "type"][..], "entity.type"),
            (&["entity", "id"][..], "entity.id"),
        ] {
            for bad in [
                "a\\u0000b",
                "a\\nb",
                "a\\rb",
                "a\\u0001",
                "a\\u007f",
                long.as_str(),
            ] {
                let doc = with(example(), path, Some(json!("PLACEHOLDER")))
                    .to_string()
                    .replace("PLACEHOLDER", bad);
                cases.push((doc, field));
            }
        }
        // NUL inside args: values, nested values and argument names.
        let nul_value = with(example(), &["args", "note"], Some(json!("PLACEHOLDER")))
            .to_string()
            .replace("PLACEHOLDER", "hi\\u0000there");
        cases.push((nul_value, "args.note"));
        let nested = with(
            example(),
            &["args", "items"],
            Some(json!([{"n": "PLACEHOLDER"}])),
        )
        .to_string()
        .replace("PLACEHOLDER", "\\u0000");
        cases.push((nested, "args.items[0].n"));
        let nul_name = example()
            .to_string()
            .replace("\"currency\"", "\"cur\\u0000rency\"");
        cases.push((nul_name, "args.cur\\0rency"));
        // Duplicate keys, at the top level and inside args.
        let dup_args = EXAMPLE.replace(
            r#""amount": "49.00""#,
            r#""amount": "1.00", "amount": "1000.00""#,
        );
        cases.push((dup_args, "args.amount"));
        let dup_top = EXAMPLE.replace(
            r#""tool": "capture_payment""#,
            r#""tool": "a", "tool": "capture_payment""#,
        );
        cases.push((dup_top, "tool"));
        let dup_entity = EXAMPLE.replace(
            r#""id": "order_123""#,
            r#""id": "order_1", "id": "order_123""#,
        );
        cases.push((dup_entity, "entity.id"));
        for (doc, field) in cases {
            let err = Proposal::decode(doc.as_bytes(), &Limits::default())
                .expect_err(&format!("{doc} must be refused"));
            assert_eq!(err.field(), Some(field), "{doc}: {err}");
            assert_eq!(err.reason(), "schema_violation", "{err}");
            // The message names the field, with control characters escaped.
            assert!(!err.to_string().chars().any(input::is_control), "{err:?}");
        }
    }

    #[test]
    fn control_characters_outside_ids_and_long_ids_at_the_limit_are_fine() {
        let body = with(
            example(),
            &["args", "body"],
            Some(json!("Hello,\n\tworld\r\n")),
        );
        let p = decode(body).expect("newlines in an argument value are text");
        assert_eq!(p.args["body"], json!("Hello,\n\tworld\r\n"));
        let id = "é".repeat(128); // 256 bytes
        let p = decode(with(example(), &["entity", "id"], Some(json!(id)))).expect("256 bytes");
        assert_eq!(p.entity.id.len(), 256);
    }

    #[test]
    fn not_json_and_not_an_object() {
        let err = Proposal::decode(b"{not json", &Limits::default()).expect_err("bad");
        assert_eq!(err.reason(), "not_json");
        let err = Proposal::decode(&[0xff, 0xfe], &Limits::default()).expect_err("bad");
        assert_eq!(err.reason(), "not_json");
        let err = Proposal::decode(b"[1]", &Limits::default()).expect_err("bad");
        assert_eq!(err.reason(), "schema_violation");
    }

    #[test]
    fn limits_are_configurable_and_enforced() {
        let limits = Limits {
            max_message_bytes: 10_000,
            max_args_bytes: 64,
            max_args_depth: 3,
        };
        let big = with(example(), &["args", "note"], Some(json!("x".repeat(100))));
        let err = Proposal::decode(big.to_string().as_bytes(), &limits).expect_err("big");
        assert!(
            matches!(err, ProposalError::ArgsTooLarge { max: 64, .. }),
            "{err:?}"
        );
        assert_eq!(err.reason(), "oversize");

        let deep = with(
            example(),
            &["args", "a"],
            Some(json!({"b": {"c": {"d": 1}}})),
        );
        let err = Proposal::decode(deep.to_string().as_bytes(), &limits).expect_err("deep");
        assert!(
            matches!(err, ProposalError::ArgsTooDeep { max: 3, actual: 4 }),
            "{err:?}"
        );

        let ok = with(example(), &["args", "a"], Some(json!({"b": 1})));
        Proposal::decode(ok.to_string().as_bytes(), &limits).expect("depth 2 is fine");

        let tiny = Limits {
            max_message_bytes: 20,
            ..limits
        };
        let err = Proposal::decode(EXAMPLE.as_bytes(), &tiny).expect_err("message too large");
        assert!(matches!(
            err,
            ProposalError::MessageTooLarge { max: 20, .. }
        ));
    }
}
