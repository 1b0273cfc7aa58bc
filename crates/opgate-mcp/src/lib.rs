//! `opgate mcp`: opgate as a Model Context Protocol server (the official Rust SDK, `rmcp`),
//! over stdio or streamable HTTP.
//!
//! - `tools/list` serves the registry's tools the session's token may propose (`GET
//!   /v1/tools`), each with its description and an `inputSchema`: the entity the call
//!   acts on (`entity_id`), the `intent` when the tool declares intents, `workflow_id` and
//!   `step` when its key is per workflow step, and `args` — the tool's `args_schema`.
//!   Plus `opgate_wait_for_result`.
//! - `tools/call` becomes a proposal (`POST /v1/proposals`, event id `mcp-<uuid>`), waits
//!   for it to settle (up to `--wait`), and returns the normalized result as structured
//!   content: `status`, `result`, `error`, `retry_recommendation`, `safe_user_message`,
//!   the operation id and key, and whether it was a duplicate. A second identical call is
//!   answered from the ledger by the key — never executed twice. An operation still in
//!   flight returns its id and `retry_recommendation = "wait_for_result"` (or
//!   `reconcile_before_retry`): the model calls `opgate_wait_for_result`.
//!
//! The server is a client of opgate's admin API and keeps no state: over stdio it uses
//! the token it was started with; over HTTP each request's own `Authorization: Bearer`
//! token (an agent token binds the calls to its `agent_id` and namespaces).
#![forbid(unsafe_code)]

mod api;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use opgate_api::views::{OperationView, ProposalAnswer, ToolView};
use opgate_core::Status;
use opgate_core::operation::safe_user_message;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use crate::api::Api;

/// The extra tool that waits for an operation still in flight.
pub const WAIT_TOOL: &str = "opgate_wait_for_result";

/// How the server reaches opgate and proposes.
#[derive(Debug, Clone)]
pub struct McpConfig {
    /// opgate's admin API, e.g. `http://127.0.0.1:8080`.
    pub api_url: String,
    /// The token of a stdio session (an agent token, usually). Over HTTP each request
    /// brings its own.
    pub token: Option<String>,
    /// The namespace proposals go to.
    pub namespace: String,
    /// How long a call waits for its operation to settle before answering "in flight".
    pub wait: Duration,
}

/// The MCP handler: one per session.
#[derive(Clone)]
pub struct Gateway {
    api: Api,
    config: Arc<McpConfig>,
}

impl Gateway {
    /// A handler for `config`.
    pub fn new(config: McpConfig) -> anyhow::Result<Self> {
        Ok(Self {
            api: Api::new(&config.api_url)?,
            config: Arc::new(config),
        })
    }

    /// The session's token: the HTTP request's bearer token, else the configured one.
    fn token(&self, context: &RequestContext<RoleServer>) -> Result<String, ErrorData> {
        if let Some(parts) = context.extensions.get::<axum::http::request::Parts>() {
            return parts
                .headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(opgate_api::auth::bearer)
                .map(str::to_owned)
                .ok_or_else(|| ErrorData::invalid_request("a bearer token is required", None));
        }
        self.config.token.clone().ok_or_else(|| {
            ErrorData::invalid_request("opgate mcp was started without a token", None)
        })
    }

    async fn call(&self, name: &str, args: Map<String, Value>, token: &str) -> CallToolResult {
        let outcome = if name == WAIT_TOOL {
            self.wait_for(&args, token).await
        } else {
            self.propose(name, args, token).await
        };
        outcome
            .unwrap_or_else(|e| CallToolResult::error(vec![ContentBlock::text(format!("{e:#}"))]))
    }

