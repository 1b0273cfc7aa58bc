//! `opgate dev`: everything in one process, no services. The embedded Kafka-protocol
//! broker (librdkafka's mock cluster), a SQLite ledger file, the simulated providers,
//! every role, and the admin API on loopback. `--demo` adds the scripted agent fleet.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use opgate_kafka::config::PROPOSALS;
use serde_json::json;

use crate::config::{ApiConfig, Config, DatabaseConfig, TokenConfig};
use crate::roles::{self, EnvLookup};
use opgate_fleet::demo::{self, DemoArgs};

/// Options of `opgate dev`.
#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// The SQLite ledger file.
    #[arg(long, default_value = "opgate-dev.db")]
    pub ledger: PathBuf,
    /// Delete the ledger file first (always done with --demo).
    #[arg(long)]
    pub fresh: bool,
    /// A config file with your tools, policies and agents (as for `opgate run`); its
    /// [kafka], [database] and [api] tables are replaced by the embedded ones, and
    /// `${OPGATE_SIM_URL}` points at the embedded simulated providers.
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Where the admin API listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub api_listen: SocketAddr,
    /// Where the simulated providers listen.
    #[arg(long, default_value = "127.0.0.1:9400")]
    pub sim_listen: SocketAddr,
    /// The roles to run here (default: all). Run the others with `opgate run` against
    /// the same ledger file, e.g. to kill and restart a dispatcher in the tour.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ingest,relay,dispatch,reconcile,api"
    )]
    pub roles: Vec<String>,
    /// Partitions of the embedded opgate.proposals topic.
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// Once every role is ready, write the addresses and tokens here as JSON.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// Run the scripted agent fleet, print the final table and exit (non-zero if any
    /// expectation failed).
    #[arg(long)]
    pub demo: bool,
    /// The fleet's options.
    #[command(flatten)]
    pub fleet: DemoArgs,
}

/// Runs `opgate dev`.
pub async fn dev(args: DevArgs) -> anyhow::Result<()> {
    roles::validate(&args.roles)?;
    if !args.roles.iter().any(|r| r == "api") {
        bail!("opgate dev always runs the api role (it prints its address and tokens)");
    }
    if args.demo && args.roles.len() != roles::ROLES.len() {
        bail!("--demo needs every role in this process");
    }
    if args.demo && args.config.is_some() {
        bail!(
            "--demo drives the built-in tools; run `opgate dev --config FILE` without --demo and propose to your own tools"
        );
    }
    // The simulated providers first: a config may point its adapters at them.
    let sim = opgate_sim::Sim::new(opgate_sim::SimConfig {
        seed: args.fleet.seed,
        hang: std::time::Duration::from_millis(2_500),
        propagation: std::time::Duration::from_millis(1_500),
        ..opgate_sim::SimConfig::default()
    });
    let (sim_addr, _sim_server) = opgate_sim::start(args.sim_listen, sim.clone())
        .await
        .with_context(|| {
            format!(
                "starting the simulated providers on --sim-listen {}",
                args.sim_listen
            )
        })?;
    let sim_url = format!("http://{sim_addr}");
    let env: EnvLookup = {
        let sim_url = sim_url.clone();
        Arc::new(move |name| {
            if name == "OPGATE_SIM_URL" {
                Some(sim_url.clone())
            } else {
                std::env::var(name).ok()
            }
        })
    };
    let mut config = match &args.config {
        Some(path) => Config::load_layered(path, |n| env(n), &[])?,
        None => Config::parse(DEV_CONFIG).context("the built-in dev config")?,
    };

    if args.fresh || args.demo {
        for suffix in ["", "-wal", "-shm"] {
            let path = PathBuf::from(format!("{}{suffix}", args.ledger.display()));
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            }
        }
    }
    let url = format!("sqlite://{}", args.ledger.display());
    opgate_store::migrate(&url).await?;

    let mut specs = opgate_kafka::topics::builtin_specs()?;
    for spec in &mut specs {
        if spec.name == PROPOSALS {
            spec.partitions = args.partitions;
        }
    }
    let broker = opgate_kafka::EmbeddedBroker::start(1, "", &specs)?;
    let bootstrap = broker.bootstrap_servers().to_owned();
    match &mut config.kafka {
        Some(kafka) => {
            kafka.brokers.clone_from(&bootstrap);
            kafka.topic_prefix.clear();
            // The embedded broker's client settings, where the configuration sets none.
            for (key, value) in broker.kafka_config().client {
                kafka.client.entry(key).or_insert(value);
            }
        }
        None => config.kafka = Some(broker.kafka_config()),
    }
    config.database = Some(DatabaseConfig { url });
    let viewer = secret();
    let operator = secret();
    let agent = secret();
    config.api = Some(ApiConfig {
        listen: args.api_listen,
        tokens: vec![
            TokenConfig {
                name: "dev-viewer".into(),
                role: opgate_api::Role::Viewer,
                secret: Some(viewer.clone()),
                ..TokenConfig::default()
            },
            TokenConfig {
                name: "dev-operator".into(),
                role: opgate_api::Role::Operator,
                secret: Some(operator.clone()),
                ..TokenConfig::default()
            },
            TokenConfig {
                name: "dev-agent".into(),
                role: opgate_api::Role::Agent,
                secret: Some(agent.clone()),
                agent_id: Some(DEV_AGENT.into()),
                namespaces: DEV_NAMESPACES.iter().map(|n| (*n).to_owned()).collect(),
                ..TokenConfig::default()
            },
        ],
    });

    let mut running = roles::start(&config, &args.roles, env).await?;
    let api = format!(
        "http://{}",
        running.api_addr.context("the api role did not start")?
    );
    print_banner(&bootstrap, &api, &sim_url, &operator, &args);
    if let Some(path) = &args.ready_file {
        let ready = json!({
            "kafka": bootstrap, "api": api, "sim": sim_url,
            "tokens": {"viewer": viewer, "operator": operator, "agent": agent},
            "agent": {"agent_id": DEV_AGENT, "namespaces": DEV_NAMESPACES},
            "ledger": args.ledger.display().to_string(),
        });
        // Written whole (temp file + rename) so a reader never sees half of it.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&ready)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    }

    if !args.demo {
        let result = running.until_signal().await;
        drop(broker);
        return result;
    }
    let target = demo::Target {
        bootstrap,
        api,
        operator_token: operator,
        sim,
        ledger: running.ledger.clone(),
    };
    let outcome = demo::run(target, &args.fleet).await;
    running.check()?;
    running.shutdown().await?;
    drop(broker);
    let summary = outcome?;
    print!("{summary}");
    demo::verdict(&summary)
}

