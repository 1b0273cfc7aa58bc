//! `opgate propose` and `opgate ops ...`: a client of the admin HTTP API. Readable
//! tables by default, the API's JSON with `--json`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
use opgate_api::views::{
    CompensationAnswer, ErrorAnswer, EventView, EventsView, OperationView, PageView, ProposalAnswer,
};
use serde_json::{Map, Value, json};

/// Where the API is and who is asking.
#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    /// The admin API's base URL (`opgate dev` prints it).
    #[arg(
        long,
        global = true,
        env = "OPGATE_API_URL",
        default_value = "http://127.0.0.1:8080"
    )]
    pub api_url: String,
    /// A bearer token (viewer for reading, operator for acting and proposing).
    #[arg(long, global = true, env = "OPGATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

/// `opgate propose`.
#[derive(Debug, Args)]
pub struct ProposeArgs {
    /// The registered tool.
    #[arg(long, required_unless_present = "file")]
    pub tool: Option<String>,
    /// The entity, as `type:id` (e.g. `order:order_123`).
    #[arg(long, required_unless_present = "file")]
    pub entity: Option<String>,
    /// The arguments, a JSON object.
    #[arg(long, default_value = "{}")]
    pub args: String,
    /// The event id (default: a fresh one; reuse one to redeliver).
    #[arg(long)]
    pub event_id: Option<String>,
    /// Namespace of the key.
    #[arg(long)]
    pub namespace: Option<String>,
    /// The proposing agent.
    #[arg(long)]
    pub agent_id: Option<String>,
    /// Intent label.
    #[arg(long)]
    pub intent: Option<String>,
    /// Workflow id.
    #[arg(long)]
    pub workflow_id: Option<String>,
    /// Run id.
    #[arg(long)]
    pub run_id: Option<String>,
    /// Step within the workflow.
    #[arg(long)]
    pub step: Option<u64>,
    /// The whole proposal as JSON from a file (`-` for stdin), as on the topic.
    #[arg(long, conflicts_with_all = ["tool", "entity"])]
    pub file: Option<PathBuf>,
    /// Wait up to this long (e.g. `10s`) for the operation to settle, then show it.
    #[arg(long)]
    pub wait: Option<String>,
    /// API options.
    #[command(flatten)]
    pub api: ApiArgs,
}

/// `opgate ops ...`.
#[derive(Debug, Args)]
pub struct OpsArgs {
    /// The verb.
    #[command(subcommand)]
    pub command: OpsCommand,
    /// API options.
    #[command(flatten)]
    pub api: ApiArgs,
}

