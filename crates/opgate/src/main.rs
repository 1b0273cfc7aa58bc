//! The `opgate` binary: CLI, config loading and wiring. This is the only crate that
//! picks concrete adapters.
//!
//! Implemented so far: `opgate migrate` and `opgate config check`. The other verbs of
//! DESIGN.md section 6 (`dev`, `run`, `topics`, `propose`, `ops`, `sim`) land with
//! their issues.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use opgate_core::Registry;

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
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validate the `[[tools]]` and `[[agents]]` of a config file; errors name the tool and field.
    Check {
        /// The config file.
        #[arg(long, short, env = "OPGATE_CONFIG")]
        config: PathBuf,
    },
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
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
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let registry = Registry::from_toml(&text)?;
            for tool in registry.tools() {
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
        }
    }
    Ok(())
}
