//! `opgate bench e2e`: the whole path, as a user runs it. N operations' proposals (with
//! redeliveries and re-spelled duplicates) are published to the embedded broker first;
//! then the ingest, relay, dispatch and reconcile roles start in this process (or in
//! `--processes N` child `opgate run` processes) against a ledger (SQLite, or PostgreSQL with `--database-url`) and the simulated providers
//! (payments, no faults), and the clock runs until every operation's final result is on
//! `opgate.results` (the embedded broker, or `--brokers` for a Kafka cluster: the topics
//! get a fresh prefix there). It prints operations/s, latency percentiles from consume
//! (the ingest's clock read) to the call reaching the provider, to its effect there and to
//! settled in the ledger (and, with `--rate`, from each record's send to the call at the
//! provider: what the agent waits), on PostgreSQL the transactions and row writes
//! per operation (from `pg_stat_database`; statements per operation, round trips, from
//! `pg_stat_statements` where it is loaded), the machine's CPU time per operation (from
//! `/proc/stat`: everything on it, the database included), and can append a row to
//! BENCHMARKS.md.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use opgate_kafka::config::PROPOSALS;

use crate::bench::{append_row, empty_ledger, today, workload};
use crate::config::{Config, DatabaseConfig};
use crate::roles::{self, EnvLookup};

/// The tool the benchmark proposes: the simulated payments provider, which honours the
/// key; timeouts as in production.
const TOOLS: &str = r#"
[[tools]]
name = "pay"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/payments"
timeout_ms = 2000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${OPGATE_SIM_URL}/payments?idempotency_key={key}"
external_id_pointer = "/charge_id"
"#;

/// Options of `opgate bench e2e`.
#[derive(Debug, clap::Args)]
pub struct E2eBench {
    /// Distinct operations (the records add 20% redeliveries and 10% re-spellings).
    #[arg(long, default_value_t = 20_000)]
    pub operations: usize,
    /// Partitions of the proposals topic.
    #[arg(long, default_value_t = 8)]
    pub partitions: i32,
    /// Operations per order: one order's dispatches are serialized, so this is the
    /// length of each entity's chain.
    #[arg(long, default_value_t = 10)]
    pub ops_per_entity: usize,
    /// A Kafka broker to run against (e.g. `127.0.0.1:9092`) instead of the embedded one;
    /// the benchmark's topics get a fresh prefix there.
    #[arg(long)]
    pub brokers: Option<String>,
    /// Ledger URL (default: a fresh SQLite file in the temp dir). Must be empty.
    #[arg(long)]
    pub database_url: Option<String>,
    /// `[worker] record_batch`: outcomes per ledger transaction (1: one each).
    #[arg(long)]
    pub record_batch: Option<usize>,
    /// `[worker] per_tool`: calls in flight per tool.
    #[arg(long)]
    pub per_tool: Option<usize>,
    /// `[worker] prefetch`: at most this many operations per tool claimed ahead of a
    /// free permit.
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// `[worker] concurrency`: calls in flight overall.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// `[worker] batch`: operations claimed per round.
    #[arg(long)]
    pub batch: Option<usize>,
    /// `[worker] claim_at_ingest`: the ingest transaction claims the ready operations it
    /// creates for the dispatcher beside it (default true).
    #[arg(long)]
    pub claim_at_ingest: Option<bool>,
    /// `[kafka.batch] max_wait_ms`: how long an ingest lane waits for its batch to fill
    /// (default 1; 0 takes only what has arrived).
    #[arg(long)]
    pub max_wait_ms: Option<u64>,
    /// Offer the records at this rate (records/s) while the roles run, instead of
    /// publishing them all first.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Run the roles in this many `opgate run` child processes (each with every role)
    /// instead of in this process.
    #[arg(long)]
    pub processes: Option<usize>,
    /// Append the figures to this Markdown file.
    #[arg(long)]
    pub write: Option<PathBuf>,
}

/// Database-wide counters, read before and after on PostgreSQL.
#[derive(Debug, Clone, Copy, Default)]
struct PgCounters {
    commits: i64,
    row_writes: i64,
    /// Statements executed, `BEGIN` and `COMMIT` included: the round trips to the
    /// database. Only where `pg_stat_statements` is loaded and created in the database.
    /// Foreign-key checks deferred to `COMMIT` are listed there as statements of their
    /// own (`... FOR KEY SHARE OF x`); they are no round trip and are left out.
    statements: Option<i64>,
}