/// Operator verbs (DESIGN.md section 6).
#[derive(Debug, Subcommand)]
pub enum OpsCommand {
    /// Operations, newest first.
    List {
        /// Only this state (e.g. needs_attention).
        #[arg(long)]
        status: Option<String>,
        /// Only this tool.
        #[arg(long)]
        tool: Option<String>,
        /// Only this entity, as `type:id`.
        #[arg(long)]
        entity: Option<String>,
        /// Only this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only this idempotency key.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Page size (at most 500).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// The cursor a previous page printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// One operation.
    Show {
        /// Operation id, or its start (4 hex digits or more) when only one id begins so.
        id: String,
        /// Wait up to this long (e.g. `10s`) for it to settle.
        #[arg(long)]
        wait: Option<String>,
    },
    /// An operation's history.
    Events {
        /// Operation id, or its start (4 hex digits or more) when only one id begins so.
        id: String,
        /// Keep printing new events until the operation settles (with --json: one event
        /// per line).
        #[arg(long, short)]
        follow: bool,
    },
    /// Approve an operation awaiting approval.
    Approve {
        /// Operation id (whole: a command never acts on a shortened id).
        id: String,
        /// Why (recorded in the history).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Reject an operation awaiting approval.
    Reject {
        /// Operation id (whole: a command never acts on a shortened id).
        id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Cancel an operation that has not been sent.
    Cancel {
        /// Operation id (whole: a command never acts on a shortened id).
        id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Settle an unknown outcome or a needs_attention operation by hand.
    Resolve {
        /// Operation id (whole: a command never acts on a shortened id).
        id: String,
        /// What happened at the provider.
        #[arg(long, value_parser = ["succeeded", "noop", "failed", "redispatch"])]
        resolution: String,
        /// The provider's result (JSON), for `succeeded`.
        #[arg(long)]
        result: Option<String>,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Undo a completed operation with its tool's compensation.
    Compensate {
        /// Operation id (whole: a command never acts on a shortened id).
        id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
}

/// A thin client of the admin API.
struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    fn new(api: &ApiArgs) -> anyhow::Result<Self> {
        Ok(Self {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(90))
                .build()?,
            base: api.api_url.trim_end_matches('/').to_owned(),
            token: api.token.clone(),
        })
    }

    /// An operation's history.
    async fn events(&self, id: &str) -> anyhow::Result<EventsView> {
        let path = format!("/v1/operations/{id}/events");
        self.call(reqwest::Method::GET, &path, &[], None).await
    }

    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
    ) -> anyhow::Result<T> {
        let Some(token) = &self.token else {
            bail!("no token: set OPGATE_TOKEN or pass --token (`opgate dev` prints one)");
        };
        let url = format!("{}{path}", self.base);
        let mut request = self
            .http
            .request(method, &url)
            .bearer_auth(token)
            .query(query);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("calling {url}"))?;
        let status = response.status();
        let text = response.text().await?;
        // A refused proposal (422) is an answer `propose` prints; anywhere else it fails.
        if status.is_success()
            || (status == reqwest::StatusCode::UNPROCESSABLE_ENTITY && path == "/v1/proposals")
        {
            return serde_json::from_str(&text).with_context(|| {
                format!("{url} answered {status} with an unexpected body: {text}")
            });
        }
        match serde_json::from_str::<ErrorAnswer>(&text) {
            Ok(e) => bail!("{status}: {} ({})", e.error.code, e.error.message),
            Err(_) => bail!("{status}: {text}"),
        }
    }
}

/// Runs `opgate propose`.
pub async fn propose(args: ProposeArgs) -> anyhow::Result<()> {
    let client = Client::new(&args.api)?;
    let proposal = match &args.file {
        Some(path) => {
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin())?
            } else {
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?
            };
            serde_json::from_str(&text).context("the proposal file is not JSON")?
        }
        None => build_proposal(&args)?,
    };
    let answer: ProposalAnswer = client
        .call(reqwest::Method::POST, "/v1/proposals", &[], Some(proposal))
        .await?;
    let settled: Option<OperationView> = match (&args.wait, &answer.operation) {
        (Some(wait), Some(op)) => Some(
            client
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{}", op.operation_id),
                    &[("wait", wait.clone())],
                    None,
                )
                .await?,
        ),
        _ => None,
    };
    if args.api.json {
        let mut out = answer.clone();
        if let Some(op) = &settled {
            out.operation = Some(op.clone());
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return unsettled(&args.wait, settled.as_ref());
    }
    println!(
        "{} {}{}",
        answer.decision,
        answer.event_id,
        answer
            .reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    if let Some(message) = &answer.message {
        println!("  {message}");
    }
    if let Some(op) = settled.as_ref().or(answer.operation.as_ref()) {
        print_operation(op);
    }
    if answer.decision == "rejected" {
        bail!("the proposal was rejected");
    }
    unsettled(&args.wait, settled.as_ref())
}

/// `propose --wait` fails when the operation has not settled in time.
fn unsettled(wait: &Option<String>, settled: Option<&OperationView>) -> anyhow::Result<()> {
    match (wait, settled) {
        (Some(wait), Some(op)) if !op.is_settled() => bail!(
            "operation {} is still {} after --wait {wait} (is a dispatcher running?)",
            op.operation_id,
            op.status
        ),
        _ => Ok(()),
    }
}

fn build_proposal(args: &ProposeArgs) -> anyhow::Result<Value> {
    let entity = args.entity.as_deref().unwrap_or_default();
    let Some((kind, id)) = entity.split_once(':') else {
        bail!("--entity must be `type:id`, e.g. order:order_123 (got `{entity}`)");
    };
    let parsed: Value = serde_json::from_str(&args.args).context("--args is not JSON")?;
    if !parsed.is_object() {
        bail!("--args must be a JSON object, e.g. '{{\"amount\": \"49.00\"}}'");
    }
    let mut p = Map::new();
    let event_id = args
        .event_id
        .clone()
        .unwrap_or_else(|| format!("cli-{}", uuid::Uuid::now_v7()));
    p.insert("event_id".into(), json!(event_id));
    for (name, value) in [
        ("namespace", &args.namespace),
        ("agent_id", &args.agent_id),
        ("intent", &args.intent),
        ("workflow_id", &args.workflow_id),
        ("run_id", &args.run_id),
    ] {
        if let Some(v) = value {
            p.insert(name.into(), json!(v));
        }
    }
    if let Some(step) = args.step {
        p.insert("step".into(), json!(step));
    }
    p.insert("tool".into(), json!(args.tool));
    p.insert("entity".into(), json!({"type": kind, "id": id}));
    p.insert("args".into(), parsed);
    Ok(Value::Object(p))
}

/// Runs `opgate ops ...`.
pub async fn ops(args: OpsArgs) -> anyhow::Result<()> {
    let client = Client::new(&args.api)?;
    let json_out = args.api.json;
    let act = |id: &str, action: &str, body: Value| {
        let path = format!("/v1/operations/{id}/{action}");
        let client = &client;
        async move {
            client
                .call(reqwest::Method::POST, &path, &[], Some(body))
                .await
        }
    };
    let reason_body = |reason: &Option<String>| match reason {
        Some(r) => json!({"reason": r}),
        None => json!({}),
    };
    let op: OperationView = match &args.command {
        OpsCommand::List {
            status,
            tool,
            entity,
            namespace,
            idempotency_key,
            limit,
            cursor,
        } => {
            let mut query = vec![("limit", limit.to_string())];
            for (name, value) in [
                ("status", status),
                ("tool", tool),
                ("entity", entity),
                ("namespace", namespace),
                ("idempotency_key", idempotency_key),
                ("cursor", cursor),
            ] {
                if let Some(v) = value {
                    query.push((name, v.clone()));
                }
            }
            let page: PageView = client
                .call(reqwest::Method::GET, "/v1/operations", &query, None)
                .await?;
            return if json_out {
                print_json(&page)
            } else {
                print_list(&page);
                Ok(())
            };
        }
        OpsCommand::Show { id, wait } => {
            let query: Vec<(&str, String)> = wait.iter().map(|w| ("wait", w.clone())).collect();
            client
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{id}"),
                    &query,
                    None,
                )
                .await?
        }
        OpsCommand::Events { id, follow: false } => {
            let events = client.events(id).await?;
            return if json_out {
                print_json(&events)
            } else {
                print_events_header();
                events.events.iter().for_each(print_event);
                Ok(())
            };
        }
        OpsCommand::Events { id, follow: true } => {
            return follow_events(&client, id, json_out).await;
        }
        OpsCommand::Approve { id, reason } => act(id, "approve", reason_body(reason)).await?,
        OpsCommand::Reject { id, reason } => act(id, "reject", reason_body(reason)).await?,
        OpsCommand::Cancel { id, reason } => act(id, "cancel", reason_body(reason)).await?,
        OpsCommand::Resolve {
            id,
            resolution,
            result,
            reason,
        } => {
            let mut body = reason_body(reason);
            body["resolution"] = json!(resolution);
            if let Some(result) = result {
                body["result"] = serde_json::from_str(result).context("--result is not JSON")?;
            }
            act(id, "resolve", body).await?
        }
        OpsCommand::Compensate { id, reason } => {
            let answer: CompensationAnswer = client
                .call(
                    reqwest::Method::POST,
                    &format!("/v1/operations/{id}/compensate"),
                    &[],
                    Some(reason_body(reason)),
                )
                .await?;
            return if json_out {
                print_json(&answer)
            } else {
                print_operation(&answer.operation);
                println!("compensation:");
                print_operation(&answer.compensation);
                Ok(())
            };
        }
    };
    if json_out {
        print_json(&op)
    } else {
        print_operation(&op);
        Ok(())
    }
}