    /// One call: propose, wait, answer.
    async fn propose(
        &self,
        tool: &str,
        mut input: Map<String, Value>,
        token: &str,
    ) -> anyhow::Result<CallToolResult> {
        let text = |v: Option<Value>| v.and_then(|v| v.as_str().map(str::to_owned));
        let Some(entity_id) = text(input.remove("entity_id")) else {
            return Ok(refusal("field `entity_id` (a string) is required"));
        };
        let tools = self.api.tools(token).await?;
        let Some(spec) = tools.tools.iter().find(|t| t.name == tool) else {
            return Ok(refusal(&format!(
                "tool `{tool}` is not one this token may propose"
            )));
        };
        let entity_type = match (&spec.entity_type, text(input.remove("entity_type"))) {
            (Some(declared), _) => declared.clone(),
            (None, Some(given)) => given,
            (None, None) => "default".to_owned(),
        };
        let mut proposal = json!({
            "event_id": format!("mcp-{}", uuid::Uuid::now_v7()),
            "namespace": self.config.namespace,
            "tool": tool,
            "entity": {"type": entity_type, "id": entity_id},
            "args": input.remove("args").unwrap_or_else(|| json!({})),
        });
        for field in ["intent", "workflow_id", "step"] {
            if let Some(value) = input.remove(field) {
                proposal[field] = value;
            }
        }
        if let Some(extra) = input.keys().next() {
            return Ok(refusal(&format!(
                "unknown field `{extra}`: the tool's arguments go in `args`"
            )));
        }
        let answer = self.api.propose(token, &proposal).await?;
        let Some(op) = &answer.operation else {
            return Ok(rejected(&answer));
        };
        let op = if op.is_settled() {
            op.clone()
        } else {
            let id = op.operation_id.to_string();
            self.api.operation(token, &id, self.config.wait).await?
        };
        Ok(normalized(&op, Some(&answer)))
    }

    /// `opgate_wait_for_result {operation_id, wait_seconds}`.
    async fn wait_for(
        &self,
        args: &Map<String, Value>,
        token: &str,
    ) -> anyhow::Result<CallToolResult> {
        let Some(id) = args.get("operation_id").and_then(Value::as_str) else {
            return Ok(refusal("field `operation_id` (a string) is required"));
        };
        let wait = args
            .get("wait_seconds")
            .and_then(Value::as_u64)
            .map_or(self.config.wait, Duration::from_secs)
            .min(Duration::from_secs(60));
        let op = self.api.operation(token, id, wait).await?;
        Ok(normalized(&op, None))
    }
}

/// A call opgate refused before any work: the model must not retry it as it is.
fn refusal(message: &str) -> CallToolResult {
    CallToolResult::structured_error(json!({
        "status": "rejected",
        "reason": "invalid_call",
        "message": message,
        "retry_recommendation": "do_not_retry",
        "safe_user_message": safe_user_message(Status::Rejected),
    }))
}

fn rejected(answer: &ProposalAnswer) -> CallToolResult {
    CallToolResult::structured_error(json!({
        "status": "rejected",
        "reason": answer.reason,
        "message": answer.message,
        "retry_recommendation": "do_not_retry",
        "safe_user_message": safe_user_message(Status::Rejected),
    }))
}

/// The normalized result a model gets back.
fn normalized(op: &OperationView, answer: Option<&ProposalAnswer>) -> CallToolResult {
    let mut body = json!({
        "operation_id": op.operation_id,
        "status": op.status,
        "result": op.result,
        "error": op.error,
        "retry_recommendation": op.retry_recommendation,
        "safe_user_message": op.safe_user_message,
        "idempotency_key": op.idempotency_key,
    });
    if let Some(answer) = answer {
        body["deduplicated"] = json!(answer.decision == "deduplicated");
        body["dedupe_reason"] = json!(answer.reason);
    }
    if !op.is_settled() {
        body["next"] = json!(format!(
            "still in flight: call {WAIT_TOOL} with operation_id {} (do not call the tool again)",
            op.operation_id
        ));
    }
    if matches!(
        op.status.as_str(),
        "failed_permanent" | "rejected" | "cancelled"
    ) {
        CallToolResult::structured_error(body)
    } else {
        CallToolResult::structured(body)
    }
}