async fn pg_counters(pool: &sqlx::PgPool) -> anyhow::Result<PgCounters> {
    let (commits, row_writes): (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted \
         FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?;
    let statements = sqlx::query_scalar::<_, Option<i64>>(
        "SELECT sum(calls)::bigint FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '%FOR KEY SHARE OF x'",
    )
    .fetch_one(pool)
    .await
    .ok()
    .flatten();
    Ok(PgCounters {
        commits,
        row_writes,
        statements,
    })
}

/// CPU time the whole machine spent busy so far (user, nice, system, irq, softirq), from
/// `/proc/stat`; `None` where that cannot be read.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq ...; clock ticks are 100 per second on Linux.
    let busy =
        fields.first()? + fields.get(1)? + fields.get(2)? + fields.get(5)? + fields.get(6)?;
    Some(Duration::from_millis(busy * 10))
}

/// Operations already in a PostgreSQL ledger (none counted on SQLite).
async fn pg_history(url: &str) -> anyhow::Result<Option<i64>> {
    if !url.starts_with("postgres") {
        return Ok(None);
    }
    let pool = sqlx::PgPool::connect(url).await?;
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM operations")
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok(Some(n))
}

/// Runs the end-to-end benchmark.
pub async fn e2e(opts: E2eBench) -> anyhow::Result<()> {
    let records_n = opts.operations * 10 / 7;
    let (records, _events, keys) = workload(records_n, 42, opts.ops_per_entity)?;

    let sim = opgate_sim::Sim::new(opgate_sim::SimConfig::default());
    let (sim_addr, _sim_server) = opgate_sim::start("127.0.0.1:0".parse()?, sim.clone()).await?;
    let sim_url = format!("http://{sim_addr}");
    let env: EnvLookup = {
        let sim_url = sim_url.clone();
        Arc::new(move |name| (name == "OPGATE_SIM_URL").then(|| sim_url.clone()))
    };

    let (url, backend, ledger) = empty_ledger(opts.database_url.as_deref(), "e2e").await?;

    let mut specs = opgate_kafka::topics::builtin_specs()?;
    for spec in &mut specs {
        if spec.name == PROPOSALS {
            spec.partitions = opts.partitions;
        }
    }
    let (mut kafka, broker, broker_name) = match &opts.brokers {
        Some(brokers) => {
            let mut kafka = opgate_kafka::KafkaConfig::new(brokers.clone());
            let run = format!("bench-{:08x}", rand::random::<u32>());
            kafka.topic_prefix = format!("{run}.");
            kafka.group_id = format!("{run}-ingest");
            kafka.replication_factor = Some(1);
            opgate_kafka::topics::ensure_topics(&kafka, &specs).await?;
            (kafka, None, format!(", broker {brokers}"))
        }
        None => {
            let broker = opgate_kafka::EmbeddedBroker::start(1, "", &specs)?;
            (broker.kafka_config(), Some(broker), String::new())
        }
    };
    if let Some(ms) = opts.max_wait_ms {
        kafka.batch.max_wait_ms = ms;
    }
    if opts.rate.is_none() {
        opgate_fleet::client::publish(&kafka, &records).await?;
    }

    let mut config = Config::parse(TOOLS).context("the benchmark's tools")?;
    config.kafka = Some(kafka.clone());
    config.database = Some(DatabaseConfig { url: url.clone() });
    config.worker.record_batch = opts.record_batch;
    config.worker.per_tool = opts.per_tool;
    config.worker.prefetch = opts.prefetch;
    config.worker.concurrency = opts.concurrency;
    config.worker.batch = opts.batch;
    config.worker.claim_at_ingest = opts.claim_at_ingest;
    let history = match &pg_history(&url).await? {
        Some(0) | None => String::new(),
        Some(n) => format!(", {n} operations already in the ledger"),
    };
    let offered = opts
        .rate
        .map_or(String::new(), |r| format!(", offered {r:.0} records/s"));
    let defaults = opgate_worker::DispatcherConfig::default();
    let per_tool = opts.per_tool.unwrap_or(defaults.per_tool);
    let settings = format!(
        "{} ops per order{broker_name}{offered}{history}{}, ingest max_wait_ms {}, record_batch {}, per_tool {}, prefetch {}, concurrency {}, batch {}, claim at ingest {}",
        opts.ops_per_entity,
        if opts.processes.is_some() {
            ", child processes"
        } else {
            ""
        },
        kafka.batch.max_wait_ms,
        opts.record_batch.unwrap_or(defaults.record_batch),
        per_tool,
        opts.prefetch
            .unwrap_or(opgate_worker::DispatcherConfig::prefetch_for(per_tool)),
        opts.concurrency.unwrap_or(defaults.concurrency),
        opts.batch.unwrap_or(defaults.batch),
        if opts.claim_at_ingest.unwrap_or(true) {
            "on"
        } else {
            "off"
        },
    );
    let pg = match backend {
        "PostgreSQL" => Some(sqlx::PgPool::connect(&url).await?),
        _ => None,
    };
    let before = match &pg {
        Some(pool) => pg_counters(pool).await?,
        None => PgCounters::default(),
    };

    // Count each operation's final result on opgate.results, from the beginning.
    let reader = {
        let kafka = kafka.clone();
        tokio::task::spawn_blocking(move || {
            opgate_fleet::client::wait_for_final_results(
                &kafka,
                "bench",
                keys,
                Duration::from_secs(1800),
            )
        })
    };

    let started = Instant::now();
    let busy_before = machine_busy();
    let running = match opts.processes {
        None => {
            let roles_list: Vec<String> = ["ingest", "relay", "dispatch", "reconcile"]
                .into_iter()
                .map(str::to_owned)
                .collect();
            Running::Here(roles::start(&config, &roles_list, env).await?)
        }
        Some(n) => Running::Children(spawn_workers(n.max(1), &opts, &url, &kafka, &sim_url)?),
    };
    // At a fixed rate, when each event id was first handed to the producer.
    let mut sent_at: HashMap<String, time::OffsetDateTime> = HashMap::new();
    if let Some(rate) = opts.rate {
        // Offer the load once ingest consumes: records published during the consumer
        // group's join would queue up and be measured as a burst, not as the rate.
        warm_up(&kafka, ledger.as_ref()).await?;
        let sent = opgate_fleet::client::publish_at_rate(&kafka, &records, rate).await?;
        for ((_, value), at) in records.iter().zip(sent) {
            let event_id = serde_json::from_slice::<serde_json::Value>(value)?["event_id"]
                .as_str()
                .context("a benchmark record without an event id")?
                .to_owned();
            sent_at.entry(event_id).or_insert_with(|| at.into());
        }
    }
    let (first_result, last_result) = reader.await??;
    let busy = machine_busy()
        .zip(busy_before)
        .map(|(after, before)| after.saturating_sub(before));
    let elapsed = last_result - started;
    let joined = first_result - started;
    match running {
        Running::Here(roles) => roles.shutdown().await?,
        Running::Children((mut workers, _dir)) => {
            tokio::task::spawn_blocking(move || workers.stop_all()).await?;
        }
    }
    let after = match &pg {
        Some(pool) => pg_counters(pool).await?,
        None => PgCounters::default(),
    };

    let effects = sim.effects();
    if effects.duplicates != 0 {
        bail!("{} duplicate effects at the provider", effects.duplicates);
    }
    let latencies = Latencies::read(
        ledger.as_ref(),
        &effects,
        sim.started_at().into(),
        &sent_at,
        keys,
    )
    .await?;
    drop(broker);

    let rate = keys as f64 / elapsed.as_secs_f64();
    let steady = keys as f64 / (elapsed - joined).as_secs_f64().max(1e-9);
    let [to_dispatch, to_effect, to_settled, publish_to_dispatch] = [
        latencies.to_dispatch,
        latencies.to_effect,
        latencies.to_settled,
        latencies.from_publish,
    ]
    .map(p50_p99);
    let per_op = |n: i64| n as f64 / keys as f64;
    let processes = opts.processes.unwrap_or(1);
    // Everything on the machine: the roles, PostgreSQL, the embedded broker, the simulated
    // provider and the results reader (they share the cores).
    let cpu = busy.map_or("-".to_owned(), |b| {
        format!("{:.2}", b.as_secs_f64() * 1000.0 / keys as f64)
    });
    let (tx, rows) = if pg.is_some() {
        (
            format!("{:.1}", per_op(after.commits - before.commits)),
            format!("{:.1}", per_op(after.row_writes - before.row_writes)),
        )
    } else {
        ("-".to_owned(), "-".to_owned())
    };
    let statements = match (before.statements, after.statements) {
        (Some(b), Some(a)) => format!("{:.2}", per_op(a - b)),
        _ => "-".to_owned(),
    };
    println!(
        "e2e: {keys} operations ({} records) on {} partitions, {backend}, {processes} process(es) ({settings}): {:.2} s to the last result, \
         {rate:.0} operations/s; after the first result ({:.2} s): {steady:.0} operations/s; \
         consume->dispatch (call at the provider) p50 / p99 {to_dispatch} ms; consume->provider effect p50 / p99 {to_effect} ms; consume->settled p50 / p99 {to_settled} ms; \
         publish->dispatch p50 / p99 {publish_to_dispatch} ms; transactions/op {tx}, statements/op {statements}, row writes/op {rows}; machine CPU {cpu} ms/op; {} effects, 0 duplicates",
        records.len(),
        opts.partitions,
        elapsed.as_secs_f64(),
        joined.as_secs_f64(),
        effects.total,
    );
    let line = format!(
        "| {} | {keys} | {} | {backend} | {processes} | {settings} | {:.2} s | {rate:.0} | {:.2} s | **{steady:.0}** | {to_dispatch} | {to_effect} | {to_settled} | {publish_to_dispatch} | {tx} | {statements} | {rows} | {cpu} |",
        today(),
        records.len(),
        elapsed.as_secs_f64(),
        joined.as_secs_f64(),
    );
    if let Some(path) = opts.write {
        append_row(&path, &line)?;
    }
    Ok(())
}