/// `--json`: the API's answer as it came.
fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// An optional value as a table cell (`-` when absent).
fn cell<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn print_operation(op: &OperationView) {
    let json = |v: &Option<Value>| cell(v.as_ref());
    let rows = [
        ("operation", op.operation_id.to_string()),
        ("status", op.status.clone()),
        ("tool", op.tool.clone()),
        ("entity", format!("{}:{}", op.entity.kind, op.entity.id)),
        ("idempotency key", op.idempotency_key.clone()),
        ("namespace", op.namespace.clone()),
        ("agent", cell(op.agent_id.as_ref())),
        (
            "workflow / step",
            format!("{} / {}", cell(op.workflow_id.as_ref()), cell(op.step)),
        ),
        ("args", op.canonical_args.to_string()),
        ("attempts", op.attempt_count.to_string()),
        ("next attempt", cell(op.next_attempt_at.as_ref())),
        ("external id", cell(op.external_id.as_ref())),
        ("result", json(&op.result)),
        (
            "error",
            cell(
                op.error
                    .as_ref()
                    .and_then(|e| serde_json::to_string(e).ok()),
            ),
        ),
        ("compensates", cell(op.compensates)),
        ("created", op.created_at.clone()),
        ("updated", op.updated_at.clone()),
    ];
    for (name, value) in rows {
        if value != "-" && value != "- / -" {
            println!("  {name:<16} {value}");
        }
    }
}

