//! Principals: bearer tokens with a role (DESIGN.md section 9), stored as SHA-256
//! digests, and what each role may do.
//!
//! - `agent`: bound to an `agent_id` and namespaces; proposes (the proposal's `agent_id`
//!   is the token's) and reads its own operations;
//! - `viewer`: reads everything, `/metrics`;
//! - `operator`: reads, proposes, approves, rejects, cancels, resolves, compensates — but
//!   never approves an operation it proposed itself.
//!
//! A token may have several secrets (rotation: add the new one, move the clients, drop
//! the old one). The `Authorization` scheme is matched case-insensitively. Refusals name
//! the caller's own token and the field at fault, never another principal.

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use opgate_core::Operation;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::ApiState;
use crate::error::ApiError;

/// A token's role.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Proposes and reads its own operations.
    Agent,
    /// Reads everything.
    #[default]
    Viewer,
    /// Reads, proposes and decides.
    Operator,
}

impl Role {
    /// As written in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Viewer => "viewer",
            Self::Operator => "operator",
        }
    }
}

/// What an agent token is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentScope {
    /// The `agent_id` its proposals carry.
    pub agent_id: String,
    /// The namespaces it may propose in and read.
    pub namespaces: Vec<String>,
}

/// A bearer token as the API holds it: digests only.
#[derive(Clone)]
pub struct Token {
    /// Who holds it (the principal: recorded as the actor of what it does).
    pub name: String,
    /// Its role.
    pub role: Role,
    /// SHA-256 digests of the secrets that present it.
    pub digests: Vec<[u8; 32]>,
    /// For an agent token, what it is bound to.
    pub agent: Option<AgentScope>,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("secrets", &self.digests.len())
            .field("agent", &self.agent)
            .finish()
    }
}

/// Why a token is not usable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("api.tokens `{token}`: {message}")]
pub struct TokenError {
    /// The token's name.
    pub token: String,
    /// What is wrong.
    pub message: String,
}

impl Token {
    /// A token from its config: plain secrets (hashed here) and/or hex SHA-256 digests.
    pub fn new(
        name: &str,
        role: Role,
        secrets: &[String],
        sha256: &[String],
        agent: Option<AgentScope>,
    ) -> Result<Self, TokenError> {
        let fail = |message: String| TokenError {
            token: name.to_owned(),
            message,
        };
        if name.trim().is_empty() {
            return Err(fail("the name is empty".into()));
        }
        let mut digests = Vec::new();
        for secret in secrets {
            if secret.trim().len() < 16 {
                return Err(fail(
                    "a secret must have at least 16 characters (an empty `${VAR}`?)".into(),
                ));
            }
            digests.push(digest(secret));
        }
        for hex_digest in sha256 {
            let bytes = hex::decode(hex_digest.trim())
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| fail("secret_sha256 must be 64 hex digits".into()))?;
            digests.push(bytes);
        }
        if digests.is_empty() {
            return Err(fail(
                "give `secret`, `secrets` or `secret_sha256` (none is set)".into(),
            ));
        }
        match (role, &agent) {
            (Role::Agent, None) => {
                return Err(fail(
                    "an agent token needs `agent_id` and `namespaces`".into(),
                ));
            }
            (Role::Agent, Some(scope)) => {
                if scope.agent_id.trim().is_empty() {
                    return Err(fail("`agent_id` is empty".into()));
                }
                if scope.namespaces.is_empty() || scope.namespaces.iter().any(|n| n.is_empty()) {
                    return Err(fail(
                        "`namespaces` must list the namespaces the agent works in".into(),
                    ));
                }
            }
            (_, Some(_)) => {
                return Err(fail(format!(
                    "`agent_id` and `namespaces` apply to agent tokens, not to a {}",
                    role.as_str()
                )));
            }
            (_, None) => {}
        }
        Ok(Self {
            name: name.to_owned(),
            role,
            digests,
            agent,
        })
    }
}

/// Checks a set of tokens: names and secrets must be unique across tokens.
pub fn check_tokens(tokens: &[Token]) -> Result<(), TokenError> {
    for (i, a) in tokens.iter().enumerate() {
        for b in &tokens[i + 1..] {
            let fail = |message: &str| TokenError {
                token: b.name.clone(),
                message: message.to_owned(),
            };
            if a.name == b.name {
                return Err(fail("the name is used by another token"));
            }
            if a.digests.iter().any(|d| b.digests.contains(d)) {
                return Err(fail("a secret is shared with another token"));
            }
        }
    }
    Ok(())
}

/// The SHA-256 digest of a secret.
pub fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

