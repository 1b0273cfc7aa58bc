//! Canonical arguments: one spelling per meaning, so a retry that phrases the same
//! arguments differently gets the same key.
//!
//! Two layers:
//! - [`canonical_json`] writes any JSON value in one form: object keys sorted by code
//!   point, no insignificant whitespace, numbers as exact normalized decimals
//!   (`49.0` and `4.9e1` become `49`), strings escaped as serde_json escapes them.
//!   It is idempotent: re-parsing its output and writing it again gives the same bytes.
//! - [`canonicalize_args`] applies a tool's declared defaults, required arguments,
//!   unknown-argument policy and per-field [`Normalizer`]s, then the structural form.
//!
//! Money: `money_minor` turns a decimal amount in major units (`"49.00"`, `"49"`, `49`,
//! `49.0`) into an integer of minor units (`4900`). The number of minor units comes from
//! the ISO 4217 exponent of the sibling `currency` argument (JPY 0, USD 2, KWD 3, ...;
//! 2 when the tool has no `currency` argument). An amount with more decimals than the
//! currency has (`"49.001"` USD) is rejected, never rounded; so is an unknown currency.
//! A top-level argument that is `null` counts as absent (defaults apply, and it is not
//! part of the key); nulls nested inside values are data and are kept.
//!
//! `money_minor` is a unit conversion, so it is not idempotent on its own output
//! (`4900` read as major units is `490000`); canonical args are stored and never
//! canonicalized twice.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::decimal::Decimal;
use crate::registry::{Tool, UnknownArgs};

/// A per-field normalizer declared in `[tools.args]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalizer {
    /// Major-unit decimal -> integer minor units.
    MoneyMinor,
    /// Uppercase a string.
    Upper,
    /// Lowercase a string.
    Lower,
    /// Trim surrounding whitespace.
    Trim,
    /// Trim and lowercase, and require `local@domain`.
    Email,
    /// An RFC 3339 timestamp (or integer Unix seconds) -> RFC 3339 UTC, `Z`, no trailing zeros.
    Timestamp,
    /// Declare the argument without changing it.
    AsIs,
}

impl Normalizer {
    /// The names accepted in config.
    pub const NAMES: [&'static str; 7] = [
        "money_minor",
        "upper",
        "lower",
        "trim",
        "email",
        "timestamp",
        "as_is",
    ];

    /// Parses a config name.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "money_minor" => Self::MoneyMinor,
            "upper" => Self::Upper,
            "lower" => Self::Lower,
            "trim" => Self::Trim,
            "email" => Self::Email,
            "timestamp" => Self::Timestamp,
            "as_is" => Self::AsIs,
            _ => return None,
        })
    }
}

/// The arguments with the tool's defaults for those absent or null; a top-level null
/// means "not given" (`{"note": null}` and `{}` are one identity), so nulls are dropped.
pub fn with_defaults(tool: &Tool, raw: &Map<String, Value>) -> Map<String, Value> {
    let mut args = raw.clone();
    for (name, default) in &tool.defaults {
        if matches!(args.get(name), None | Some(Value::Null)) {
            args.insert(name.clone(), default.clone());
        }
    }
    args.retain(|_, v| !v.is_null());
    args
}

/// Why arguments cannot be canonicalized. Each names the argument.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgError {
    /// A required argument is absent.
    #[error("argument `{0}` is required")]
    Missing(String),
    /// An argument the tool does not declare, and the tool rejects unknown arguments.
    #[error("argument `{0}` is not declared by the tool")]
    Unknown(String),
    /// A value the normalizer cannot take.
    #[error("argument `{arg}`: {message}")]
    Invalid {
        /// The argument.
        arg: String,
        /// What is wrong.
        message: String,
    },
}