fn print_list(page: &PageView) {
    println!(
        "{:<36}  {:<18}  {:<24}  {:<17}  {:>3}  KEY",
        "OPERATION", "TOOL", "ENTITY", "STATUS", "TRY"
    );
    for op in &page.operations {
        println!(
            "{:<36}  {:<18}  {:<24}  {:<17}  {:>3}  {}",
            op.operation_id,
            op.tool,
            format!("{}:{}", op.entity.kind, op.entity.id),
            op.status,
            op.attempt_count,
            op.idempotency_key,
        );
    }
    match &page.next_cursor {
        Some(cursor) => println!(
            "({} shown; next page: --cursor {cursor})",
            page.operations.len()
        ),
        None => println!("({} shown)", page.operations.len()),
    }
}

fn print_events_header() {
    println!(
        "{:>5}  {:<24}  {:<36}  {:<28}  ACTOR",
        "SEQ", "AT", "TRANSITION", "REASON"
    );
}

fn print_event(e: &EventView) {
    println!(
        "{:>5}  {:<24}  {:<36}  {:<28}  {}",
        e.seq,
        e.at,
        format!("{} -> {}", cell(e.from.as_ref()), e.to),
        e.reason,
        cell(e.actor.as_ref()),
    );
}

/// `ops events --follow`: the history so far, then each new event as it happens (the
/// API's long poll returns on settlement, else every 2 s), until the operation settles.
async fn follow_events(client: &Client, id: &str, json_out: bool) -> anyhow::Result<()> {
    if !json_out {
        print_events_header();
    }
    let mut printed = i64::MIN;
    loop {
        let op: OperationView = client
            .call(
                reqwest::Method::GET,
                &format!("/v1/operations/{id}"),
                &[("wait", "2s".to_owned())],
                None,
            )
            .await?;
        let events = client.events(id).await?;
        let since = printed;
        for e in events.events.iter().filter(|e| e.seq > since) {
            if json_out {
                println!("{}", serde_json::to_string(e)?);
            } else {
                print_event(e);
            }
            printed = e.seq;
        }
        if op.is_settled() {
            return Ok(());
        }
    }
}