/// Each operation's latencies in milliseconds. From consume (the ingest transaction's
/// clock read, `created_at`): to the dispatch, as the provider received the call (a
/// claim's clock read says nothing when the claim is the ingest's own: claim at ingest);
/// to its effect there; to settled (the ledger's last change). And at a fixed rate, from
/// the agent's send (the record handed to the producer) to the call at the provider,
/// which includes the producer's linger, the broker, the ingest lane's batching and the
/// wait before the ingest's clock read.
struct Latencies {
    to_dispatch: Vec<f64>,
    to_effect: Vec<f64>,
    to_settled: Vec<f64>,
    from_publish: Vec<f64>,
}

impl Latencies {
    /// Reads every operation of namespace `bench` from the ledger and matches it to the
    /// provider's first effect under its key (received and taken, on the provider's clock
    /// from `provider_started`: one machine, one wall clock) and to its event's send
    /// time. A dispatched operation without an effect under its key is an error.
    async fn read(
        ledger: &dyn opgate_store::Ledger,
        effects: &opgate_sim::EffectsReport,
        provider_started: time::OffsetDateTime,
        sent_at: &HashMap<String, time::OffsetDateTime>,
        keys: usize,
    ) -> anyhow::Result<Self> {
        let mut effect_at: HashMap<&str, (u64, u64)> = HashMap::with_capacity(effects.log.len());
        for e in &effects.log {
            let at = effect_at
                .entry(e.key.as_str())
                .or_insert((e.received_ms, e.at_ms));
            if e.at_ms < at.1 {
                *at = (e.received_ms, e.at_ms);
            }
        }
        let on_clock = |ms: u64| provider_started + time::Duration::milliseconds(ms as i64);
        let ms = |d: time::Duration| d.as_seconds_f64() * 1000.0;
        let mut this = Self {
            to_dispatch: Vec::with_capacity(keys),
            to_effect: Vec::with_capacity(keys),
            to_settled: Vec::with_capacity(keys),
            from_publish: Vec::with_capacity(keys),
        };
        let mut dispatched_without_effect = 0usize;
        let mut cursor = None;
        loop {
            let page = ledger
                .list(&opgate_store::ListFilter {
                    namespace: Some("bench".into()),
                    limit: Some(500),
                    cursor: cursor.clone(),
                    ..Default::default()
                })
                .await?;
            for op in &page.operations {
                this.to_settled.push(ms(op.updated_at - op.created_at));
                let key = opgate_core::key::scoped_key(&op.namespace, &op.idempotency_key);
                if let Some(&(received_ms, at_ms)) = effect_at.get(key.as_str()) {
                    this.to_dispatch
                        .push(ms(on_clock(received_ms) - op.created_at));
                    this.to_effect.push(ms(on_clock(at_ms) - op.created_at));
                    if let Some(&sent) = sent_at.get(&op.event_id) {
                        this.from_publish.push(ms(on_clock(received_ms) - sent));
                    }
                } else if op.first_attempt_at.is_some() {
                    dispatched_without_effect += 1;
                }
            }
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        if dispatched_without_effect != 0 {
            bail!(
                "{dispatched_without_effect} of {} dispatched operations have no effect at the provider under their key",
                dispatched_without_effect + this.to_effect.len()
            );
        }
        Ok(this)
    }
}

/// "p50 / p99" in whole milliseconds, or "-" when there is nothing to measure.
fn p50_p99(mut values: Vec<f64>) -> String {
    if values.is_empty() {
        return "-".to_owned();
    }
    format!(
        "{:.0} / {:.0}",
        percentile(&mut values, 0.50),
        percentile(&mut values, 0.99)
    )
}

/// Publishes one proposal in namespace `bench-warm-up` and waits until it is in the
/// ledger: from then on, ingest is consuming.
async fn warm_up(
    kafka: &opgate_kafka::KafkaConfig,
    ledger: &dyn opgate_store::Ledger,
) -> anyhow::Result<()> {
    let value = serde_json::json!({"event_id": "warm-up", "namespace": "bench-warm-up",
        "tool": "pay", "entity": {"type": "order", "id": "warm-up"},
        "args": {"amount": "1.00", "currency": "usd"}});
    opgate_fleet::client::publish(kafka, &[("warm-up".into(), value.to_string().into_bytes())])
        .await?;
    let filter = opgate_store::ListFilter {
        namespace: Some("bench-warm-up".into()),
        limit: Some(1),
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while ledger.list(&filter).await?.operations.is_empty() {
        if Instant::now() > deadline {
            bail!("ingest did not consume the warm-up proposal in 120 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Where the roles run.
enum Running {
    Here(roles::Running),
    Children((opgate_fleet::workers::Workers, PathBuf)),
}

/// Starts `n` `opgate run` processes of this binary with every role, on the benchmark's
/// ledger, broker, tools and worker settings; their logs go to a temp dir.
fn spawn_workers(
    n: usize,
    opts: &E2eBench,
    url: &str,
    kafka: &opgate_kafka::KafkaConfig,
    sim_url: &str,
) -> anyhow::Result<(opgate_fleet::workers::Workers, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("opgate-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut worker = String::new();
    for (name, value) in [
        ("record_batch", opts.record_batch),
        ("per_tool", opts.per_tool),
        ("prefetch", opts.prefetch),
        ("concurrency", opts.concurrency),
        ("batch", opts.batch),
    ] {
        if let Some(v) = value {
            worker.push_str(&format!("{name} = {v}\n"));
        }
    }
    if let Some(on) = opts.claim_at_ingest {
        worker.push_str(&format!("claim_at_ingest = {on}\n"));
    }
    let mut client = String::new();
    for (key, value) in &kafka.client {
        client.push_str(&format!("{key:?} = {value:?}\n"));
    }
    let config = dir.join("opgate.toml");
    std::fs::write(
        &config,
        format!(
            "{TOOLS}\n[database]\nurl = \"{url}\"\n\n[kafka]\nbrokers = \"{}\"\ntopic_prefix = \"{}\"\ngroup_id = \"{}\"\n[kafka.batch]\nmax_wait_ms = {}\n[kafka.client]\n{client}\n[worker]\n{worker}",
            kafka.brokers, kafka.topic_prefix, kafka.group_id, kafka.batch.max_wait_ms
        ),
    )?;
    let exe = std::env::current_exe().context("this binary's path")?;
    let mut workers = opgate_fleet::workers::Workers::new(&exe, &config, &dir, sim_url);
    for slot in 0..n {
        workers.spawn(slot)?;
    }
    println!("e2e: {n} worker process(es); logs in {}", dir.display());
    Ok((workers, dir))
}

/// The `q` quantile (nearest rank) in milliseconds.
fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}
