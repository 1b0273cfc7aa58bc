//! A tool's `args_schema`: a JSON Schema (draft 2020-12) the arguments must satisfy.
//!
//! It is checked against the arguments **as proposed**, with the tool's defaults applied
//! and before the normalizers run, because it is also the tool's `inputSchema` over MCP:
//! it describes what a model sends. (A schema of the canonical form would tell a model
//! that `amount` is an integer in minor units; it would send `4900` for 49.00, which the
//! `money_minor` normalizer reads as 4,900.00.) The normalizers still run afterwards and
//! refuse what they cannot read. A schema never fetches anything: `$ref`s resolve within
//! the document only.

use std::fmt;
use std::sync::Arc;

use serde_json::{Map, Value};

/// A compiled argument schema.
#[derive(Clone)]
pub struct ArgsSchema {
    source: Arc<Value>,
    validator: Arc<jsonschema::Validator>,
}

impl fmt::Debug for ArgsSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("ArgsSchema").field(&self.source).finish()
    }
}

impl ArgsSchema {
    /// Compiles a schema; it must describe an object (the arguments).
    pub fn compile(schema: Value) -> Result<Self, String> {
        match schema.get("type") {
            Some(Value::String(t)) if t == "object" => {}
            None if schema.is_object() => {}
            _ => return Err("must be a JSON Schema of an object (`type = \"object\"`)".into()),
        }
        let validator = jsonschema::draft202012::new(&schema)
            .map_err(|e| format!("not a valid JSON Schema (draft 2020-12): {e}"))?;
        Ok(Self {
            source: Arc::new(schema),
            validator: Arc::new(validator),
        })
    }

    /// The schema as written (served as the MCP `inputSchema`).
    pub fn json(&self) -> &Value {
        &self.source
    }

    /// Checks arguments; the error names the JSON pointer of the first value at fault
    /// (`/amount`, or `/` for the object itself) and what is wrong with it.
    pub fn check(&self, args: &Map<String, Value>) -> Result<(), String> {
        let instance = Value::Object(args.clone());
        let mut errors = self.validator.iter_errors(&instance);
        match errors.next() {
            None => Ok(()),
            Some(first) => {
                let path = first.instance_path.to_string();
                let path = if path.is_empty() {
                    "/".to_owned()
                } else {
                    path
                };
                let more = errors.count();
                let tail = match more {
                    0 => String::new(),
                    1 => " (and 1 more problem)".to_owned(),
                    n => format!(" (and {n} more problems)"),
                };
                Err(format!("args at `{path}`: {first}{tail}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn positive_amount() -> ArgsSchema {
        ArgsSchema::compile(json!({
            "type": "object",
            "properties": {
                "amount": {
                    "type": ["string", "number"],
                    "pattern": "^\\s*0*([1-9][0-9]*(\\.[0-9]+)?|0?\\.[0-9]*[1-9][0-9]*)\\s*$",
                    "exclusiveMinimum": 0
                },
                "to": {"type": "object", "properties": {"email": {"type": "string", "maxLength": 5}}}
            },
            "required": ["amount"]
        }))
        .expect("valid schema")
    }

    fn args(v: Value) -> Map<String, Value> {
        v.as_object().expect("object").clone()
    }

    #[test]
    fn positive_amounts_pass_in_either_spelling() {
        let s = positive_amount();
        for ok in [
            json!("49.00"),
            json!(" 49 "),
            json!(0.5),
            json!("0.01"),
            json!(12),
        ] {
            assert_eq!(s.check(&args(json!({"amount": ok}))), Ok(()), "{ok}");
        }
    }

    #[test]
    fn non_positive_amounts_are_refused_naming_the_path() {
        let s = positive_amount();
        for bad in [
            json!("-49.00"),
            json!("0"),
            json!("0.00"),
            json!(-1),
            json!(0),
            json!(true),
        ] {
            let err = s
                .check(&args(json!({"amount": bad})))
                .expect_err(&bad.to_string());
            assert!(err.starts_with("args at `/amount`: "), "{err}");
        }
        let nested = s
            .check(&args(json!({"amount": "1", "to": {"email": "toolong@x"}})))
            .expect_err("nested");
        assert!(nested.starts_with("args at `/to/email`: "), "{nested}");
        let missing = s.check(&args(json!({}))).expect_err("missing");
        assert!(missing.starts_with("args at `/`: "), "{missing}");
        assert!(missing.contains("amount"), "{missing}");
    }

    #[test]
    fn a_schema_must_describe_an_object_and_compile() {
        assert!(ArgsSchema::compile(json!({"type": "string"})).is_err());
        assert!(ArgsSchema::compile(json!([1])).is_err());
        let bad = ArgsSchema::compile(json!({"type": "object", "properties": {"a": {"type": 5}}}))
            .expect_err("invalid keyword value");
        assert!(bad.contains("not a valid JSON Schema"), "{bad}");
    }

    #[test]
    fn a_remote_ref_is_not_fetched() {
        let remote = ArgsSchema::compile(json!({
            "type": "object",
            "properties": {"a": {"$ref": "http://127.0.0.1:9/schema.json"}}
        }));
        assert!(
            remote.is_err(),
            "a remote $ref must not compile (nothing is fetched)"
        );
    }
}