/// Equal-length comparison whose time does not depend on where the bytes differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// The caller, once authenticated.
#[derive(Debug, Clone)]
pub struct Principal {
    /// The token's name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// For an agent, what it is bound to.
    pub agent: Option<AgentScope>,
}

impl Principal {
    /// Finds the token a bearer secret presents (comparing against every digest, so the
    /// time does not tell which one matched).
    pub fn find(tokens: &[Token], secret: &str) -> Option<Self> {
        let presented = digest(secret);
        let mut found = None;
        for token in tokens {
            for d in &token.digests {
                if constant_time_eq(d, &presented) {
                    found = Some(Self {
                        name: token.name.clone(),
                        role: token.role,
                        agent: token.agent.clone(),
                    });
                }
            }
        }
        found
    }

    /// Refuses anyone but an operator.
    pub fn require_operator(&self, what: &str) -> Result<(), ApiError> {
        match self.role {
            Role::Operator => Ok(()),
            role => Err(ApiError::forbidden(format!(
                "token `{}` is {} {}; {what} needs an operator token",
                self.name,
                if role == Role::Agent { "an" } else { "a" },
                role.as_str()
            ))),
        }
    }

    /// Refuses an agent (viewer and operator read everything).
    pub fn require_reader(&self, what: &str) -> Result<(), ApiError> {
        match self.role {
            Role::Agent => Err(ApiError::forbidden(format!(
                "token `{}` is an agent; {what} needs a viewer or operator token",
                self.name
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a viewer (agents and operators propose).
    pub fn require_proposer(&self) -> Result<(), ApiError> {
        match self.role {
            Role::Viewer => Err(ApiError::forbidden(format!(
                "token `{}` is a viewer; proposing needs an agent or operator token",
                self.name
            ))),
            _ => Ok(()),
        }
    }

    /// Whether this principal may see an operation: an agent sees its own only.
    pub fn may_read(&self, op: &Operation) -> bool {
        match &self.agent {
            None => true,
            Some(scope) => {
                op.agent_id.as_deref() == Some(scope.agent_id.as_str())
                    && scope.namespaces.contains(&op.namespace)
            }
        }
    }
}

/// The middleware: every route behind it needs a known bearer token; the handler finds
/// the [`Principal`] in the request's extensions and checks what it may do.
pub(crate) async fn authenticate(
    State(state): State<ApiState>,
    mut request: Request,
    next: Next,
) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer);
    let Some(secret) = presented else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "an `Authorization: Bearer <token>` header is required",
        )
        .into_response();
    };
    let Some(principal) = Principal::find(&state.tokens, secret) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "unknown token")
            .into_response();
    };
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// The secret of an `Authorization` value whose scheme is `Bearer` (any case, RFC 7235).
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim_start().split_once(' ')?;
    let secret = rest.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !secret.is_empty()).then_some(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S1: &str = "0123456789abcdef-one";
    const S2: &str = "0123456789abcdef-two";

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER   abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
        assert_eq!(bearer("Bearerabc"), None);
    }

    #[test]
    fn a_token_has_several_secrets_and_digests() {
        let hashed = hex::encode(digest(S2));
        let t = Token::new("ops", Role::Operator, &[S1.into()], &[hashed], None).expect("ok");
        let tokens = [t];
        assert_eq!(Principal::find(&tokens, S1).expect("first").name, "ops");
        assert_eq!(Principal::find(&tokens, S2).expect("second").name, "ops");
        assert!(Principal::find(&tokens, "0123456789abcdef-three").is_none());
    }

    #[test]
    fn bad_tokens_are_refused_at_load() {
        let agent = || {
            Some(AgentScope {
                agent_id: "bot".into(),
                namespaces: vec!["acme".into()],
            })
        };
        assert!(Token::new("a", Role::Agent, &[S1.into()], &[], None).is_err());
        assert!(Token::new("a", Role::Operator, &[S1.into()], &[], agent()).is_err());
        assert!(Token::new("a", Role::Viewer, &[], &[], None).is_err());
        assert!(Token::new("a", Role::Viewer, &["short".into()], &[], None).is_err());
        assert!(Token::new("a", Role::Viewer, &[], &["abcd".into()], None).is_err());
        let ok = Token::new("a", Role::Agent, &[S1.into()], &[], agent()).expect("agent");
        let twin = Token::new("b", Role::Viewer, &[S1.into()], &[], None).expect("viewer");
        let err = check_tokens(&[ok, twin]).expect_err("shared secret");
        assert!(err.to_string().contains("shared"), "{err}");
    }
}