/// Applies a tool's argument rules and returns the canonical arguments object.
pub fn canonicalize_args(tool: &Tool, raw: &Map<String, Value>) -> Result<Value, ArgError> {
    let mut args = with_defaults(tool, raw);
    if let Some(missing) = tool
        .required
        .iter()
        .find(|r| matches!(args.get(*r), None | Some(Value::Null)))
    {
        return Err(ArgError::Missing(missing.clone()));
    }
    if tool.unknown_args == UnknownArgs::Reject
        && let Some(unknown) = args.keys().find(|k| !tool.declares_arg(k))
    {
        return Err(ArgError::Unknown(unknown.clone()));
    }
    let currency = args
        .get("currency")
        .and_then(Value::as_str)
        .map(|c| c.trim().to_ascii_uppercase());
    for (name, normalizers) in &tool.args {
        let Some(value) = args.get_mut(name) else {
            continue;
        };
        if value.is_null() {
            continue;
        }
        for normalizer in normalizers {
            let taken = std::mem::take(value);
            *value = normalize(*normalizer, taken, currency.as_deref()).map_err(|message| {
                ArgError::Invalid {
                    arg: name.clone(),
                    message,
                }
            })?;
        }
    }
    let value = Value::Object(args);
    // Validate every number once, so the canonical writer below cannot fail.
    check_numbers(&value).map_err(|(path, message)| ArgError::Invalid { arg: path, message })?;
    Ok(value)
}

fn normalize(n: Normalizer, value: Value, currency: Option<&str>) -> Result<Value, String> {
    let text = |v: Value| match v {
        Value::String(s) => Ok(s),
        other => Err(format!("expected a string, got {}", kind(&other))),
    };
    Ok(match n {
        Normalizer::AsIs => value,
        Normalizer::Upper => Value::String(text(value)?.to_uppercase()),
        Normalizer::Lower => Value::String(text(value)?.to_lowercase()),
        Normalizer::Trim => Value::String(text(value)?.trim().to_owned()),
        Normalizer::Email => {
            let email = text(value)?.trim().to_lowercase();
            let valid = email.split_once('@').is_some_and(|(local, domain)| {
                !local.is_empty() && !domain.is_empty() && !domain.contains('@')
            }) && !email.chars().any(char::is_whitespace);
            if !valid {
                return Err(format!("{email:?} is not an email address"));
            }
            Value::String(email)
        }
        Normalizer::Timestamp => Value::String(normalize_timestamp(value)?),
        Normalizer::MoneyMinor => {
            let amount = match &value {
                Value::String(s) => Decimal::parse_plain(s.trim()),
                Value::Number(n) => Decimal::parse_json(&n.to_string()),
                other => return Err(format!("expected an amount, got {}", kind(other))),
            }
            .map_err(|e| e.to_string())?;
            let exponent = match currency {
                None => 2,
                Some(code) => minor_unit_exponent(code)
                    .ok_or_else(|| format!("unknown currency {code:?} for a money amount"))?,
            };
            let minor = amount.scaled_integer(exponent).ok_or_else(|| {
                format!(
                    "amount {amount} has more than {exponent} decimal places for {} or is too large",
                    currency.unwrap_or("the default currency")
                )
            })?;
            Value::from(minor)
        }
    })
}

fn normalize_timestamp(value: Value) -> Result<String, String> {
    let at = match value {
        Value::String(s) => OffsetDateTime::parse(s.trim(), &Rfc3339)
            .map_err(|e| format!("{s:?} is not an RFC 3339 timestamp ({e})"))?,
        Value::Number(n) => {
            let secs = n
                .as_i64()
                .ok_or_else(|| format!("{n} is not a whole number of Unix seconds"))?;
            OffsetDateTime::from_unix_timestamp(secs).map_err(|e| e.to_string())?
        }
        other => return Err(format!("expected a timestamp, got {}", kind(&other))),
    };
    Ok(format_utc(at))
}

