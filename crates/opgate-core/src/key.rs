//! Idempotency keys, derived by opgate from the business identity of an operation —
//! never supplied by the model.
//!
//! - `business` (default): with a template, the template rendered from canonical values;
//!   without one, `{tool}:{entity_id}:{sha256 of the canonical key components}`. The
//!   components are namespace, tool, declared intent (when the tool declares intents),
//!   entity type and id, canonical args and key version.
//! - `workflow_step`: `{tool}:wf:{workflow_id}:step:{step}`, for actions whose
//!   arguments legitimately vary between retries.
//!
//! Every key ends in `:v{key_version}`; bumping a tool's `key_version` deliberately
//! starts a new identity space. Keys are unique per namespace in the ledger; adapters
//! send [`IdempotencyKey::scoped`] so two namespaces sharing a provider account never
//! collide there. Values substituted into keys escape `%` and `:` so a crafted entity id
//! cannot imitate another key's structure.
//!
//! Golden vectors in the tests pin the derivation: a change that would re-key stored
//! operations fails them.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::canonical::canonical_json;
use crate::proposal::Entity;
use crate::registry::{KeyStrategy, Tool};
use crate::template::Placeholder;

/// A derived key with the unhashed parts it came from (kept for logs and people).
#[derive(Debug, Clone, PartialEq)]
pub struct IdempotencyKey {
    /// Namespace the key is unique in.
    pub namespace: String,
    /// The key, e.g. `payment:order_123:capture:4900:USD:v1`.
    pub key: String,
    /// The canonical, unhashed components.
    pub components: Value,
}

impl IdempotencyKey {
    /// The key as sent to providers: `{namespace}/{key}`.
    pub fn scoped(&self) -> String {
        scoped_key(&self.namespace, &self.key)
    }
}

/// `{namespace}/{key}`, the form sent to providers.
pub fn scoped_key(namespace: &str, key: &str) -> String {
    format!("{namespace}/{key}")
}

/// What a key is derived from.
#[derive(Debug, Clone, Copy)]
pub struct KeyInput<'a> {
    /// Namespace.
    pub namespace: &'a str,
    /// The registered tool.
    pub tool: &'a Tool,
    /// The proposal's intent (used only when the tool declares intents).
    pub intent: Option<&'a str>,
    /// The entity.
    pub entity: &'a Entity,
    /// Workflow id (workflow_step strategy).
    pub workflow_id: Option<&'a str>,
    /// Step (workflow_step strategy).
    pub step: Option<u64>,
    /// Canonical args from [`crate::canonical::canonicalize_args`].
    pub canonical_args: &'a Value,
}

/// Why a key cannot be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The workflow_step strategy needs both fields.
    #[error("tool `{0}` keys by workflow step: `workflow_id` and `step` are required")]
    MissingWorkflowStep(String),
    /// A template argument is absent or null.
    #[error("argument `{0}` is needed by the key template")]
    MissingArg(String),
    /// A proposal field the key template uses is absent.
    #[error("field `{0}` is needed by the key template")]
    MissingField(&'static str),
}

/// Derives the idempotency key.
pub fn derive_key(input: &KeyInput<'_>) -> Result<IdempotencyKey, KeyError> {
    let tool = input.tool;
    let version = tool.key_version;
    let intent = (!tool.intents.is_empty()).then_some(input.intent).flatten();
    let (key, components) = match tool.key_strategy {
        KeyStrategy::WorkflowStep => {
            let (Some(workflow_id), Some(step)) = (input.workflow_id, input.step) else {
                return Err(KeyError::MissingWorkflowStep(tool.name.clone()));
            };
            (
                format!("{}:wf:{}:step:{step}", tool.name, escape(workflow_id)),
                json!({
                    "strategy": "workflow_step",
                    "namespace": input.namespace,
                    "tool": tool.name,
                    "workflow_id": workflow_id,
                    "step": step,
                    "key_version": version,
                }),
            )
        }
        KeyStrategy::Business => match &tool.key_template {
            Some(template) => {
                let mut values = serde_json::Map::new();
                let key = template.render(|ph| {
                    let text = placeholder_text(ph, input, intent)?;
                    values.insert(ph.to_string(), Value::String(text.clone()));
                    Ok(escape(&text))
                })?;
                (
                    key,
                    json!({
                        "strategy": "business",
                        "namespace": input.namespace,
                        "template": template.source(),
                        "values": values,
                        "key_version": version,
                    }),
                )
            }
            None => {
                let components = json!({
                    "strategy": "business",
                    "namespace": input.namespace,
                    "tool": tool.name,
                    "intent": intent,
                    "entity": {"type": input.entity.kind, "id": input.entity.id},
                    "args": input.canonical_args,
                    "key_version": version,
                });
                let digest = sha256_hex(canonical_json(&components).as_bytes());
                (
                    format!("{}:{}:{digest}", tool.name, escape(&input.entity.id)),
                    components,
                )
            }
        },
    };
    Ok(IdempotencyKey {
        namespace: input.namespace.to_owned(),
        key: format!("{key}:v{version}"),
        components,
    })
}

