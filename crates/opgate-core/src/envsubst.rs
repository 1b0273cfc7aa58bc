//! `${NAME}` references in config values, expanded from the environment when the config
//! file is read (secrets and endpoints never live in the file). The lookup is passed in,
//! so this stays free of I/O and testable.

/// A `${NAME}` whose variable is not set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable `{0}` is referenced by the config but not set")]
pub struct MissingVar(pub String);

/// Replaces every `${NAME}` with `lookup(NAME)`; `$${` is a literal `${`.
pub fn expand(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, MissingVar> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        if rest[..at].ends_with('$') {
            out.push_str(&rest[..at - 1]);
            out.push_str("${");
            rest = &rest[at + 2..];
            continue;
        }
        out.push_str(&rest[..at]);
        let Some(end) = rest[at..].find('}') else {
            out.push_str(&rest[at..]);
            return Ok(out);
        };
        let name = &rest[at + 2..at + end];
        out.push_str(&lookup(name).ok_or_else(|| MissingVar(name.to_owned()))?);
        rest = &rest[at + end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Expands every `${NAME}` it can and collects the names it cannot, in order; `$${` is
/// kept as `$${` (and a value's own `${` is written as `$${`), so a later [`expand`] of
/// the result yields exactly one level of substitution.
pub fn expand_keeping_escapes(
    text: &str,
    lookup: impl Fn(&str) -> Option<String>,
    missing: &mut Vec<String>,
) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("${") {
        if rest[..at].ends_with('$') {
            out.push_str(&rest[..at + 2]);
            rest = &rest[at + 2..];
            continue;
        }
        out.push_str(&rest[..at]);
        let Some(end) = rest[at..].find('}') else {
            out.push_str(&rest[at..]);
            return out;
        };
        let name = &rest[at + 2..at + end];
        match lookup(name) {
            Some(value) => out.push_str(&value.replace("${", "$${")),
            None => {
                if !missing.iter().any(|m| m == name) {
                    missing.push(name.to_owned());
                }
                out.push_str(&rest[at..at + end + 1]);
            }
        }
        rest = &rest[at + end + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "HOST" => Some("kafka:9092".into()),
            "SECRET" => Some("s3cr3t".into()),
            _ => None,
        }
    }

    #[test]
    fn expands_and_names_the_missing_variable() {
        assert_eq!(expand("${HOST},b:1", env).expect("ok"), "kafka:9092,b:1");
        assert_eq!(expand("user:${SECRET}@", env).expect("ok"), "user:s3cr3t@");
        assert_eq!(expand("no refs {key}", env).expect("ok"), "no refs {key}");
        assert_eq!(expand("lit $${HOST}", env).expect("ok"), "lit ${HOST}");
        assert_eq!(expand("${NOPE}", env), Err(MissingVar("NOPE".into())));
    }

    #[test]
    fn expanding_early_keeps_escapes_for_the_later_expansion_and_lists_every_missing_name() {
        let mut missing = Vec::new();
        let early = expand_keeping_escapes("${HOST} $${HOST} ${A} ${B} ${A}", env, &mut missing);
        assert_eq!(missing, vec!["A".to_owned(), "B".to_owned()]);
        assert_eq!(early, "kafka:9092 $${HOST} ${A} ${B} ${A}");
        let mut none = Vec::new();
        let early = expand_keeping_escapes("x=${HOST} lit $${HOST}", env, &mut none);
        assert!(none.is_empty());
        assert_eq!(expand(&early, env).expect("ok"), "x=kafka:9092 lit ${HOST}");
        let sneaky = |_: &str| Some("${HOST}".to_owned());
        let early = expand_keeping_escapes("${X}", sneaky, &mut none);
        assert_eq!(
            expand(&early, env).expect("ok"),
            "${HOST}",
            "a value is not expanded again"
        );
    }
}