/// Formats an instant as RFC 3339 in UTC with `Z` and no trailing fractional zeros.
pub fn format_utc(at: OffsetDateTime) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    let mut out = format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    );
    let nanos = at.nanosecond();
    if nanos != 0 {
        let frac = format!("{nanos:09}");
        let _ = write!(out, ".{}", frac.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// ISO 4217 minor-unit exponents for currencies that differ from 2, and the common
/// two-decimal ones. Unknown codes are refused rather than guessed.
pub fn minor_unit_exponent(code: &str) -> Option<u32> {
    const ZERO: &[&str] = &[
        "BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI", "VND",
        "VUV", "XAF", "XOF", "XPF",
    ];
    const THREE: &[&str] = &["BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"];
    const FOUR: &[&str] = &["CLF", "UYW"];
    const TWO: &[&str] = &[
        "AED", "ARS", "AUD", "BGN", "BRL", "CAD", "CHF", "CNY", "COP", "CZK", "DKK", "EGP", "EUR",
        "GBP", "HKD", "HUF", "IDR", "ILS", "INR", "KES", "MAD", "MXN", "MYR", "NGN", "NOK", "NZD",
        "PEN", "PHP", "PKR", "PLN", "QAR", "RON", "RSD", "RUB", "SAR", "SEK", "SGD", "THB", "TRY",
        "TWD", "UAH", "USD", "ZAR",
    ];
    let code = code.trim().to_ascii_uppercase();
    let code = code.as_str();
    if ZERO.contains(&code) {
        Some(0)
    } else if TWO.contains(&code) {
        Some(2)
    } else if THREE.contains(&code) {
        Some(3)
    } else if FOUR.contains(&code) {
        Some(4)
    } else {
        None
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn check_numbers(value: &Value) -> Result<(), (String, String)> {
    fn walk(value: &Value, path: &mut Vec<String>) -> Result<(), (String, String)> {
        match value {
            Value::Number(n) => Decimal::parse_json(&n.to_string())
                .map(|_| ())
                .map_err(|e| (path.join("."), e.to_string())),
            Value::Array(items) => items.iter().enumerate().try_for_each(|(i, v)| {
                path.push(i.to_string());
                let r = walk(v, path);
                path.pop();
                r
            }),
            Value::Object(map) => map.iter().try_for_each(|(k, v)| {
                path.push(k.clone());
                let r = walk(v, path);
                path.pop();
                r
            }),
            _ => Ok(()),
        }
    }
    walk(value, &mut Vec::new())
}

/// Writes a JSON value in canonical form. Numbers that are not exact decimals in range
/// are written as serde_json prints them; [`canonicalize_args`] rejects those earlier.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let text = n.to_string();
            match Decimal::parse_json(&text) {
                Ok(d) => {
                    let _ = write!(out, "{d}");
                }
                Err(_) => out.push_str(&text),
            }
        }
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
    }
}

fn write_string(s: &str, out: &mut String) {
    // serde_json's string escaping is stable and minimal; a String cannot fail to encode.
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

/// The canonical value itself: the canonical JSON re-parsed, so numbers are normalized in
/// the stored value too.
pub fn canonical_value(value: &Value) -> Value {
    serde_json::from_str(&canonical_json(value)).unwrap_or_else(|_| value.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;
    use serde_json::json;

    fn tool(args_toml: &str, extra: &str) -> Tool {
        let toml = format!(
            "[[tools]]\nname = \"t\"\nside_effect_class = \"irreversible\"\n{extra}\n[tools.args]\n{args_toml}"
        );
        Registry::from_toml(&toml)
            .expect("valid registry")
            .tool("t")
            .expect("declared")
            .clone()
    }

    fn args(value: Value) -> Map<String, Value> {
        value.as_object().expect("object").clone()
    }

    fn canon(tool: &Tool, value: Value) -> Result<String, ArgError> {
        canonicalize_args(tool, &args(value)).map(|v| canonical_json(&v))
    }

    #[test]
    fn structural_form_sorts_keys_and_normalizes_numbers() {
        let v: Value = serde_json::from_str(r#"{ "b": [1.50, {"z": 1, "a": 2e0}], "a": "x\"y" }"#)
            .expect("json");
        assert_eq!(
            canonical_json(&v),
            r#"{"a":"x\"y","b":[1.5,{"a":2,"z":1}]}"#
        );
    }

    #[test]
    fn money_spellings_agree() {
        let t = tool("amount = \"money_minor\"\ncurrency = \"upper\"", "");
        for amount in [
            json!("49.00"),
            json!("49"),
            json!(49),
            json!(49.0),
            json!(" 49.0 "),
        ] {
            assert_eq!(
                canon(&t, json!({"amount": amount, "currency": "usd"})).expect("valid"),
                r#"{"amount":4900,"currency":"USD"}"#,
                "{amount}"
            );
        }
    }

    #[test]
    fn money_follows_the_currency_minor_unit() {
        let t = tool("amount = \"money_minor\"", "");
        let c = |amount: Value, cur: &str| canon(&t, json!({"amount": amount, "currency": cur}));
        assert_eq!(
            c(json!("500"), "JPY").expect("ok"),
            r#"{"amount":500,"currency":"JPY"}"#
        );
        assert_eq!(
            c(json!("1.234"), "KWD").expect("ok"),
            r#"{"amount":1234,"currency":"KWD"}"#
        );
        assert!(
            matches!(c(json!("5.5"), "JPY"), Err(ArgError::Invalid { arg, .. }) if arg == "amount")
        );
        assert!(matches!(
            c(json!("49.001"), "usd"),
            Err(ArgError::Invalid { .. })
        ));
        assert!(
            matches!(c(json!("1"), "XYZ"), Err(ArgError::Invalid { message, .. }) if message.contains("unknown currency"))
        );
        assert!(matches!(
            c(json!("$49"), "USD"),
            Err(ArgError::Invalid { .. })
        ));
        assert!(matches!(
            c(json!(true), "USD"),
            Err(ArgError::Invalid { .. })
        ));
        let no_currency = canon(&t, json!({"amount": "12.3"})).expect("ok");
        assert_eq!(no_currency, r#"{"amount":1230}"#);
    }

    #[test]
    fn string_normalizers() {
        let t = tool(
            "code = [\"trim\", \"upper\"]\nname = \"lower\"\nemail = \"email\"\nnote = \"as_is\"",
            "",
        );
        assert_eq!(
            canon(&t, json!({"code": " ab ", "name": "ÉMILE", "email": " Ann@Example.COM ", "note": " x "}))
                .expect("valid"),
            r#"{"code":"AB","email":"ann@example.com","name":"émile","note":" x "}"#
        );
        for bad in ["no-at-sign", "a@b@c", "@x", "a b@c"] {
            assert!(canon(&t, json!({"email": bad})).is_err(), "{bad}");
        }
        assert!(
            matches!(canon(&t, json!({"code": 5})), Err(ArgError::Invalid { arg, .. }) if arg == "code")
        );
    }

    #[test]
    fn timestamps_become_utc() {
        let t = tool("at = \"timestamp\"", "");
        for input in [
            json!("2026-11-29T10:00:00+02:00"),
            json!("2026-11-29T08:00:00.000Z"),
            json!(1_795_939_200),
        ] {
            assert_eq!(
                canon(&t, json!({"at": input})).expect("valid"),
                r#"{"at":"2026-11-29T08:00:00Z"}"#,
                "{input}"
            );
        }
        assert_eq!(
            canon(&t, json!({"at": "2026-11-29T08:00:00.120Z"})).expect("valid"),
            r#"{"at":"2026-11-29T08:00:00.12Z"}"#
        );
        assert!(canon(&t, json!({"at": "yesterday"})).is_err());
    }

    #[test]
    fn defaults_required_and_unknown_fields() {
        let t = tool(
            "currency = \"upper\"",
            "required = [\"amount\"]\nunknown_args = \"reject\"\ndefaults = { currency = \"eur\" }",
        );
        assert_eq!(
            canon(&t, json!({"amount": 1})).expect("valid"),
            r#"{"amount":1,"currency":"EUR"}"#
        );
        assert_eq!(
            canon(&t, json!({"currency": "usd"})),
            Err(ArgError::Missing("amount".into()))
        );
        assert_eq!(
            canon(&t, json!({"amount": 1, "memo": "x"})),
            Err(ArgError::Unknown("memo".into()))
        );
        let keep = tool("currency = \"upper\"", "");
        assert_eq!(
            canon(&keep, json!({"memo": "x"})).expect("kept"),
            r#"{"memo":"x"}"#
        );
    }

    #[test]
    fn inexact_numbers_are_rejected_not_rounded() {
        let t = tool("x = \"as_is\"", "");
        let v: Value =
            serde_json::from_str(r#"{"x": 1e999}"#).expect("arbitrary precision keeps it");
        let err = canonicalize_args(&t, v.as_object().expect("object")).expect_err("out of range");
        assert!(matches!(err, ArgError::Invalid { arg, .. } if arg == "x"));
        let v: Value =
            serde_json::from_str(r#"{"x": 0.1000000000000000055511151231257827}"#).expect("json");
        assert_eq!(
            canonical_json(&canonicalize_args(&t, v.as_object().expect("object")).expect("exact")),
            r#"{"x":0.1000000000000000055511151231257827}"#
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn number() -> impl Strategy<Value = String> {
            (any::<i64>(), 0u32..6, -3i32..4).prop_map(|(m, frac, exp)| {
                let digits = m.unsigned_abs().to_string();
                let sign = if m < 0 { "-" } else { "" };
                let (int, fr) = digits.split_at(digits.len().saturating_sub(frac as usize).max(1));
                let mut text = format!("{sign}{int}");
                if !fr.is_empty() {
                    text.push('.');
                    text.push_str(fr);
                }
                if exp != 0 {
                    text.push_str(&format!("e{exp}"));
                }
                text
            })
        }

        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                "\\PC{0,12}".prop_map(Value::String),
                number().prop_map(|n| serde_json::from_str(&n).expect("valid number")),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    proptest::collection::btree_map("\\PC{0,6}", inner, 0..6)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            /// The structural form is a fixed point: writing, re-reading and writing again
            /// gives the same bytes.
            #[test]
            fn canonical_json_is_idempotent(v in json_value()) {
                let once = canonical_json(&v);
                let reparsed: Value = serde_json::from_str(&once).expect("canonical output is json");
                prop_assert_eq!(canonical_json(&reparsed), once.clone());
                prop_assert_eq!(canonical_json(&canonical_value(&v)), once);
            }

            /// With idempotent normalizers, canonicalizing canonical args changes nothing.
            /// (`money_minor` is a unit conversion and is covered by spelling tests instead.)
            #[test]
            fn canonicalize_args_is_idempotent(
                code in "[ a-zA-Z]{0,6}",
                name in "\\PC{0,10}",
                email in " ?[a-zA-Z]{1,5}@[a-zA-Z]{1,5}\\.(io|COM)",
                secs in 0i64..4_000_000_000,
                offset_h in -12i32..13,
                extra in json_value(),
            ) {
                let t = tool(
                    "code = [\"trim\", \"upper\"]\nname = \"lower\"\nemail = \"email\"\nat = \"timestamp\"\nextra = \"as_is\"",
                    "",
                );
                let offset = time::UtcOffset::from_hms(offset_h as i8, 0, 0).expect("offset");
                let at = OffsetDateTime::from_unix_timestamp(secs).expect("ts").to_offset(offset);
                let at = at.format(&Rfc3339).expect("format");
                let raw = json!({"code": code, "name": name, "email": email, "at": at, "extra": extra});
                let once = canonicalize_args(&t, raw.as_object().expect("object")).expect("valid");
                let twice = canonicalize_args(&t, once.as_object().expect("object")).expect("valid");
                prop_assert_eq!(canonical_json(&twice), canonical_json(&once));
            }
        }
    }
}