fn placeholder_text(
    ph: &Placeholder,
    input: &KeyInput<'_>,
    intent: Option<&str>,
) -> Result<String, KeyError> {
    Ok(match ph {
        Placeholder::Entity => input.entity.id.clone(),
        Placeholder::EntityType => input.entity.kind.clone(),
        Placeholder::Tool => input.tool.name.clone(),
        Placeholder::Namespace => input.namespace.to_owned(),
        Placeholder::Intent => intent.ok_or(KeyError::MissingField("intent"))?.to_owned(),
        Placeholder::WorkflowId => input
            .workflow_id
            .ok_or(KeyError::MissingField("workflow_id"))?
            .to_owned(),
        Placeholder::Step => input
            .step
            .ok_or(KeyError::MissingField("step"))?
            .to_string(),
        Placeholder::Arg(name) => match input.canonical_args.get(name) {
            None | Some(Value::Null) => return Err(KeyError::MissingArg(name.clone())),
            Some(Value::String(s)) => s.clone(),
            Some(other) => canonical_json(other),
        },
        // Registry validation refuses these in key templates.
        Placeholder::Key | Placeholder::Result(_) => String::new(),
    })
}

/// Lowercase hex sha256.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The fingerprint of canonical args: sha256 of their canonical JSON.
pub fn args_fingerprint(canonical_args: &Value) -> String {
    sha256_hex(canonical_json(canonical_args).as_bytes())
}

