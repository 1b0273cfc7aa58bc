//! The `opgate` binary: CLI, config loading and wiring. This is the only crate that
//! picks concrete adapters.
//!
//! A proposal's path through the code: `roles` starts the roles; the ingest worker
//! (opgate-kafka) turns each record into an envelope (opgate-core) and writes it to the
//! ledger (opgate-store); the dispatcher and reconciler (opgate-worker) call the tool
//! through its adapter (opgate-tools); the relay (opgate-kafka) publishes every state
//! change to `opgate.results`. `dev` wires all of it to embedded services, `demo` drives it.
#![forbid(unsafe_code)]

mod bench;
mod bench_e2e;
mod cli;
mod config;
mod dev;
mod mcp;
mod roles;
mod telemetry;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use config::Config;

/// mimalloc instead of glibc malloc: the hot path makes many small, short-lived
/// allocations on several threads (rows, JSON values, Kafka messages), where glibc's
/// arenas spent about a third of opgate's user time (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// opgate: the execution layer between LLM agents and the side effects they ask for.
#[derive(Debug, Parser)]
#[command(
    name = "opgate",
    version,
    about = "The execution layer between LLM agents and the side effects they ask for: the model proposes, opgate commits."
)]
struct Cli {
    /// Log lines as `text` (colours only on a terminal) or `json` (one object per line).
    #[arg(long, global = true, env = "OPGATE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the ledger migrations (PostgreSQL or SQLite) and print the schema version.
    Migrate {
        /// `postgres://...` or `sqlite://PATH`.
        #[arg(long, env = "OPGATE_DATABASE_URL", required_unless_present = "config")]
        database_url: Option<String>,
        /// Or the config file whose `[database] url` to migrate.
        #[arg(long, short, conflicts_with = "database_url")]
        config: Option<PathBuf>,
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
        /// Comma-separated roles: ingest, relay, dispatch, reconcile, api.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "ingest,relay,dispatch,reconcile"
        )]
        roles: Vec<String>,
        /// Override a config key, e.g. `--set worker.lease_ms=30000` (repeatable; beats
        /// the file and the `OPGATE_...` environment variables).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// The simulated providers (payments, emails, tickets, orders, refunds, credits) with
    /// fault injection and effect counters.
    Sim {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9400")]
        listen: std::net::SocketAddr,
        /// Seed of the probabilistic faults.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Everything in one process on the embedded default: an in-process Kafka-protocol
    /// broker, a SQLite ledger, the simulated providers, every role and the admin API.
    Dev(dev::DevArgs),
    /// Propose an operation through the admin API (as an agent without a Kafka client).
    Propose(cli::ProposeArgs),
    /// Inspect and act on operations through the admin API.
    Ops(cli::OpsArgs),
    /// A Model Context Protocol server (stdio, or streamable HTTP with --http): the
    /// registry's tools, each call a proposal answered from the ledger.
    Mcp(mcp::McpArgs),
    /// The seeds' KPIs (duplicate effects, lost proposals, false and missed dedupes,
    /// ambiguity resolved, latency) for opgate and a naive baseline on one labelled
    /// workload, with provider faults and chaos; exits non-zero on any duplicate effect,
    /// lost proposal or false dedupe.
    Eval(opgate_fleet::eval::EvalArgs),
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
    /// The whole path: pre-published proposals -> ingest, dispatch, relay -> every
    /// result on opgate.results, with latencies and (PostgreSQL) transactions per operation.
    E2e(bench_e2e::E2eBench),
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo's incidents are expected failures; its table tells the story, so its log
    // stays quiet unless RUST_LOG asks otherwise.
    let default_filter = match &cli.command {
        Command::Dev(args) if args.demo => "error",
        Command::Eval(_) => "warn,rdkafka=off,librdkafka=off",
        _ => "info,rdkafka=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        // Colour codes only where a person reads them (not in a file or a collector).
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => logs.json().init(),
    }
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause once: libraries often repeat their
/// source's text in their own message, which `{:#}` would print again.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Migrate {
            database_url,
            config,
        } => {
            let database_url = match (database_url, config) {
                (Some(url), _) => url,
                (None, Some(path)) => {
                    Config::load_layered(&path, |n| std::env::var(n).ok(), &[])?.database_url()?
                }
                (None, None) => bail!("give --database-url or --config"),
            };
            let status = opgate_store::migrate(&database_url)
                .await
                .context("migrating the ledger")?;
            status.require_current()?;
            println!("ledger schema at version {}", status.found);
        }
        Command::Config {
            command: ConfigCommand::Check { config },
        } => {
            let config = Config::load_layered(&config, |n| std::env::var(n).ok(), &[])?;
            for tool in config.registry.tools() {
                println!(
                    "{:<28} {:<24} key={}",
                    tool.name,
                    tool.side_effect_class.as_str(),
                    tool.key_template
                        .as_ref()
                        .map(|t| t.source().to_owned())
                        .unwrap_or_else(|| match tool.key_strategy {
                            opgate_core::registry::KeyStrategy::Business => "business".into(),
                            opgate_core::registry::KeyStrategy::WorkflowStep => {
                                "workflow_step".into()
                            }
                        })
                );
            }
            println!("config ok");
        }
        Command::Topics {
            command: TopicsCommand::Create { config },
        } => {
            let config = Config::load_layered(&config, |n| std::env::var(n).ok(), &[])?;
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
        Command::Run {
            config,
            roles,
            sets,
        } => {
            let config = Config::load_layered(&config, |n| std::env::var(n).ok(), &sets)?;
            roles::start(&config, &roles, roles::process_env())
                .await?
                .until_signal()
                .await?;
        }
        Command::Sim { listen, seed } => {
            let sim = opgate_sim::Sim::new(opgate_sim::SimConfig {
                seed,
                ..Default::default()
            });
            let (addr, server) = opgate_sim::start(listen, sim).await?;
            println!(
                "simulated providers on http://{addr} (payments, emails, tickets, orders, refunds, credits; GET /effects, POST /faults)"
            );
            tokio::select! {
                () = roles::shutdown_signal() => {}
                _ = server => bail!("the simulated providers stopped"),
            }
        }
        Command::Dev(args) => dev::dev(args).await?,
        Command::Eval(args) => eval(args).await?,
        Command::Propose(args) => cli::propose(args).await?,
        Command::Ops(args) => cli::ops(args).await?,
        Command::Mcp(args) => mcp::mcp(args).await?,
        Command::Bench {
            command: BenchCommand::Ingest(opts),
        } => bench::ingest(opts).await?,
        Command::Bench {
            command: BenchCommand::E2e(opts),
        } => bench_e2e::e2e(opts).await?,
    }
    Ok(())
}

/// `opgate eval`: the worker processes are this binary's `run`.
async fn eval(args: opgate_fleet::eval::EvalArgs) -> anyhow::Result<()> {
    let setup = opgate_fleet::eval::EvalSetup {
        exe: std::env::current_exe().context("locating the opgate binary")?,
        tools: dev::DEV_CONFIG,
    };
    let (json, markdown) = (args.json.clone(), args.markdown.clone());
    let report = opgate_fleet::eval::run(setup, args).await?;
    print!("{report}");
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = markdown {
        std::fs::write(&path, report.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    report.verdict()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Inner;
    impl std::fmt::Display for Inner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("unable to open database file")
        }
    }
    impl std::error::Error for Inner {}

    #[derive(Debug)]
    struct Outer(Inner);
    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "error returned from database: {}", self.0)
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_is_printed_once() {
        let e = anyhow::Error::new(Outer(Inner)).context("migrating the ledger");
        assert_eq!(
            error_line(&e),
            "migrating the ledger: error returned from database: unable to open database file"
        );
    }
}