fn print_banner(bootstrap: &str, api: &str, sim: &str, operator: &str, args: &DevArgs) {
    println!(
        "opgate dev: {} in one process, no services",
        args.roles.join(", ")
    );
    println!("  kafka bootstrap   {bootstrap}   (opgate.proposals, opgate.results, opgate.dlq)");
    println!("  admin API         {api}");
    println!("  simulated tools   {sim}   (GET /effects, POST /faults)");
    println!("  ledger (SQLite)   {}", args.ledger.display());
    if args.demo {
        return;
    }
    println!("  try, in another terminal:");
    println!("    export OPGATE_API_URL={api} OPGATE_TOKEN={operator}");
    println!(
        "    opgate propose --tool capture_payment --entity order:order_123 --args '{{\"amount\": \"49.00\", \"currency\": \"usd\"}}' --wait 10s"
    );
    println!("    opgate ops list");
    println!("  or with any Kafka client:");
    println!(
        "    echo '{{\"event_id\":\"evt-1\",\"tool\":\"capture_payment\",\"entity\":{{\"type\":\"order\",\"id\":\"order_123\"}},\"args\":{{\"amount\":\"49.00\",\"currency\":\"usd\"}}}}' | kcat -P -b {bootstrap} -t opgate.proposals -k order:order_123"
    );
    println!("    kcat -C -b {bootstrap} -t opgate.results -o beginning");
}

/// A random bearer token for this dev instance.
fn secret() -> String {
    use rand::Rng as _;
    format!("dev_{:032x}", rand::rng().random::<u128>())
}

/// The agent `opgate dev`'s agent token is bound to, and its namespaces.
pub const DEV_AGENT: &str = "dev-agent";
/// See [`DEV_AGENT`].
pub const DEV_NAMESPACES: &[&str] = &["default"];

/// The tools and worker settings `opgate dev` uses without `--config`; every adapter
/// points at the embedded simulated providers. Timeouts are short so the demo's
/// incidents resolve in seconds.
pub const DEV_CONFIG: &str = include_str!("../dev-tools.toml");
