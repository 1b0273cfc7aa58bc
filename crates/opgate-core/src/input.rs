//! Input hygiene (DESIGN.md section 9): what opgate refuses before any work, identically
//! for both ledgers and both ingresses, so that no byte sequence can reach a database,
//! a provider header or a log line that one of them cannot hold.
//!
//! - NUL (`\u0000`) anywhere in a proposal: PostgreSQL cannot store it in `text` or
//!   `jsonb`, and SQLite can — the ledgers would disagree.
//! - Control characters (U+0000-U+001F, U+007F) in ids and in anything that lands in an
//!   idempotency key: a key travels in an HTTP header, and ids travel in log lines.
//! - Ids longer than [`MAX_ID_BYTES`], keys longer than [`MAX_KEY_BYTES`]: a btree index
//!   entry has a size limit on PostgreSQL.
//! - Duplicate keys in a JSON object: `{"amount": "1.00", "amount": "1000.00"}` means
//!   whatever the parser's author decided; opgate refuses to guess.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// Longest accepted id (event_id, namespace, agent_id, workflow_id, run_id, tool,
/// intent, entity type and id), in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Longest accepted rendered idempotency key, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Whether a character is a control character in DESIGN.md's sense (C0 and DEL).
pub fn is_control(c: char) -> bool {
    matches!(c, '\u{0}'..='\u{1f}' | '\u{7f}')
}

/// Why an id is not acceptable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdProblem {
    /// Longer than [`MAX_ID_BYTES`].
    TooLong,
    /// Contains a control character (NUL included).
    ControlCharacter,
}

impl IdProblem {
    /// A message for the field's error.
    pub fn message(self) -> &'static str {
        match self {
            Self::TooLong => "must be at most 256 bytes",
            Self::ControlCharacter => "must not contain control characters (U+0000-U+001F, U+007F)",
        }
    }
}

/// Checks an id: at most [`MAX_ID_BYTES`] bytes, no control characters.
pub fn check_id(value: &str) -> Result<(), IdProblem> {
    if value.chars().any(is_control) {
        return Err(IdProblem::ControlCharacter);
    }
    if value.len() > MAX_ID_BYTES {
        return Err(IdProblem::TooLong);
    }
    Ok(())
}

/// Checks a rendered idempotency key: at most [`MAX_KEY_BYTES`] bytes, no control
/// characters. Returns a message for the rejection.
pub fn check_key(key: &str) -> Result<(), String> {
    if let Some(c) = key.chars().find(|c| is_control(*c)) {
        return Err(format!(
            "the idempotency key would contain the control character U+{:04X}; it could not be sent to a provider",
            u32::from(c)
        ));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!(
            "the idempotency key would be {} bytes, more than the limit of {MAX_KEY_BYTES}",
            key.len()
        ));
    }
    Ok(())
}

/// A W3C `traceparent` if the value is one (`{version}-{trace-id}-{parent-id}-{flags}`,
/// lowercase hex of 2, 32, 16 and 2 digits); anything else is dropped, since the trace
/// context is advisory and must not carry arbitrary bytes into the ledger or headers.
pub fn traceparent(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let parts: Vec<&str> = raw.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let shaped = parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && (parts[0] != "00" || parts.len() == 4)
        && raw.len() <= 256;
    shaped.then(|| raw.to_owned())
}

/// The JSON path (`args.items[2].name`) of the first NUL in a value's strings or
/// object keys, below `root`.
pub fn find_nul(value: &Value, root: &str) -> Option<String> {
    match value {
        Value::String(s) if s.contains('\0') => Some(root.to_owned()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, v)| find_nul(v, &format!("{root}[{i}]"))),
        Value::Object(map) => map.iter().find_map(|(k, v)| {
            let path = format!("{root}.{}", printable(k));
            if k.contains('\0') {
                Some(path)
            } else {
                find_nul(v, &path)
            }
        }),
        _ => None,
    }
}

/// A value from outside (a provider's answer) made storable on every ledger: NUL in any
/// string or key becomes U+FFFD. PostgreSQL's `jsonb` cannot hold `\u0000`; an answer
/// that cannot be stored could never be recorded, and the operation would be looked up
/// and refused again forever.
pub fn storable(value: Value) -> Value {
    let clean = |s: String| {
        if s.contains('\0') {
            s.replace('\0', "\u{fffd}")
        } else {
            s
        }
    };
    match value {
        Value::String(s) => Value::String(clean(s)),
        Value::Array(items) => Value::Array(items.into_iter().map(storable).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (clean(k), storable(v)))
                .collect(),
        ),
        other => other,
    }
}

/// A string from outside made storable: NUL becomes U+FFFD.
pub fn storable_text(s: &str) -> String {
    s.replace('\0', "\u{fffd}")
}

/// A string with control characters escaped (`\n`, `\u{0}`), for messages and logs.
pub fn printable(s: &str) -> String {
    if s.chars().any(is_control) {
        s.escape_debug().to_string()
    } else {
        s.to_owned()
    }
}

