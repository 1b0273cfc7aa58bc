//! `{placeholder}` templates used by key templates, compensation arguments and adapter URLs.
//!
//! A template is parsed once, when the registry is loaded, so a typo in a placeholder is
//! a configuration error naming the tool, not a runtime surprise. `${NAME}` is left
//! alone: it is an environment reference expanded when the config file is read.

use std::fmt;

/// One `{...}` placeholder.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Placeholder {
    /// `{entity}`: the entity id.
    Entity,
    /// `{entity_type}`.
    EntityType,
    /// `{tool}`.
    Tool,
    /// `{intent}`.
    Intent,
    /// `{namespace}`.
    Namespace,
    /// `{workflow_id}`.
    WorkflowId,
    /// `{step}`.
    Step,
    /// `{key}`: the operation's idempotency key (adapter lookup URLs).
    Key,
    /// `{args.NAME}`: a canonical argument.
    Arg(String),
    /// `{result.NAME}`: a field of a completed operation's result (compensation).
    Result(String),
}

impl fmt::Display for Placeholder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Entity => f.write_str("{entity}"),
            Self::EntityType => f.write_str("{entity_type}"),
            Self::Tool => f.write_str("{tool}"),
            Self::Intent => f.write_str("{intent}"),
            Self::Namespace => f.write_str("{namespace}"),
            Self::WorkflowId => f.write_str("{workflow_id}"),
            Self::Step => f.write_str("{step}"),
            Self::Key => f.write_str("{key}"),
            Self::Arg(name) => write!(f, "{{args.{name}}}"),
            Self::Result(name) => write!(f, "{{result.{name}}}"),
        }
    }
}

/// A piece of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Text copied as is.
    Literal(String),
    /// A value substituted at render time.
    Placeholder(Placeholder),
}

/// A parsed template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// Why a template does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A `{` without its `}`.
    #[error("unclosed `{{` in template {0:?}")]
    Unclosed(String),
    /// A placeholder opgate does not know.
    #[error("unknown placeholder `{{{0}}}`")]
    Unknown(String),
}

impl Template {
    /// Parses a template.
    pub fn parse(source: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut rest = source;
        while let Some(open) = rest.find('{') {
            let is_env = rest[..open].ends_with('$');
            let close = rest[open..]
                .find('}')
                .map(|c| open + c)
                .ok_or_else(|| TemplateError::Unclosed(source.to_owned()))?;
            if is_env {
                literal.push_str(&rest[..=close]);
            } else {
                literal.push_str(&rest[..open]);
                if !literal.is_empty() {
                    parts.push(Part::Literal(std::mem::take(&mut literal)));
                }
                parts.push(Part::Placeholder(parse_placeholder(
                    &rest[open + 1..close],
                )?));
            }
            rest = &rest[close + 1..];
        }
        literal.push_str(rest);
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        Ok(Self {
            source: source.to_owned(),
            parts,
        })
    }

    /// The template text as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The parts in order.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// Every placeholder used, in order of appearance.
    pub fn placeholders(&self) -> impl Iterator<Item = &Placeholder> {
        self.parts.iter().filter_map(|p| match p {
            Part::Placeholder(ph) => Some(ph),
            Part::Literal(_) => None,
        })
    }

    /// Renders the template; `value` returns the text for a placeholder, or an error.
    pub fn render<E>(
        &self,
        mut value: impl FnMut(&Placeholder) -> Result<String, E>,
    ) -> Result<String, E> {
        let mut out = String::with_capacity(self.source.len() + 16);
        for part in &self.parts {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Placeholder(ph) => out.push_str(&value(ph)?),
            }
        }
        Ok(out)
    }
}

fn parse_placeholder(name: &str) -> Result<Placeholder, TemplateError> {
    let unknown = || TemplateError::Unknown(name.to_owned());
    Ok(match name {
        "entity" | "entity_id" => Placeholder::Entity,
        "entity_type" => Placeholder::EntityType,
        "tool" => Placeholder::Tool,
        "intent" => Placeholder::Intent,
        "namespace" => Placeholder::Namespace,
        "workflow_id" => Placeholder::WorkflowId,
        "step" => Placeholder::Step,
        "key" => Placeholder::Key,
        other => {
            if let Some(arg) = other.strip_prefix("args.") {
                if arg.is_empty() {
                    return Err(unknown());
                }
                Placeholder::Arg(arg.to_owned())
            } else if let Some(field) = other.strip_prefix("result.") {
                if field.is_empty() {
                    return Err(unknown());
                }
                Placeholder::Result(field.to_owned())
            } else {
                return Err(unknown());
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_design_key_template() {
        let t = Template::parse("payment:{entity}:capture:{args.amount}:{args.currency}")
            .expect("valid");
        let phs: Vec<_> = t.placeholders().cloned().collect();
        assert_eq!(
            phs,
            vec![
                Placeholder::Entity,
                Placeholder::Arg("amount".into()),
                Placeholder::Arg("currency".into())
            ]
        );
        let out: Result<String, ()> = t.render(|ph| Ok(format!("<{ph}>")));
        assert_eq!(
            out.expect("renders"),
            "payment:<{entity}>:capture:<{args.amount}>:<{args.currency}>"
        );
    }

    #[test]
    fn leaves_environment_references_alone() {
        let t = Template::parse("${OPGATE_SIM_URL}/payments?idempotency_key={key}").expect("ok");
        assert_eq!(
            t.placeholders().collect::<Vec<_>>(),
            vec![&Placeholder::Key]
        );
        let out: Result<String, ()> = t.render(|_| Ok("K".into()));
        assert_eq!(
            out.expect("renders"),
            "${OPGATE_SIM_URL}/payments?idempotency_key=K"
        );
    }

    #[test]
    fn rejects_unknown_and_unclosed() {
        assert_eq!(
            Template::parse("x:{amount}"),
            Err(TemplateError::Unknown("amount".into()))
        );
        assert!(matches!(
            Template::parse("x:{args.a"),
            Err(TemplateError::Unclosed(_))
        ));
        assert!(matches!(
            Template::parse("{args.}"),
            Err(TemplateError::Unknown(_))
        ));
    }
}
