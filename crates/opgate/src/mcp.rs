//! `opgate mcp`: the MCP server (`opgate-mcp`) against an opgate API, or with `--dev`
//! against an embedded `opgate dev` it starts as a child process (its stdout kept off
//! the MCP channel).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Options of `opgate mcp`.
#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// opgate's admin API.
    #[arg(long, env = "OPGATE_API_URL", default_value = "http://127.0.0.1:8080")]
    pub api_url: String,
    /// The token a stdio session proposes with (an agent token). Over HTTP each request
    /// brings its own `Authorization: Bearer` token.
    #[arg(long, env = "OPGATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Take the API's address from this opgate config's `[api] listen` (instead of
    /// --api-url).
    #[arg(long, short, conflicts_with = "dev")]
    pub config: Option<PathBuf>,
    /// The namespace proposals go to.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// How long a call waits for its operation to settle before answering "in flight".
    #[arg(long, default_value = "20s")]
    pub wait: String,
    /// Serve streamable HTTP at `http://ADDR/mcp` instead of stdio.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Start an embedded `opgate dev` (SQLite, in-process broker, simulated providers)
    /// and serve it, with its agent token for stdio sessions.
    #[arg(long)]
    pub dev: bool,
    /// Once serving, write the addresses (and with --dev the tokens) here as JSON.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
}

/// Runs `opgate mcp`.
pub async fn mcp(args: McpArgs) -> anyhow::Result<()> {
    let wait = opgate_core::registry::parse_duration(&args.wait)
        .map_err(|m| anyhow::anyhow!("--wait: {m}"))?;
    let (dev, mut ready) = match args.dev {
        true => {
            let dev = Dev::start().await?;
            let ready = dev.ready.clone();
            (Some(dev), ready)
        }
        false => (None, json!({"api": api_url(&args)?})),
    };
    let config = opgate_mcp::McpConfig {
        api_url: ready["api"].as_str().unwrap_or(&args.api_url).to_owned(),
        token: args
            .token
            .clone()
            .or_else(|| ready["tokens"]["agent"].as_str().map(str::to_owned)),
        namespace: args.namespace.clone(),
        wait,
    };
    let result = match args.http {
        Some(addr) => {
            let cancel = CancellationToken::new();
            let (bound, server) = opgate_mcp::serve_http(config, addr, cancel.clone()).await?;
            ready["mcp"] = json!(format!("http://{bound}/mcp"));
            write_ready(args.ready_file.as_ref(), &ready)?;
            eprintln!("opgate mcp: streamable HTTP at http://{bound}/mcp");
            crate::roles::shutdown_signal().await;
            cancel.cancel();
            let _ = server.await;
            Ok(())
        }
        None => {
            if config.token.is_none() {
                bail!(
                    "a stdio session needs a token: --token or OPGATE_TOKEN (an agent token), or --dev"
                );
            }
            write_ready(args.ready_file.as_ref(), &ready)?;
            opgate_mcp::serve_stdio(config).await
        }
    };
    drop(dev);
    result
}

/// `--api-url`, or the address a config's `[api] listen` serves on.
fn api_url(args: &McpArgs) -> anyhow::Result<String> {
    let Some(path) = &args.config else {
        return Ok(args.api_url.clone());
    };
    let config = crate::config::Config::load_layered(path, |n| std::env::var(n).ok(), &[])?;
    let api = config
        .api
        .as_ref()
        .with_context(|| format!("{} has no [api] table", path.display()))?;
    let mut addr = api.listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    Ok(format!("http://{addr}"))
}

fn write_ready(path: Option<&PathBuf>, ready: &Value) -> anyhow::Result<()> {
    if let Some(path) = path {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(ready)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// An `opgate dev` child process on free ports and a fresh ledger; killed on drop.
struct Dev {
    _child: tokio::process::Child,
    ready: Value,
}

impl Dev {
    async fn start() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("opgate-mcp-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let ready_file = dir.join("ready.json");
        let _ = std::fs::remove_file(&ready_file);
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .arg("dev")
            .arg("--fresh")
            .arg("--ledger")
            .arg(dir.join("ledger.db"))
            .args(["--api-listen", "127.0.0.1:0", "--sim-listen", "127.0.0.1:0"])
            .arg("--ready-file")
            .arg(&ready_file)
            .stdin(Stdio::null())
            // stdout may be the MCP channel: the child's banner goes to stderr instead.
            .stdout(Stdio::from(std::io::stderr()))
            .kill_on_drop(true)
            .spawn()
            .context("starting opgate dev")?;
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready_file) {
                let ready: Value = serde_json::from_str(&text)?;
                eprintln!(
                    "opgate mcp: embedded opgate dev, API {}, simulated providers {}",
                    ready["api"], ready["sim"]
                );
                return Ok(Self {
                    _child: child,
                    ready,
                });
            }
            if started.elapsed() > Duration::from_secs(60) {
                bail!("opgate dev did not get ready in 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(config: Option<PathBuf>) -> McpArgs {
        McpArgs {
            api_url: "http://given:1".into(),
            token: None,
            config,
            namespace: "default".into(),
            wait: "20s".into(),
            http: None,
            dev: false,
            ready_file: None,
        }
    }

    #[test]
    fn the_api_address_comes_from_the_flag_or_the_config() {
        assert_eq!(api_url(&args(None)).expect("url"), "http://given:1");
        let path = std::env::temp_dir().join(format!("opgate-mcp-{}.toml", uuid::Uuid::now_v7()));
        std::fs::write(&path, "[api]\nlisten = \"0.0.0.0:8181\"\n").expect("write");
        assert_eq!(
            api_url(&args(Some(path.clone()))).expect("url"),
            "http://127.0.0.1:8181"
        );
        let _ = std::fs::remove_file(path);
    }
}