/// Returns the path of the first object key that appears twice in one object of a JSON
/// document, or `Ok(())`. Invalid JSON is reported by the real parse that follows, not
/// here (an `Err` of this function always means a duplicate key).
pub fn find_duplicate_key(bytes: &[u8]) -> Result<(), String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match Walk::deserialize(&mut de) {
        Ok(Walk(None)) | Err(_) => Ok(()),
        Ok(Walk(Some(path))) => Err(path),
    }
}

/// A visitor that walks a document without building it and remembers the path of the
/// first duplicate key.
struct Walk(Option<String>);

impl<'de> Deserialize<'de> for Walk {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(WalkVisitor)
    }
}

struct WalkVisitor;

impl<'de> Visitor<'de> for WalkVisitor {
    type Value = Walk;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Walk, E> {
        Ok(Walk(None))
    }
    fn visit_none<E: de::Error>(self) -> Result<Walk, E> {
        Ok(Walk(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Walk, A::Error> {
        let mut first = None;
        let mut i = 0usize;
        while let Some(Walk(found)) = seq.next_element::<Walk>()? {
            if first.is_none() {
                first = found.map(|path| format!("[{i}]{}", dotted(&path)));
            }
            i += 1;
        }
        Ok(Walk(first))
    }

    // With serde_json's `arbitrary_precision`, a number arrives as a one-entry map with
    // a private key: it has no duplicate, so it needs no special case here.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Walk, A::Error> {
        let mut seen = std::collections::HashSet::new();
        let mut first = None;
        while let Some(key) = map.next_key::<String>()? {
            let Walk(found) = map.next_value::<Walk>()?;
            if first.is_some() {
                continue;
            }
            if !seen.insert(key.clone()) {
                first = Some(printable(&key));
            } else if let Some(path) = found {
                first = Some(format!("{}{}", printable(&key), dotted(&path)));
            }
        }
        Ok(Walk(first))
    }
}

/// A child path appended to its parent: `.name` or `[3]`.
fn dotted(path: &str) -> String {
    if path.starts_with('[') {
        path.to_owned()
    } else {
        format!(".{path}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn duplicate_keys_are_found_with_their_path() {
        let cases = [
            (r#"{"a": 1, "a": 2}"#, Some("a")),
            (
                r#"{"args": {"amount": "1.00", "amount": "1000.00"}}"#,
                Some("args.amount"),
            ),
            (r#"{"x": [{"k": 1}, {"k": 1, "k": 2}]}"#, Some("x[1].k")),
            (r#"[[{"a":1,"a":1}]]"#, Some("[0][0].a")),
            (r#"{"a": {"b": 1}, "b": {"a": 1}}"#, None),
            (
                r#"{"n": 1.000000000000000000001, "m": 12345678901234567890123}"#,
                None,
            ),
            (r#"{"a": 1, "A": 2}"#, None),
            ("not json", None),
        ];
        for (doc, expected) in cases {
            assert_eq!(
                find_duplicate_key(doc.as_bytes()).err().as_deref(),
                expected,
                "{doc}"
            );
        }
    }

    #[test]
    fn provider_answers_are_made_storable() {
        let answer = json!({"id": "ch\u{0}1", "nested": [{"k\u{0}": "v"}], "n": 1});
        assert_eq!(
            storable(answer),
            json!({"id": "ch\u{fffd}1", "nested": [{"k\u{fffd}": "v"}], "n": 1})
        );
        assert_eq!(storable_text("a\0b"), "a\u{fffd}b");
    }

    #[test]
    fn traceparents_are_checked() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(traceparent(ok).as_deref(), Some(ok));
        for bad in [
            "",
            "junk",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn ids_and_keys() {
        assert_eq!(check_id("order_123"), Ok(()));
        assert_eq!(check_id("ümlaut and space"), Ok(()));
        for bad in ["a\nb", "a\rb", "\u{1}", "x\u{7f}", "nul\0"] {
            assert_eq!(check_id(bad), Err(IdProblem::ControlCharacter), "{bad:?}");
        }
        assert_eq!(check_id(&"x".repeat(256)), Ok(()));
        assert_eq!(check_id(&"x".repeat(257)), Err(IdProblem::TooLong));
        // Bytes, not characters: 129 two-byte characters are 258 bytes.
        assert_eq!(check_id(&"é".repeat(129)), Err(IdProblem::TooLong));
        assert!(check_key(&"k".repeat(1024)).is_ok());
        assert!(check_key(&"k".repeat(1025)).is_err());
        assert!(check_key("pay:a\nb:v1").is_err());
    }

    #[test]
    fn nul_is_found_in_values_and_keys() {
        assert_eq!(find_nul(&json!({"a": "ok"}), "args"), None);
        assert_eq!(
            find_nul(&json!({"a": ["x", "y\u{0}"]}), "args"),
            Some("args.a[1]".into())
        );
        assert_eq!(
            find_nul(&json!({"a\u{0}b": 1}), "args"),
            Some("args.a\\0b".into())
        );
        assert_eq!(
            find_nul(&json!({"a": {"b": "\u{0}"}}), "args"),
            Some("args.a.b".into())
        );
    }
}
