//! The `ToolAdapter` port and the HTTP adapter.
//!
//! An adapter decides once, at its edge, what a call observed — an
//! [`opgate_core::outcome::AdapterOutcome`] — with an exhaustive mapping from transport
//! errors and HTTP statuses; nothing downstream parses error strings. It also looks an
//! operation up by its idempotency key, for the reconciler.
#![forbid(unsafe_code)]

pub mod http;

use std::time::Duration;

use opgate_core::Operation;
use opgate_core::outcome::AdapterOutcome;
use serde_json::Value;
use uuid::Uuid;

pub use http::HttpAdapter;

/// What the dispatcher hands an adapter.
#[derive(Debug, Clone, Copy)]
pub struct DispatchRequest<'a> {
    /// The operation (canonical args, entity, ...).
    pub operation: &'a Operation,
    /// The attempt persisted before this call.
    pub attempt_id: Uuid,
    /// The key as sent to the provider (`{namespace}/{key}`).
    pub provider_key: &'a str,
    /// The W3C `traceparent` to send: the dispatcher's span for this call when traces
    /// are exported, else the operation's own (`None`: the operation's).
    pub traceparent: Option<&'a str>,
}

/// What one call observed.
#[derive(Debug, Clone, PartialEq)]
pub struct CallReport {
    /// The classified outcome.
    pub outcome: AdapterOutcome,
    /// HTTP status, if an answer arrived.
    pub http_status: Option<u16>,
    /// The normalized result (the body, or the part `result_pointer` selects).
    pub result: Option<Value>,
    /// The provider's object id (`external_id_pointer`).
    pub external_id: Option<String>,
    /// The provider's request id (response header), if any.
    pub provider_request_id: Option<String>,
    /// How long the call took.
    pub latency: Duration,
    /// A short description of a failure, for people.
    pub detail: Option<String>,
}

/// What a lookup by key found.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// The provider has the effect.
    Found {
        /// The normalized result.
        result: Option<Value>,
        /// The provider's object id.
        external_id: Option<String>,
    },
    /// The provider does not know the key (yet).
    NotFound,
    /// The lookup itself failed; nothing was learnt.
    Failed(String),
}

/// A way to call a tool.
#[async_trait::async_trait]
pub trait ToolAdapter: Send + Sync {
    /// Calls the tool once, passing the idempotency key and attempt id.
    async fn dispatch(&self, request: &DispatchRequest<'_>) -> CallReport;

    /// Looks an operation up at the provider by its key; `None` when the tool has no lookup.
    async fn lookup(&self, operation: &Operation, provider_key: &str) -> Option<Lookup>;
}
