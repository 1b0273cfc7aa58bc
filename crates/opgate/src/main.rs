//! The `opgate` binary: CLI, config loading and wiring. This is the only crate that
//! picks concrete adapters.
//!
//! Built so far: `migrate`, `config check`, `topics create`, `run --roles ingest,relay`
//! and `bench ingest`. The other verbs of DESIGN.md section 6 (`dev`, `propose`, `ops`,
//! `sim`) and the dispatch, reconcile and api roles land with their issues.

mod bench;
mod config;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use config::Config;
use tokio_util::sync::CancellationToken;
use tracing::info;

/// opgate: the execution layer between LLM agents and the side effects they ask for.
#[derive(Debug, Parser)]
#[command(name = "opgate", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the ledger migrations (PostgreSQL or SQLite) and print the schema version.
    Migrate {
        /// `postgres://...` or `sqlite://PATH`.
        #[arg(long, env = "OPGATE_DATABASE_URL")]
        database_url: String,
    },
    /// Configuration commands.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Topic administration.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Run opgate's roles against real Kafka and the configured ledger.
    Run {
        /// The config file.
        #[arg(long, short, env = "OPGATE_CONFIG")]
        config: PathBuf,
        /// Comma-separated roles: ingest, relay, dispatch, reconcile (api is coming).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "ingest,relay,dispatch,reconcile"
        )]
        roles: Vec<String>,
    },
    /// The simulated providers (payments, emails, tickets) with fault injection.
    Sim {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9400")]
        listen: std::net::SocketAddr,
        /// Seed of the probabilistic faults.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Everything in one process on the embedded default: an in-process Kafka-protocol
    /// broker (librdkafka's mock cluster), a SQLite ledger, the ingest and relay roles.
    Dev {
        /// The SQLite ledger file.
        #[arg(long, default_value = "opgate-dev.db")]
        ledger: PathBuf,
        /// Delete the ledger file first.
        #[arg(long)]
        fresh: bool,
        /// A config file for the tool registry and limits (its [kafka] and [database] are ignored).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// The scripted agent fleet (coming with the product-surface issue).
        #[arg(long)]
        demo: bool,
    },
    /// Benchmarks that print figures and can append them to BENCHMARKS.md.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validate a config file; errors name the table, tool and field at fault.
    Check {
        /// The config file.
        #[arg(long, short, env = "OPGATE_CONFIG")]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum TopicsCommand {
    /// Create missing topics from `topics/` and report drift on existing ones (idempotent).
    Create {
        /// The config file (its `[kafka]` table).
        #[arg(long, short, env = "OPGATE_CONFIG")]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Kafka ingest throughput on the embedded broker.
    Ingest(bench::IngestBench),
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,rdkafka=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate { database_url } => {
            let status = opgate_store::migrate(&database_url)
                .await
                .context("migrating the ledger")?;
            status.require_current()?;
            println!("ledger schema at version {}", status.found);
        }
        Command::Config {
            command: ConfigCommand::Check { config },
        } => {
            let config = Config::load(&config)?;
            for tool in config.registry.tools() {
                println!(
                    "{:<28} {:<24} key={}",
                    tool.name,
                    tool.side_effect_class.as_str(),
                    tool.key_template
                        .as_ref()
                        .map(|t| t.source().to_owned())
                        .unwrap_or_else(|| format!("{:?}", tool.key_strategy).to_lowercase())
                );
            }
            println!("config ok");
        }
        Command::Topics {
            command: TopicsCommand::Create { config },
        } => {
            let config = Config::load(&config)?;
            let kafka = config.kafka()?;
            let specs = opgate_kafka::topics::builtin_specs()?;
            let mut drift = false;
            for (name, status) in opgate_kafka::topics::ensure_topics(kafka, &specs).await? {
                match status {
                    opgate_kafka::topics::TopicStatus::Created => println!("{name}: created"),
                    opgate_kafka::topics::TopicStatus::Matches => println!("{name}: ok"),
                    opgate_kafka::topics::TopicStatus::Drift(diffs) => {
                        drift = true;
                        println!("{name}: DRIFT");
                        for d in diffs {
                            println!("  {d}");
                        }
                    }
                }
            }
            if drift {
                bail!("some topics differ from their specs (see above)");
            }
        }
        Command::Run { config, roles } => run_roles(&Config::load(&config)?, &roles).await?,
        Command::Sim { listen, seed } => {
            let sim = opgate_sim::Sim::new(opgate_sim::SimConfig {
                seed,
                ..Default::default()
            });
            let (addr, server) = opgate_sim::start(listen, sim).await?;
            println!(
                "simulated providers on http://{addr} (payments, emails, tickets; GET /effects, POST /faults)"
            );
            tokio::select! {
                () = shutdown_signal() => {}
                _ = server => bail!("the simulated providers stopped"),
            }
        }
        Command::Dev {
            ledger,
            fresh,
            config,
            demo,
        } => dev(ledger, fresh, config, demo).await?,
        Command::Bench {
            command: BenchCommand::Ingest(opts),
        } => bench::ingest(opts).await?,
    }
    Ok(())
}

/// Runs the chosen roles until SIGTERM or Ctrl-C, then drains: the ingest worker
/// finishes or abandons its batch, commits offsets and leaves the group; the relay
/// finishes its round.
async fn run_roles(config: &Config, roles: &[String]) -> anyhow::Result<()> {
    for role in roles {
        if !matches!(
            role.as_str(),
            "ingest" | "relay" | "dispatch" | "reconcile" | "api"
        ) {
            bail!("unknown role `{role}` (roles: ingest, relay, dispatch, reconcile, api)");
        }
    }
    let has = |r: &str| roles.iter().any(|x| x == r);
    let ledger = opgate_store::open(&config.database_url()?).await?;
    let registry = Arc::new(config.registry.clone());
    let cancel = CancellationToken::new();
    let mut tasks = tokio::task::JoinSet::new();
    let owner = format!("{}-{}", hostname(), std::process::id());
    if has("ingest") {
        let worker = opgate_kafka::IngestWorker::new(
            config.kafka()?,
            ledger.clone(),
            registry.clone(),
            config.limits,
        )?;
        tasks.spawn(worker.run(cancel.child_token()));
    }
    if has("relay") {
        let relay = opgate_kafka::ResultsRelay::new(
            config.kafka()?,
            ledger.clone(),
            owner.clone(),
            500,
            Duration::from_secs(30),
        )?;
        tasks.spawn(relay.run(cancel.child_token()));
    }
    if has("dispatch") || has("reconcile") {
        let adapters =
            opgate_worker::Adapters::from_registry(&registry, |n| std::env::var(n).ok())?;
        let w = config.worker;
        let lease = Duration::from_millis(w.lease_ms.unwrap_or(60_000));
        if has("dispatch") {
            let defaults = opgate_worker::DispatcherConfig::default();
            let dispatcher = opgate_worker::Dispatcher::new(
                ledger.clone(),
                registry.clone(),
                adapters.clone(),
                opgate_worker::DispatcherConfig {
                    owner: format!("{owner}/dispatch"),
                    lease,
                    batch: w.batch.unwrap_or(defaults.batch),
                    concurrency: w.concurrency.unwrap_or(defaults.concurrency),
                    per_tool: w.per_tool.unwrap_or(defaults.per_tool),
                    // Test crash point (see crates/opgate/tests/crash.rs).
                    crash_after_claim: std::env::var("OPGATE_CRASH_AT").as_deref()
                        == Ok("after_claim"),
                    ..defaults
                },
            )?;
            let token = cancel.child_token();
            tasks.spawn(async move {
                dispatcher.run(token).await;
                Ok(())
            });
        }
        if has("reconcile") {
            let reconciler = opgate_worker::Reconciler::new(
                ledger.clone(),
                registry.clone(),
                adapters,
                opgate_worker::ReconcilerConfig {
                    owner: format!("{owner}/reconcile"),
                    lease,
                    ..Default::default()
                },
            );
            let token = cancel.child_token();
            tasks.spawn(async move {
                reconciler.run(token).await;
                Ok(())
            });
        }
    }
    if has("api") {
        let api = config
            .api
            .as_ref()
            .context("the api role needs an [api] table with [[api.tokens]]")?;
        let tokens = api.tokens()?;
        anyhow::ensure!(
            !tokens.is_empty(),
            "the api role needs at least one [[api.tokens]]"
        );
        let state =
            opgate_api::ApiState::new(ledger.clone(), registry.clone(), config.limits, tokens);
        let (addr, server) = opgate_api::serve(api.listen, state).await?;
        info!(%addr, "admin API listening");
        let token = cancel.child_token();
        tasks.spawn(async move {
            tokio::select! {
                _ = server => {}
                () = token.cancelled() => {}
            }
            Ok(())
        });
    }
    info!(roles = %roles.join(","), "opgate running");
    tokio::select! {
        () = shutdown_signal() => info!("shutting down"),
        Some(done) = tasks.join_next() => {
            cancel.cancel();
            done??;
            bail!("a role stopped on its own");
        }
    }
    cancel.cancel();
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// `opgate dev`: the embedded broker and a SQLite ledger, with the ingest and relay roles.
async fn dev(
    ledger: PathBuf,
    fresh: bool,
    config: Option<PathBuf>,
    demo: bool,
) -> anyhow::Result<()> {
    if demo {
        bail!(
            "`opgate dev --demo` (the scripted agent fleet) lands with the product-surface issue; `opgate dev` runs the Kafka path now"
        );
    }
    let mut config = match config {
        Some(path) => Config::load(&path)?,
        None => Config::parse(DEV_TOOLS)?,
    };
    if fresh {
        for suffix in ["", "-wal", "-shm"] {
            let path = PathBuf::from(format!("{}{suffix}", ledger.display()));
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            }
        }
    }
    let url = format!("sqlite://{}", ledger.display());
    opgate_store::migrate(&url).await?;
    let specs = opgate_kafka::topics::builtin_specs()?;
    let broker = opgate_kafka::EmbeddedBroker::start(1, "", &specs)?;
    let bootstrap = broker.bootstrap_servers().to_owned();
    config.kafka = Some(opgate_kafka::KafkaConfig::new(bootstrap.clone()));
    config.database = Some(config::DatabaseConfig { url: url.clone() });
    println!("opgate dev");
    println!(
        "  kafka bootstrap: {bootstrap}   (topics: opgate.proposals, opgate.results, opgate.dlq)"
    );
    println!("  ledger:          {}", ledger.display());
    println!("  try:");
    println!(
        "    echo '{{\"event_id\":\"evt-1\",\"tool\":\"capture_payment\",\"entity\":{{\"type\":\"order\",\"id\":\"order_123\"}},\"args\":{{\"amount\":\"49.00\",\"currency\":\"usd\"}}}}' \\\n      | kcat -P -b {bootstrap} -t opgate.proposals -k order:order_123"
    );
    println!("    kcat -C -b {bootstrap} -t opgate.results -o beginning");
    let result = run_roles(&config, &["ingest".to_owned(), "relay".to_owned()]).await;
    drop(broker);
    result
}

/// The tools `opgate dev` knows without a config file.
const DEV_TOOLS: &str = r#"
[[tools]]
name = "capture_payment"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = ["trim", "upper"]

[[tools]]
name = "send_email"
side_effect_class = "external_non_idempotent"
entity = "user"
key = "email:{entity}:{args.template}"
[tools.args]
to = "email"
template = "lower"

[[tools]]
name = "create_ticket"
side_effect_class = "external_idempotent"
key_strategy = "workflow_step"
"#;

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME").unwrap_or_else(|_| "opgate".to_owned())
}