/// A registry tool as an MCP tool.
fn mcp_tool(spec: &ToolView) -> Tool {
    let mut properties = Map::new();
    let entity_about = match &spec.entity_type {
        Some(kind) => format!("The id of the {kind} this acts on."),
        None => "The id of the entity this acts on.".to_owned(),
    };
    properties.insert(
        "entity_id".into(),
        json!({"type": "string", "description": entity_about}),
    );
    let mut required = vec![json!("entity_id"), json!("args")];
    if spec.entity_type.is_none() {
        properties.insert(
            "entity_type".into(),
            json!({"type": "string", "description": "The kind of entity (e.g. user, order)."}),
        );
        required.push(json!("entity_type"));
    }
    if spec.key_strategy == "workflow_step" {
        properties.insert(
            "workflow_id".into(),
            json!({"type": "string", "description": "The workflow this call belongs to: one effect per workflow step."}),
        );
        properties.insert(
            "step".into(),
            json!({"type": "integer", "minimum": 0, "description": "The step within the workflow."}),
        );
        required.push(json!("workflow_id"));
        required.push(json!("step"));
    }
    if !spec.intents.is_empty() {
        properties.insert(
            "intent".into(),
            json!({"type": "string", "enum": spec.intents}),
        );
        required.push(json!("intent"));
    }
    properties.insert("args".into(), spec.args_schema.clone());
    let schema = json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    });
    let description = format!(
        "{} [{}{}; opgate executes it at most once per business key and reports the outcome]",
        spec.description.as_deref().unwrap_or("A registered tool."),
        spec.side_effect_class,
        if spec.approval_required {
            ", a person approves each call"
        } else {
            ""
        },
    );
    Tool::new(
        spec.name.clone(),
        description,
        schema.as_object().cloned().unwrap_or_default(),
    )
}

fn wait_tool() -> Tool {
    let schema = json!({
        "type": "object",
        "properties": {
            "operation_id": {"type": "string", "description": "The operation a call answered with."},
            "wait_seconds": {"type": "integer", "minimum": 0, "maximum": 60},
        },
        "required": ["operation_id"],
        "additionalProperties": false,
    });
    Tool::new(
        WAIT_TOOL,
        "Waits for an operation still in flight and returns its current result (status, result, retry_recommendation, safe_user_message).",
        schema.as_object().cloned().unwrap_or_default(),
    )
}

impl ServerHandler for Gateway {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("opgate", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Each tool call is a proposal: opgate derives its business key, executes it at most once, and answers with the outcome. Calling again with the same arguments returns the same operation. When a result says `wait_for_result`, call opgate_wait_for_result instead of calling the tool again.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let token = self.token(&context)?;
        let tools = self
            .api
            .tools(&token)
            .await
            .map_err(|e| ErrorData::internal_error(format!("{e:#}"), None))?;
        let mut list: Vec<Tool> = tools.tools.iter().map(mcp_tool).collect();
        list.push(wait_tool());
        Ok(ListToolsResult::with_all_items(list))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let token = self.token(&context)?;
        let name: Cow<'_, str> = request.name;
        Ok(self
            .call(&name, request.arguments.unwrap_or_default(), &token)
            .await
            .into())
    }
}

/// Serves MCP on this process's stdin/stdout until the client closes it.
pub async fn serve_stdio(config: McpConfig) -> anyhow::Result<()> {
    let service = Gateway::new(config)?
        .serve(rmcp::transport::stdio())
        .await?;
    service.waiting().await?;
    Ok(())
}

/// Serves streamable HTTP at `/mcp` on `addr` until `cancel`; every request must carry
/// `Authorization: Bearer <opgate token>`.
pub async fn serve_http(
    config: McpConfig,
    addr: SocketAddr,
    cancel: CancellationToken,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let gateway = Gateway::new(config)?;
    let service = StreamableHttpService::new(
        move || Ok(gateway.clone()),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default().with_cancellation_token(cancel.child_token()),
    );
    let router = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(middleware::from_fn(require_bearer));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        let stopped = cancel.clone();
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await
        {
            tracing::error!(error = %e, "MCP HTTP server stopped");
        }
    });
    Ok((bound, handle))
}

/// Refuses a request without a bearer token before it reaches MCP (opgate's API checks
/// the token itself on every call).
async fn require_bearer(request: Request, next: Next) -> Response {
    let has_bearer = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(opgate_api::auth::bearer)
        .is_some();
    if !has_bearer {
        return (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "an `Authorization: Bearer <opgate token>` header is required",
        )
            .into_response();
    }
    next.run(request).await
}