/// Escapes `%` and `:` so a value cannot imitate a separator.
pub(crate) fn escape(text: &str) -> String {
    text.replace('%', "%25").replace(':', "%3A")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::canonicalize_args;
    use crate::registry::Registry;

    const TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"

[[tools]]
name = "send_email"
side_effect_class = "external_non_idempotent"
intents = ["welcome", "receipt"]
[tools.args]
to = "email"

[[tools]]
name = "create_ticket"
side_effect_class = "external_idempotent"
key_strategy = "workflow_step"
key_version = 2
"#;

    fn key(tool: &str, intent: Option<&str>, entity: (&str, &str), args: Value) -> IdempotencyKey {
        let registry = Registry::from_toml(TOOLS).expect("valid");
        let tool = registry.tool(tool).expect("declared");
        let canonical =
            canonicalize_args(tool, args.as_object().expect("object")).expect("valid args");
        derive_key(&KeyInput {
            namespace: "acme",
            tool,
            intent,
            entity: &Entity {
                kind: entity.0.into(),
                id: entity.1.into(),
            },
            workflow_id: Some("wf-1"),
            step: Some(3),
            canonical_args: &canonical,
        })
        .expect("derivable")
    }

    /// Golden vectors: these strings are stored in production ledgers. If one changes,
    /// existing operations would be re-keyed and their duplicates would run again.
    #[test]
    fn golden_vectors() {
        let k = key(
            "capture_payment",
            None,
            ("order", "order_123"),
            json!({"amount": "49.00", "currency": "usd"}),
        );
        assert_eq!(k.key, "payment:order_123:capture:4900:USD:v1");
        assert_eq!(k.scoped(), "acme/payment:order_123:capture:4900:USD:v1");

        let k = key(
            "capture_payment",
            None,
            ("order", "a:b%c"),
            json!({"amount": 1, "currency": "JPY"}),
        );
        assert_eq!(k.key, "payment:a%3Ab%25c:capture:1:JPY:v1");

        let k = key(
            "send_email",
            Some("welcome"),
            ("user", "u_1"),
            json!({"to": "Ann@Example.com ", "template": "welcome-1"}),
        );
        assert_eq!(
            k.key,
            "send_email:u_1:f4b1beb91170f46300a90686e5be65ba7077bce3c62380191c0d27604e40a571:v1"
        );

        let k = key(
            "create_ticket",
            None,
            ("account", "acct_9"),
            json!({"title": "x"}),
        );
        assert_eq!(k.key, "create_ticket:wf:wf-1:step:3:v2");
    }

    #[test]
    fn template_parts_must_be_present() {
        let registry = Registry::from_toml(
            "[[tools]]\nname = \"t\"\nside_effect_class = \"irreversible\"\nkey = \"x:{workflow_id}:{step}\"",
        )
        .expect("valid");
        let tool = registry.tool("t").expect("declared");
        let entity = Entity {
            kind: "o".into(),
            id: "1".into(),
        };
        let input = |workflow_id, step| KeyInput {
            namespace: "ns",
            tool,
            intent: None,
            entity: &entity,
            workflow_id,
            step,
            canonical_args: &Value::Null,
        };
        assert_eq!(
            derive_key(&input(None, Some(1))),
            Err(KeyError::MissingField("workflow_id"))
        );
        assert_eq!(
            derive_key(&input(Some("wf"), None)),
            Err(KeyError::MissingField("step"))
        );
        assert_eq!(
            derive_key(&input(Some("wf"), Some(1))).map(|k| k.key),
            Ok("x:wf:1:v1".to_owned())
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn registry(version: u32) -> Registry {
            Registry::from_toml(&format!(
                r#"
[[tools]]
name = "charge"
side_effect_class = "irreversible"
intents = ["collect", "deposit"]
key_version = {version}
[tools.args]
amount = "money_minor"
currency = ["trim", "upper"]
email = "email"

[[tools]]
name = "charge_card"
side_effect_class = "irreversible"
intents = ["collect", "deposit"]
[tools.args]
amount = "money_minor"
currency = ["trim", "upper"]
email = "email"
"#
            ))
            .expect("valid")
        }

        fn derive_v(version: u32, tool: &str, intent: &str, entity: &str, args: &Value) -> String {
            let registry = registry(version);
            let tool = registry.tool(tool).expect("declared");
            let canonical =
                canonicalize_args(tool, args.as_object().expect("object")).expect("valid");
            derive_key(&KeyInput {
                namespace: "ns",
                tool,
                intent: Some(intent),
                entity: &Entity {
                    kind: "order".into(),
                    id: entity.into(),
                },
                workflow_id: None,
                step: None,
                canonical_args: &canonical,
            })
            .expect("derivable")
            .key
        }

        fn derive(tool: &str, intent: &str, entity: &str, args: &Value) -> String {
            derive_v(1, tool, intent, entity, args)
        }

        /// Builds an args object from JSON text with the fields in the given order.
        fn args_text(
            order: &[usize],
            amount: &str,
            currency: &str,
            email: &str,
            note: &str,
        ) -> Value {
            let fields = [
                format!("\"amount\": {amount}"),
                format!("\"currency\": \"{currency}\""),
                format!("\"email\": \"{email}\""),
                format!("\"note\": \"{note}\""),
            ];
            let body: Vec<&str> = order.iter().map(|i| fields[*i].as_str()).collect();
            serde_json::from_str(&format!("{{ {} }}", body.join(" ,\n "))).expect("json")
        }

        fn money_spellings(cents: u32) -> Vec<String> {
            let major = cents / 100;
            let minor = cents % 100;
            vec![
                format!("\"{major}.{minor:02}\""),
                format!("{major}.{minor:02}"),
                format!("{major}.{minor:02}0"),
                format!("\"{major}.{minor:02}00\""),
                if minor == 0 {
                    format!("{major}")
                } else {
                    format!("{}e-2", cents)
                },
            ]
        }

        proptest! {
            #[test]
            fn keys_ignore_field_order_and_money_spelling(
                cents in 0u32..10_000_000,
                spelling_a in 0usize..5,
                spelling_b in 0usize..5,
                order in Just(vec![0usize, 1, 2, 3]).prop_shuffle(),
                currency_case in proptest::sample::select(vec!["usd", "USD", " Usd "]),
                email_case in proptest::sample::select(vec!["ann@x.io", " ANN@X.io"]),
            ) {
                let spellings = money_spellings(cents);
                let a = args_text(&[0, 1, 2, 3], &spellings[spelling_a], "USD", "ann@x.io", "n");
                let b = args_text(&order, &spellings[spelling_b], currency_case, email_case, "n");
                prop_assert_eq!(derive("charge", "collect", "o1", &a), derive("charge", "collect", "o1", &b));
            }

            #[test]
            fn keys_differ_when_any_part_of_the_identity_differs(
                cents in 0u32..10_000_000,
                other_cents in 0u32..10_000_000,
                note in "[a-z]{1,8}",
                other_note in "[a-z]{1,8}",
            ) {
                let base = args_text(&[0, 1, 2, 3], &format!("{cents}e-2"), "USD", "ann@x.io", &note);
                let key = derive("charge", "collect", "o1", &base);
                if other_cents != cents {
                    let changed = args_text(&[0, 1, 2, 3], &format!("{other_cents}e-2"), "USD", "ann@x.io", &note);
                    prop_assert_ne!(&key, &derive("charge", "collect", "o1", &changed));
                }
                if other_note != note {
                    let changed = args_text(&[0, 1, 2, 3], &format!("{cents}e-2"), "USD", "ann@x.io", &other_note);
                    prop_assert_ne!(&key, &derive("charge", "collect", "o1", &changed));
                }
                let eur = args_text(&[0, 1, 2, 3], &format!("{cents}e-2"), "EUR", "ann@x.io", &note);
                prop_assert_ne!(&key, &derive("charge", "collect", "o1", &eur));
                prop_assert_ne!(&key, &derive("charge", "collect", "o2", &base));
                prop_assert_ne!(&key, &derive("charge", "deposit", "o1", &base));
                prop_assert_ne!(&key, &derive("charge_card", "collect", "o1", &base));
                prop_assert_ne!(&key, &derive_v(2, "charge", "collect", "o1", &base));
            }
        }
    }
}
