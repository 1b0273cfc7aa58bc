//! The HTTP adapter, configured per tool by `[tools.adapter]`.
//!
//! Classification (exhaustive, decided here once):
//! - the connection could not be made (refused, DNS, TLS before the request was written)
//!   -> `NotSent`;
//! - any other transport failure — timeout, reset, a body cut short — after the request
//!   may have been written -> `SentNoAnswer` (opgate cannot tell, so it assumes it was sent);
//! - 429, or 503 with `Retry-After` -> `Throttled`;
//! - other 5xx -> `ServerError` (the tool's `five_xx` decides what that means);
//! - other 4xx -> `Rejected`;
//! - 202 -> `Committed { acknowledged: true }`; other 2xx -> `Committed` when the body is
//!   JSON (or empty), `Malformed` when it is not;
//! - 1xx/3xx -> `Malformed` (redirects are not followed: a provider must not move).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use opgate_core::outcome::AdapterOutcome;
use opgate_core::registry::{Adapter, Tool};
use opgate_core::template::{Placeholder, Template};
use opgate_core::{Operation, canonical};
use opgate_core::{envsubst, input};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::{CallReport, DispatchRequest, Lookup, ToolAdapter};

/// Headers opgate adds to every call, for tracing at the provider.
pub const OPERATION_HEADER: &str = "x-opgate-operation-id";
/// The attempt id header.
pub const ATTEMPT_HEADER: &str = "x-opgate-attempt-id";
/// The entity header (`{type}:{id}`).
pub const ENTITY_HEADER: &str = "x-opgate-entity";

/// Why an adapter cannot be built from its config.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// The tool has no `[tools.adapter]`.
    #[error("tool `{0}` has no [tools.adapter]")]
    NoAdapter(String),
    /// A value is invalid.
    #[error("tool `{tool}`: adapter.{field}: {message}")]
    Invalid {
        /// Tool.
        tool: String,
        /// Field.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// An HTTP tool.
#[derive(Debug, Clone)]
pub struct HttpAdapter {
    client: reqwest::Client,
    method: Method,
    url: Template,
    lookup_url: Option<Template>,
    headers: HeaderMap,
    idempotency_header: Option<HeaderName>,
    key_body_field: Option<String>,
    external_id_pointer: Option<String>,
    result_pointer: Option<String>,
}

impl HttpAdapter {
    /// Builds the adapter for a tool; `${ENV}` in the URL and headers is expanded with
    /// `env` (secrets stay out of the config file).
    pub fn new(tool: &Tool, env: impl Fn(&str) -> Option<String>) -> Result<Self, BuildError> {
        let adapter: &Adapter = tool
            .adapter
            .as_ref()
            .ok_or_else(|| BuildError::NoAdapter(tool.name.clone()))?;
        let invalid = |field: &'static str, message: String| BuildError::Invalid {
            tool: tool.name.clone(),
            field,
            message,
        };
        let config = &adapter.config;
        let expand_template = |field: &'static str, t: &Template| {
            envsubst::expand(t.source(), &env)
                .map_err(|e| invalid(field, e.to_string()))
                .and_then(|s| Template::parse(&s).map_err(|e| invalid(field, e.to_string())))
        };
        let mut headers = HeaderMap::new();
        for (name, value) in &config.headers {
            let value =
                envsubst::expand(value, &env).map_err(|e| invalid("headers", e.to_string()))?;
            let name = HeaderName::try_from(name.as_str())
                .map_err(|e| invalid("headers", e.to_string()))?;
            let mut value =
                HeaderValue::try_from(value).map_err(|e| invalid("headers", e.to_string()))?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        let client = reqwest::Client::builder()
            .timeout(adapter.timeout)
            .connect_timeout(adapter.timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| invalid("timeout_ms", e.to_string()))?;
        Ok(Self {
            client,
            method: Method::from_bytes(config.method.as_deref().unwrap_or("POST").as_bytes())
                .map_err(|e| invalid("method", e.to_string()))?,
            url: expand_template("url", &adapter.url)?,
            lookup_url: adapter
                .lookup_url
                .as_ref()
                .map(|t| expand_template("lookup_url", t))
                .transpose()?,
            headers,
            idempotency_header: config
                .idempotency_header
                .as_deref()
                .map(HeaderName::try_from)
                .transpose()
                .map_err(|e| invalid("idempotency_header", e.to_string()))?,
            key_body_field: config.key_body_field.clone(),
            external_id_pointer: config.external_id_pointer.clone(),
            result_pointer: config.result_pointer.clone(),
        })
    }

    fn body(&self, operation: &Operation, key: &str) -> Value {
        let mut body = operation.canonical_args.clone();
        if let (Some(field), Value::Object(map)) = (&self.key_body_field, &mut body) {
            map.insert(field.clone(), Value::String(key.to_owned()));
        }
        body
    }

    /// The result and external id a success body carries.
    /// The result and the provider's object id from an answer, made storable (a NUL in
    /// a provider's answer must not make its outcome unrecordable).
    fn extract(&self, body: &Value) -> (Option<Value>, Option<String>) {
        let result = match &self.result_pointer {
            Some(p) => body.pointer(p).cloned(),
            None => Some(body.clone()),
        };
        let external_id = self
            .external_id_pointer
            .as_deref()
            .and_then(|p| body.pointer(p))
            .map(|v| match v {
                Value::String(s) => s.clone(),
                other => canonical::canonical_json(other),
            });
        (
            result.map(input::storable),
            external_id.map(|id| input::storable_text(&id)),
        )
    }
}

