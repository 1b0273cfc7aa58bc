//! `opgate propose` and `opgate ops ...`: a client of the admin HTTP API. Readable
//! tables by default, the API's JSON with `--json`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Args, Subcommand};
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
        /// Operation id.
        id: String,
        /// Wait up to this long (e.g. `10s`) for it to settle.
        #[arg(long)]
        wait: Option<String>,
    },
    /// An operation's history.
    Events {
        /// Operation id.
        id: String,
    },
    /// Approve an operation awaiting approval.
    Approve {
        /// Operation id.
        id: String,
        /// Why (recorded in the history).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Reject an operation awaiting approval.
    Reject {
        /// Operation id.
        id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Cancel an operation that has not been sent.
    Cancel {
        /// Operation id.
        id: String,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Settle an unknown outcome or a needs_attention operation by hand.
    Resolve {
        /// Operation id.
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
        /// Operation id.
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

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
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
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        // A refused proposal (422) is an answer `propose` prints; anywhere else it fails.
        if status.is_success()
            || (status == reqwest::StatusCode::UNPROCESSABLE_ENTITY && path == "/v1/proposals")
        {
            return Ok(value);
        }
        match value.pointer("/error/message").and_then(Value::as_str) {
            Some(message) => bail!(
                "{status}: {} ({message})",
                value
                    .pointer("/error/code")
                    .and_then(Value::as_str)
                    .unwrap_or("error")
            ),
            None => bail!("{status}: {value}"),
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
    let answer = client
        .call(reqwest::Method::POST, "/v1/proposals", &[], Some(proposal))
        .await?;
    let settled = match (&args.wait, answer.pointer("/operation/operation_id")) {
        (Some(wait), Some(Value::String(id))) => Some(
            client
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{id}"),
                    &[("wait", wait.clone())],
                    None,
                )
                .await?,
        ),
        _ => None,
    };
    if args.api.json {
        let mut out = answer.clone();
        if let Some(op) = settled {
            out["operation"] = op;
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} {}{}",
        text(&answer, "/decision"),
        text(&answer, "/event_id"),
        answer
            .get("reason")
            .and_then(Value::as_str)
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    );
    if let Some(message) = answer.get("message").and_then(Value::as_str) {
        println!("  {message}");
    }
    if let Some(op) = settled.as_ref().or(answer.get("operation")) {
        if !op.is_null() {
            print_operation(op);
        }
    }
    if text(&answer, "/decision") == "rejected" {
        bail!("the proposal was rejected");
    }
    Ok(())
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
    let value = match &args.command {
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
            let page = client
                .call(reqwest::Method::GET, "/v1/operations", &query, None)
                .await?;
            if !json_out {
                print_list(&page);
                return Ok(());
            }
            page
        }
        OpsCommand::Show { id, wait } => {
            let query: Vec<(&str, String)> = wait.iter().map(|w| ("wait", w.clone())).collect();
            let op = client
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{id}"),
                    &query,
                    None,
                )
                .await?;
            if !json_out {
                print_operation(&op);
                return Ok(());
            }
            op
        }
        OpsCommand::Events { id } => {
            let events = client
                .call(
                    reqwest::Method::GET,
                    &format!("/v1/operations/{id}/events"),
                    &[],
                    None,
                )
                .await?;
            if !json_out {
                print_events(&events);
                return Ok(());
            }
            events
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
            let answer = act(id, "compensate", reason_body(reason)).await?;
            if !json_out {
                print_operation(&answer["operation"]);
                println!("compensation:");
                print_operation(&answer["compensation"]);
                return Ok(());
            }
            answer
        }
    };
    if json_out {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print_operation(&value);
    }
    Ok(())
}

fn text(v: &Value, pointer: &str) -> String {
    match v.pointer(pointer) {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn print_operation(op: &Value) {
    let entity = format!("{}:{}", text(op, "/entity/type"), text(op, "/entity/id"));
    let rows = [
        ("operation", text(op, "/operation_id")),
        ("status", text(op, "/status")),
        ("tool", text(op, "/tool")),
        ("entity", entity),
        ("idempotency key", text(op, "/idempotency_key")),
        ("namespace", text(op, "/namespace")),
        ("agent", text(op, "/agent_id")),
        (
            "workflow / step",
            format!("{} / {}", text(op, "/workflow_id"), text(op, "/step")),
        ),
        ("args", text(op, "/canonical_args")),
        ("attempts", text(op, "/attempt_count")),
        ("next attempt", text(op, "/next_attempt_at")),
        ("external id", text(op, "/external_id")),
        ("result", text(op, "/result")),
        ("error", text(op, "/error")),
        ("compensates", text(op, "/compensates")),
        ("created", text(op, "/created_at")),
        ("updated", text(op, "/updated_at")),
    ];
    for (name, value) in rows {
        if value != "-" {
            println!("  {name:<16} {value}");
        }
    }
}

fn print_list(page: &Value) {
    let ops = page["operations"].as_array().cloned().unwrap_or_default();
    println!(
        "{:<36}  {:<18}  {:<24}  {:<17}  {:>3}  KEY",
        "OPERATION", "TOOL", "ENTITY", "STATUS", "TRY"
    );
    for op in &ops {
        println!(
            "{:<36}  {:<18}  {:<24}  {:<17}  {:>3}  {}",
            text(op, "/operation_id"),
            text(op, "/tool"),
            format!("{}:{}", text(op, "/entity/type"), text(op, "/entity/id")),
            text(op, "/status"),
            text(op, "/attempt_count"),
            text(op, "/idempotency_key"),
        );
    }
    match page["next_cursor"].as_str() {
        Some(cursor) => println!("({} shown; next page: --cursor {cursor})", ops.len()),
        None => println!("({} shown)", ops.len()),
    }
}

fn print_events(events: &Value) {
    println!(
        "{:>5}  {:<24}  {:<36}  {:<28}  ACTOR",
        "SEQ", "AT", "TRANSITION", "REASON"
    );
    for e in events["events"].as_array().cloned().unwrap_or_default() {
        println!(
            "{:>5}  {:<24}  {:<36}  {:<28}  {}",
            text(&e, "/seq"),
            text(&e, "/at"),
            format!("{} -> {}", text(&e, "/from"), text(&e, "/to")),
            text(&e, "/reason"),
            text(&e, "/actor"),
        );
    }
}