/// Renders a URL template: path-safe and query-safe percent-encoding of every value.
fn render(template: &Template, operation: &Operation, key: &str) -> String {
    let rendered: Result<String, ()> = template.render(|ph| {
        let raw = match ph {
            Placeholder::Key => key.to_owned(),
            Placeholder::Entity => operation.entity.id.clone(),
            Placeholder::EntityType => operation.entity.kind.clone(),
            Placeholder::Tool => operation.tool.clone(),
            Placeholder::Intent => operation.intent.clone().unwrap_or_default(),
            Placeholder::Namespace => operation.namespace.clone(),
            Placeholder::WorkflowId => operation.workflow_id.clone().unwrap_or_default(),
            Placeholder::Step => operation.step.map(|s| s.to_string()).unwrap_or_default(),
            Placeholder::Arg(name) => match operation.canonical_args.get(name) {
                Some(Value::String(s)) => s.clone(),
                Some(other) => canonical::canonical_json(other),
                None => String::new(),
            },
            Placeholder::Result(field) => operation
                .result
                .as_ref()
                .and_then(|r| r.get(field))
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => canonical::canonical_json(other),
                })
                .unwrap_or_default(),
        };
        Ok(percent_encode(&raw))
    });
    rendered.unwrap_or_default()
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

fn request_id(headers: &HeaderMap) -> Option<String> {
    ["request-id", "x-request-id", "x-amzn-requestid"]
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The outcome of an HTTP answer (status, headers, body text).
pub fn classify_response(
    status: StatusCode,
    headers: &HeaderMap,
    body: &str,
) -> (AdapterOutcome, Option<Value>) {
    let code = status.as_u16();
    let parsed: Option<Value> = if body.trim().is_empty() {
        Some(Value::Null)
    } else {
        serde_json::from_str(body).ok()
    };
    let outcome = match code {
        429 => AdapterOutcome::Throttled {
            retry_after: retry_after(headers),
        },
        503 if retry_after(headers).is_some() => AdapterOutcome::Throttled {
            retry_after: retry_after(headers),
        },
        500..=599 => AdapterOutcome::ServerError { status: code },
        400..=499 => AdapterOutcome::Rejected { status: Some(code) },
        202 => AdapterOutcome::Committed { acknowledged: true },
        200..=299 if parsed.is_some() => AdapterOutcome::Committed {
            acknowledged: false,
        },
        _ => AdapterOutcome::Malformed,
    };
    (outcome, parsed)
}

/// The report of a call refused before sending: a required header value is not valid.
fn unsendable(header: &HeaderName) -> CallReport {
    CallReport {
        outcome: AdapterOutcome::Unsendable,
        http_status: None,
        result: None,
        external_id: None,
        provider_request_id: None,
        latency: Duration::ZERO,
        detail: Some(format!(
            "the value of header `{header}` is not a valid HTTP header value; nothing was sent"
        )),
    }
}

/// The outcome of a transport error.
fn classify_error(error: &reqwest::Error) -> AdapterOutcome {
    if error.is_connect() || error.is_builder() {
        AdapterOutcome::NotSent
    } else {
        AdapterOutcome::SentNoAnswer
    }
}

#[async_trait::async_trait]
impl ToolAdapter for HttpAdapter {
    async fn dispatch(&self, request: &DispatchRequest<'_>) -> CallReport {
        let op = request.operation;
        let url = render(&self.url, op, request.provider_key);
        let mut headers = self.headers.clone();
        let mut tracing_headers: BTreeMap<&str, String> = BTreeMap::new();
        tracing_headers.insert(OPERATION_HEADER, op.operation_id.to_string());
        tracing_headers.insert(ATTEMPT_HEADER, request.attempt_id.to_string());
        if let Some(tp) = request.traceparent.or(op.traceparent.as_deref()) {
            tracing_headers.insert("traceparent", tp.to_owned());
        }
        for (name, value) in tracing_headers {
            // A traceparent is advisory: one that is not a valid header value is left out.
            if let Ok(value) = HeaderValue::try_from(value) {
                headers.insert(name, value);
            }
        }
        // The key and the entity are not advisory: a call without them could duplicate
        // an effect, so a value that cannot travel in a header stops the call here.
        let entity = format!("{}:{}", op.entity.kind, op.entity.id);
        let required = std::iter::once((HeaderName::from_static(ENTITY_HEADER), entity.as_str()))
            .chain(
                self.idempotency_header
                    .iter()
                    .map(|h| (h.clone(), request.provider_key)),
            );
        for (name, value) in required {
            match HeaderValue::from_str(value) {
                Ok(value) => {
                    headers.insert(name, value);
                }
                Err(_) => return unsendable(&name),
            }
        }
        let started = Instant::now();
        let sent = self
            .client
            .request(self.method.clone(), &url)
            .headers(headers)
            .json(&self.body(op, request.provider_key))
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => {
                return CallReport {
                    outcome: classify_error(&e),
                    http_status: None,
                    result: None,
                    external_id: None,
                    provider_request_id: None,
                    latency: started.elapsed(),
                    detail: Some(e.to_string()),
                };
            }
        };
        let status = response.status();
        let response_headers = response.headers().clone();
        let body = match response.text().await {
            Ok(b) => b,
            Err(e) => {
                // The provider answered but the body was cut short: it may have acted.
                return CallReport {
                    outcome: AdapterOutcome::SentNoAnswer,
                    http_status: Some(status.as_u16()),
                    result: None,
                    external_id: None,
                    provider_request_id: request_id(&response_headers),
                    latency: started.elapsed(),
                    detail: Some(e.to_string()),
                };
            }
        };
        let (outcome, parsed) = classify_response(status, &response_headers, &body);
        let (result, external_id) = match (&outcome, &parsed) {
            (AdapterOutcome::Committed { .. }, Some(v)) => self.extract(v),
            _ => (None, None),
        };
        let detail = match &outcome {
            AdapterOutcome::Committed { .. } => None,
            _ => Some(input::storable_text(&format!(
                "HTTP {}: {}",
                status.as_u16(),
                body.chars().take(200).collect::<String>()
            ))),
        };
        CallReport {
            outcome,
            http_status: Some(status.as_u16()),
            result,
            external_id,
            provider_request_id: request_id(&response_headers),
            latency: started.elapsed(),
            detail,
        }
    }

    async fn lookup(&self, operation: &Operation, provider_key: &str) -> Option<Lookup> {
        let template = self.lookup_url.as_ref()?;
        let url = render(template, operation, provider_key);
        let response = match self
            .client
            .get(&url)
            .headers(self.headers.clone())
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) => return Some(Lookup::Failed(e.to_string())),
        };
        let status = response.status();
        if status == StatusCode::NOT_FOUND {
            return Some(Lookup::NotFound);
        }
        if !status.is_success() {
            return Some(Lookup::Failed(format!(
                "lookup answered HTTP {}",
                status.as_u16()
            )));
        }
        Some(match response.json::<Value>().await {
            Ok(body) => {
                let (result, external_id) = self.extract(&body);
                Lookup::Found {
                    result,
                    external_id,
                }
            }
            Err(e) => Lookup::Failed(format!("lookup body: {e}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("value"));
        }
        h
    }

    #[test]
    fn every_status_class_is_classified() {
        let none = HeaderMap::new();
        let c = |code: u16, h: &HeaderMap, body: &str| {
            classify_response(StatusCode::from_u16(code).expect("code"), h, body).0
        };
        assert_eq!(
            c(200, &none, r#"{"id": 1}"#),
            AdapterOutcome::Committed {
                acknowledged: false
            }
        );
        assert_eq!(
            c(201, &none, ""),
            AdapterOutcome::Committed {
                acknowledged: false
            }
        );
        assert_eq!(
            c(202, &none, ""),
            AdapterOutcome::Committed { acknowledged: true }
        );
        assert_eq!(c(200, &none, "<html>oops"), AdapterOutcome::Malformed);
        assert_eq!(c(302, &none, ""), AdapterOutcome::Malformed);
        assert_eq!(
            c(400, &none, "{}"),
            AdapterOutcome::Rejected { status: Some(400) }
        );
        assert_eq!(
            c(422, &none, "{}"),
            AdapterOutcome::Rejected { status: Some(422) }
        );
        assert_eq!(
            c(429, &headers(&[("retry-after", "3")]), ""),
            AdapterOutcome::Throttled {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        assert_eq!(
            c(429, &none, ""),
            AdapterOutcome::Throttled { retry_after: None }
        );
        assert_eq!(
            c(503, &headers(&[("retry-after", "1")]), ""),
            AdapterOutcome::Throttled {
                retry_after: Some(Duration::from_secs(1))
            }
        );
        assert_eq!(
            c(503, &none, ""),
            AdapterOutcome::ServerError { status: 503 }
        );
        assert_eq!(
            c(500, &none, ""),
            AdapterOutcome::ServerError { status: 500 }
        );
    }

    #[test]
    fn percent_encoding_keeps_keys_intact_in_urls() {
        assert_eq!(
            percent_encode("acme/payment:o 1:v1"),
            "acme%2Fpayment%3Ao%201%3Av1"
        );
        assert_eq!(percent_encode("plain-Key_1.~"), "plain-Key_1.~");
    }
}
