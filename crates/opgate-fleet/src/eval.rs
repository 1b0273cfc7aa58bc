//! `opgate eval`: the seeds' KPIs, measured as an outside client measures them, for opgate
//! and for the naive baseline on the same records and the same misbehaving providers.
//!
//! 1. A seeded, labelled workload ([`crate::workload`]) is published to
//!    `opgate.proposals` at `--rate` records/s while `opgate run` worker processes (this
//!    binary) ingest, dispatch, reconcile and relay against the ledger and the simulated
//!    providers; `--chaos` kills and restarts them meanwhile, takes the broker down,
//!    forces rebalances and restarts PostgreSQL.
//! 2. Once every proposal is answered on `opgate.results` and every operation settled,
//!    the run is scored against the labels: effects per intent at the providers, answers
//!    per event, merges per labelled near-duplicate, and the ledger's histories.
//! 3. The same records go to a topic of their own at the same rate, read by the naive
//!    baseline ([`crate::baseline`]) against a fresh set of providers with the same faults.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use opgate_core::Status;
use opgate_kafka::config::{DLQ, PROPOSALS, RESULTS};
use opgate_kafka::{EmbeddedBroker, KafkaConfig};
use opgate_sim::{FaultKind, FaultSpec, Sim, SimConfig};
use opgate_store::{ListFilter, SharedLedger};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::baseline::{self, BaselineConfig};
use crate::observe::Observer;
use crate::progress::Progress;
use crate::workers::Workers;
use crate::workload::{self, Kind, NAMESPACE, Workload};

/// Attempt outcomes after which nobody knows whether the call acted.
const AMBIGUOUS: [&str; 4] = [
    "timeout_after_send",
    "server_error",
    "malformed_response",
    "lease_expired",
];

/// What a SIGKILL leaves behind waits for timeouts: the killed member's partitions for
/// its consumer-group session (librdkafka's default 45 s), the results its relay leased
/// for twice the producer's delivery timeout (opgate's default 30 s). The eval shortens
/// both (6 s and 5 s) so that chaos measures opgate rather than those waits.
const CLIENT: &str = "[kafka.client]\n\"session.timeout.ms\" = \"6000\"\n\"heartbeat.interval.ms\" = \"1000\"\n\"message.timeout.ms\" = \"5000\"\n";

/// The topic the baseline reads (the same records, published again at the same rate).
const BASELINE_TOPIC: &str = "opgate.baseline.proposals";

/// Options of `opgate eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// Records to publish (proposals with their redeliveries, duplicates and poison).
    #[arg(long, default_value_t = 10_000)]
    pub operations: usize,
    /// Share of provider calls that misbehave (0.0 to 1.0), spread over every fault kind.
    #[arg(long, default_value_t = 0.0)]
    pub faults: f64,
    /// Kill (SIGKILL) and restart worker processes at random moments, take the broker
    /// down (embedded broker), force a consumer-group rebalance and restart PostgreSQL
    /// (when the ledger is a local PostgreSQL and `pg_ctlcluster` exists).
    #[arg(long)]
    pub chaos: bool,
    /// Seed of the workload, the faults and the chaos.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Records published per second (0: as fast as the producer goes).
    #[arg(long, default_value_t = 500.0)]
    pub rate: f64,
    /// `opgate run` worker processes (default 1, or 2 with --chaos).
    #[arg(long)]
    pub workers: Option<usize>,
    /// The ledger (default: a fresh SQLite file). Must hold no operations.
    #[arg(long)]
    pub database_url: Option<String>,
    /// A Kafka cluster to use instead of the embedded broker (topics get a fresh prefix).
    #[arg(long)]
    pub brokers: Option<String>,
    /// Skip the naive baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Give up waiting for answers after this many seconds.
    #[arg(long, default_value_t = 1_200)]
    pub timeout_secs: u64,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the report as a Markdown table here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// What the eval needs from the binary.
pub struct EvalSetup {
    /// The `opgate` executable (for the worker processes).
    pub exe: PathBuf,
    /// The dev registry's tools and worker settings (`${OPGATE_SIM_URL}` in adapters).
    pub tools: &'static str,
}

/// The seeds' KPIs for one system.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Kpis {
    /// `opgate` or `naive baseline`.
    pub system: String,
    /// Intents that took effect at least once.
    pub intents_with_effect: u64,
    /// Effects at the providers.
    pub effects: u64,
    /// Effects beyond the first per intent.
    pub duplicate_effects: u64,
    /// Per 10,000 intents.
    pub duplicate_effects_per_10k: f64,
    /// Effects no intent explains (must be 0).
    pub unattributed_effects: u64,
    /// The intents that acted more than once: `provider key xN` per effect key (at most 20).
    pub duplicated: Vec<String>,
    /// Proposals (distinct event ids) published and never answered.
    pub lost: u64,
    /// Labelled near-duplicates merged with their original.
    pub false_dedupes: u64,
    /// Labelled near-duplicate pairs.
    pub near_pairs: u64,
    /// `false_dedupes / near_pairs`.
    pub false_dedupe_rate: f64,
    /// Re-spelled or re-planned proposals that acted as a new operation.
    pub missed_dedupes: u64,
    /// Re-spelled or re-planned proposals.
    pub duplicate_proposals: u64,
    /// `missed_dedupes / duplicate_proposals`.
    pub missed_dedupe_rate: f64,
    /// Outcomes that were not known after a call (opgate: operations with an attempt
    /// that timed out after sending, answered 5xx or unreadably, or was lost with its
    /// worker; baseline: calls that timed out or answered 5xx).
    pub ambiguous: u64,
    /// Share of them resolved without a person (baseline: none is ever resolved).
    pub resolved_without_person: f64,
    /// Mean time from the first ambiguous attempt to the operation settled, ms.
    pub resolve_mean_ms: Option<f64>,
    /// p99 of it, ms.
    pub resolve_p99_ms: Option<f64>,
    /// Operations waiting for a person at the end.
    pub needs_attention: u64,
    /// Entity conflicts (exclusive-group suppressions, key conflicts) per 1,000 intents.
    pub conflicts_per_1k: f64,
    /// Requests that overlapped on one entity at the providers.
    pub overlapping_writes: u64,
    /// Proposal published -> first effect at the provider, p50, ms.
    pub latency_p50_ms: f64,
    /// Its p99, ms.
    pub latency_p99_ms: f64,
    /// First record published -> last result on the results topic, s.
    pub elapsed_s: f64,
    /// Records handled per second over `elapsed_s`.
    pub records_per_s: f64,
    /// Ledger transactions per operation (PostgreSQL).
    pub transactions_per_operation: Option<f64>,
    /// Ledger row writes per operation (PostgreSQL).
    pub row_writes_per_operation: Option<f64>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    /// The command's options, as run.
    pub settings: BTreeMap<String, String>,
    /// The workload's make-up.
    pub workload: BTreeMap<String, u64>,
    /// opgate's KPIs.
    pub opgate: Kpis,
    /// The baseline's, when it ran.
    pub baseline: Option<Kpis>,
    /// What the chaos did, in order.
    pub chaos: Vec<String>,
    /// Dead letters by reason.
    pub dlq: BTreeMap<String, u64>,
    /// Worker processes that exited on their own (restarted; should be 0).
    pub worker_crashes: u32,
}

impl EvalReport {
    /// The promises: no duplicate effect, nothing lost, no false merge.
    pub fn verdict(&self) -> anyhow::Result<()> {
        let o = &self.opgate;
        let mut broken = Vec::new();
        if o.duplicate_effects > 0 || o.unattributed_effects > 0 {
            broken.push(format!(
                "{} duplicate and {} unattributed effects",
                o.duplicate_effects, o.unattributed_effects
            ));
        }
        if o.lost > 0 {
            broken.push(format!("{} proposals never answered", o.lost));
        }
        if o.false_dedupes > 0 {
            broken.push(format!("{} near-duplicates merged", o.false_dedupes));
        }
        if o.overlapping_writes > 0 {
            broken.push(format!("{} overlapping writes", o.overlapping_writes));
        }
        if self.worker_crashes > 0 {
            broken.push(format!(
                "{} worker processes exited on their own",
                self.worker_crashes
            ));
        }
        if broken.is_empty() {
            Ok(())
        } else {
            bail!("opgate broke its promises: {}", broken.join("; "))
        }
    }
}

/// Runs the eval.
pub async fn run(setup: EvalSetup, args: EvalArgs) -> anyhow::Result<EvalReport> {
    let dir = std::env::temp_dir().join(format!("opgate-eval-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)?;
    let workload = workload::generate(args.operations, args.seed);
    say(&format!(
        "workload: {} records, {} intents, {} labelled near-duplicates (seed {})",
        workload.records.len(),
        workload.intents,
        workload.near_pairs.len(),
        args.seed
    ));

    // The broker: embedded (librdkafka's mock cluster, served over TCP to the workers),
    // or a real cluster with topics under a fresh prefix.
    let mut specs = opgate_kafka::topics::builtin_specs()?;
    let mut baseline_spec = specs
        .iter()
        .find(|s| s.name == PROPOSALS)
        .context("the proposals topic spec")?
        .clone();
    baseline_spec.name = BASELINE_TOPIC.to_owned();
    specs.push(baseline_spec);
    let (kafka, broker) = match &args.brokers {
        Some(brokers) => {
            let mut kafka = KafkaConfig::new(brokers.clone());
            kafka.topic_prefix = format!("eval-{:08x}.", rand::random::<u32>());
            kafka.replication_factor = Some(1);
            opgate_kafka::topics::ensure_topics(&kafka, &specs).await?;
            (kafka, None)
        }
        None => {
            let broker = EmbeddedBroker::start(1, "", &specs)?;
            (broker.kafka_config(), Some(broker))
        }
    };

    let sim = start_providers(&args).await?;
    let sim_url = sim.1.clone();
    let sim = sim.0;

    let (url, ledger) = fresh_ledger(args.database_url.as_deref(), &dir).await?;
    let config_path = dir.join("opgate.toml");
    std::fs::write(
        &config_path,
        format!(
            "{}\n[database]\nurl = \"{url}\"\n\n[kafka]\nbrokers = \"{}\"\ntopic_prefix = \"{}\"\n{CLIENT}",
            setup.tools, kafka.brokers, kafka.topic_prefix
        ),
    )?;

    let observer = Observer::default();
    let cancel = CancellationToken::new();
    let reader = observer.spawn_reader(
        kafka.client_config()?,
        &kafka.topic(RESULTS),
        &kafka.topic(DLQ),
        cancel.clone(),
    )?;
    let pg = match url.starts_with("postgres") {
        true => Some(sqlx::PgPool::connect(&url).await?),
        false => None,
    };
    let before = pg_counters(pg.as_ref()).await?;

    let worker_count = args
        .workers
        .unwrap_or(if args.chaos { 2 } else { 1 })
        .max(1);
    let mut workers = Workers::new(&setup.exe, &config_path, &dir, &sim_url);
    for slot in 0..worker_count {
        workers.spawn(slot)?;
    }
    say(&format!(
        "opgate: {worker_count} worker process(es), ledger {}, broker {}{}{}",
        if pg.is_some() { "PostgreSQL" } else { "SQLite" },
        if broker.is_some() {
            "embedded (librdkafka mock cluster over TCP)"
        } else {
            "external"
        },
        if args.faults > 0.0 {
            format!(", {:.1}% provider faults", args.faults * 100.0)
        } else {
            String::new()
        },
        if args.chaos { ", chaos" } else { "" },
    ));

    // The clock starts once the workers consume: a warm-up record (not a proposal) has
    // come back as a dead letter.
    warm_up(&kafka, &kafka.topic(PROPOSALS)).await?;
    wait_until(Duration::from_secs(120), || {
        observer.lock().dlq.values().sum::<u64>() >= 1
    })
    .await
    .context("the workers did not consume the warm-up record in 120 s")?;
    let started = Instant::now();
    let published_at = publish_at_rate(&kafka, &kafka.topic(PROPOSALS), &workload, args.rate, &sim);
    let expected_dlq = workload
        .records
        .iter()
        .filter(|r| r.kind == Kind::Poison && r.event_id.is_none())
        .count() as u64
        + 1;
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let chaos_stop = CancellationToken::new();
    let workers = std::sync::Mutex::new(workers);
    let watch = async {
        let published = published_at.await??;
        // Chaos goes on for a while after the last record; then everything must converge.
        if args.chaos {
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        chaos_stop.cancel();
        anyhow::Ok(published)
    };
    let chaos = chaos_loop(
        args.chaos,
        args.seed,
        &workers,
        broker.as_ref(),
        &url,
        &chaos_stop,
    );
    let (published_at, chaos) = tokio::join!(watch, chaos);
    let published_at = published_at?;
    let (chaos_log, crashes) = chaos?;
    wait_for_answers(&observer, &workload, expected_dlq, deadline, "opgate").await;
    // Until the last result: every answer and every operation's final state.
    let last_answer = observer.lock().last_result_at.unwrap_or_else(Instant::now);
    let elapsed = last_answer.saturating_duration_since(started);
    let crashes = crashes
        + workers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restart_exited()?;
    workers.lock().unwrap_or_else(|e| e.into_inner()).stop_all();
    let after = pg_counters(pg.as_ref()).await?;
    cancel.cancel();
    let _ = reader.await;

    let mut opgate = score_opgate(&workload, &observer, &sim, &ledger, &published_at).await?;
    opgate.elapsed_s = elapsed.as_secs_f64();
    opgate.records_per_s = workload.records.len() as f64 / elapsed.as_secs_f64().max(1e-9);
    let operations = count_operations(&ledger).await?;
    if let (Some(b), Some(a)) = (before, after) {
        opgate.transactions_per_operation = Some((a.0 - b.0) as f64 / operations.max(1) as f64);
        opgate.row_writes_per_operation = Some((a.1 - b.1) as f64 / operations.max(1) as f64);
    }

    let baseline = if args.no_baseline {
        None
    } else {
        say("naive baseline: the same records, a consumer that calls the providers directly");
        Some(run_baseline(&kafka, &workload, &args).await?)
    };
    drop(broker);

    let mut settings = BTreeMap::new();
    settings.insert("records".into(), args.operations.to_string());
    settings.insert("faults".into(), args.faults.to_string());
    settings.insert("chaos".into(), args.chaos.to_string());
    settings.insert("seed".into(), args.seed.to_string());
    settings.insert("rate".into(), args.rate.to_string());
    settings.insert("workers".into(), worker_count.to_string());
    settings.insert(
        "ledger".into(),
        if pg.is_some() { "PostgreSQL" } else { "SQLite" }.into(),
    );
    settings.insert(
        "broker".into(),
        match &args.brokers {
            Some(b) => format!("external ({b})"),
            None => "embedded (librdkafka mock cluster)".into(),
        },
    );
    let mut mix = BTreeMap::new();
    for kind in [
        Kind::Fresh,
        Kind::Redelivery,
        Kind::Respelled,
        Kind::Replanned,
        Kind::NearDuplicate,
        Kind::Poison,
    ] {
        mix.insert(kind.as_str().to_owned(), workload.count(kind) as u64);
    }
    mix.insert("intents".into(), workload.intents as u64);
    mix.insert("operations in the ledger".into(), operations);
    let mut dlq = observer.lock().dlq.clone();
    // The warm-up record is not part of the workload.
    if let Some(n) = dlq.get_mut("not_json") {
        *n -= 1;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(EvalReport {
        settings,
        workload: mix,
        opgate,
        baseline,
        chaos: chaos_log,
        dlq,
        worker_crashes: crashes,
    })
}

fn say(line: &str) {
    println!("\n== {line}");
}

/// The simulated providers with the run's faults, on a port of their own.
async fn start_providers(args: &EvalArgs) -> anyhow::Result<(Sim, String)> {
    let sim = Sim::new(SimConfig {
        seed: args.seed,
        hang: Duration::from_millis(2_500),
        propagation: Duration::from_millis(1_500),
        ..SimConfig::default()
    });
    if args.faults > 0.0 {
        let share = args.faults / FaultKind::ALL.len() as f64;
        for provider in opgate_sim::PROVIDERS {
            for fault in FaultKind::ALL {
                sim.add_fault(FaultSpec {
                    provider: provider.into(),
                    match_prefix: None,
                    fault,
                    times: None,
                    probability: Some(share),
                });
            }
        }
    }
    let (addr, _server) = opgate_sim::start("127.0.0.1:0".parse()?, sim.clone()).await?;
    Ok((sim, format!("http://{addr}")))
}

/// A migrated ledger with no operations: the given URL, or a fresh SQLite file.
async fn fresh_ledger(
    url: Option<&str>,
    dir: &std::path::Path,
) -> anyhow::Result<(String, SharedLedger)> {
    let url = match url {
        Some(url) => url.to_owned(),
        None => format!("sqlite://{}", dir.join("ledger.db").display()),
    };
    opgate_store::migrate(&url).await?;
    let ledger = opgate_store::open(&url).await?;
    let any = ledger
        .list(&ListFilter {
            limit: Some(1),
            ..ListFilter::default()
        })
        .await?;
    if !any.operations.is_empty() {
        bail!("the eval needs a ledger without operations: {url}");
    }
    Ok((url, ledger))
}

/// Database-wide (commits, row writes) on PostgreSQL.
async fn pg_counters(pool: Option<&sqlx::PgPool>) -> anyhow::Result<Option<(i64, i64)>> {
    let Some(pool) = pool else { return Ok(None) };
    let row: (i64, i64) = sqlx::query_as(
        "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted \
         FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(pool)
    .await?;
    Ok(Some(row))
}

/// Publishes the records at `rate` per second (in a task); returns, per event id, when
/// its first record was published on the providers' clock.
fn publish_at_rate(
    kafka: &KafkaConfig,
    topic: &str,
    workload: &Workload,
    rate: f64,
    sim: &Sim,
) -> tokio::task::JoinHandle<anyhow::Result<HashMap<String, u64>>> {
    let producer: anyhow::Result<FutureProducer> = kafka
        .client_config()
        .map_err(anyhow::Error::from)
        .and_then(|mut c| {
            c.set("enable.idempotence", "true")
                .set("linger.ms", "5")
                .create()
                .map_err(anyhow::Error::from)
        });
    let records = workload.records.clone();
    let topic = topic.to_owned();
    let sim = sim.clone();
    tokio::spawn(async move {
        let producer = producer?;
        let started = Instant::now();
        let progress = Progress::new();
        let mut published = HashMap::new();
        let mut pending = Vec::new();
        for (i, record) in records.iter().enumerate() {
            if rate > 0.0 {
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(due.into()).await;
            }
            if let Some(event) = &record.event_id {
                published
                    .entry(event.clone())
                    .or_insert_with(|| sim.elapsed_ms());
            }
            let delivery = producer
                .send_result(
                    FutureRecord::to(&topic)
                        .key(&record.key)
                        .payload(&record.value),
                )
                .map_err(|(e, _)| anyhow::anyhow!("publishing: {e}"))?;
            pending.push(delivery);
            if pending.len() >= 1_000 {
                for d in pending.drain(..) {
                    d.await?
                        .map_err(|(e, _)| anyhow::anyhow!("publishing: {e}"))?;
                }
            }
            if i % 500 == 0 {
                progress.line(&format!("published {}/{}", i + 1, records.len()));
            }
        }
        for d in pending {
            d.await?
                .map_err(|(e, _)| anyhow::anyhow!("publishing: {e}"))?;
        }
        producer.flush(Duration::from_secs(30))?;
        progress.done();
        Ok(published)
    })
}

/// Publishes one record that is not a proposal, to see the consumers are live.
async fn warm_up(kafka: &KafkaConfig, topic: &str) -> anyhow::Result<()> {
    let producer: FutureProducer = kafka.client_config()?.create()?;
    producer
        .send(
            FutureRecord::to(topic)
                .key("warm-up")
                .payload("opgate eval warm-up"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| anyhow::anyhow!("publishing the warm-up record: {e}"))?;
    Ok(())
}

/// Polls `done` every 50 ms until it holds or `limit` passes.
async fn wait_until(limit: Duration, done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Waits until every event is answered, every operation settled and every record without
/// an event id dead-lettered (or the deadline passes).
async fn wait_for_answers(
    observer: &Observer,
    workload: &Workload,
    expected_dlq: u64,
    deadline: Instant,
    phase: &str,
) {
    let events = workload.events();
    let progress = Progress::new();
    loop {
        let (answered, unsettled, operations, dlq) = {
            let seen = observer.lock();
            let answered = events
                .iter()
                .filter(|e| seen.answers.contains_key(**e))
                .count();
            (
                answered,
                seen.unsettled(),
                seen.latest.len(),
                seen.dlq.values().sum::<u64>(),
            )
        };
        progress.line(&format!(
            "{phase}: answered {answered}/{} · {} of {operations} operations settled · {dlq} dead letters",
            events.len(),
            operations - unsettled
        ));
        if answered == events.len() && unsettled == 0 && dlq >= expected_dlq {
            progress.done();
            return;
        }
        if Instant::now() >= deadline {
            progress.done();
            println!("gave up waiting (--timeout-secs)");
            return;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Kills, restarts, outages and rebalances at random moments until `stop`.
async fn chaos_loop(
    enabled: bool,
    seed: u64,
    workers: &std::sync::Mutex<Workers>,
    broker: Option<&EmbeddedBroker>,
    url: &str,
    stop: &CancellationToken,
) -> anyhow::Result<(Vec<String>, u32)> {
    let mut log = Vec::new();
    let mut crashes = 0;
    let mut rng = StdRng::seed_from_u64(seed.wrapping_add(0xC4A05));
    let started = Instant::now();
    let mut restarted_postgres = false;
    let lock = || workers.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let pause = Duration::from_millis(rng.random_range(3_000..8_000));
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(pause) => {}
        }
        crashes += lock().restart_exited()?;
        if !enabled {
            continue;
        }
        let at = started.elapsed().as_secs_f64();
        match rng.random_range(0..10) {
            0..6 => {
                let slots = lock().slots();
                let slot = rng.random_range(0..slots);
                lock().kill(slot);
                let down = Duration::from_millis(rng.random_range(200..2_000));
                log.push(format!(
                    "{at:.1}s SIGKILL worker {slot}, restarted {} ms later",
                    down.as_millis()
                ));
                tokio::time::sleep(down).await;
                lock().spawn(slot)?;
            }
            6 => {
                // A member joins and leaves: two rebalances.
                let slot = lock().slots();
                lock().spawn(slot)?;
                let stay = Duration::from_millis(rng.random_range(3_000..6_000));
                tokio::time::sleep(stay).await;
                tokio::task::block_in_place(|| lock().retire(slot));
                log.push(format!(
                    "{at:.1}s rebalance: a worker joined for {} ms and left (SIGTERM)",
                    stay.as_millis()
                ));
            }
            7 | 8 => {
                if let Some(broker) = &broker {
                    let down = Duration::from_millis(rng.random_range(1_000..3_000));
                    broker.broker_down(1)?;
                    tokio::time::sleep(down).await;
                    broker.broker_up(1)?;
                    log.push(format!("{at:.1}s broker down for {} ms", down.as_millis()));
                }
            }
            _ => {
                if !restarted_postgres && url.starts_with("postgres") {
                    restarted_postgres = true;
                    log.push(format!("{at:.1}s {}", restart_postgres()));
                }
            }
        }
    }
    Ok((log, crashes))
}

/// Restarts the local PostgreSQL cluster (`pg_ctlcluster`), or says why it could not.
fn restart_postgres() -> String {
    let version = std::fs::read_dir("/etc/postgresql")
        .ok()
        .and_then(|mut d| d.next())
        .and_then(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned());
    let Some(version) = version else {
        return "PostgreSQL restart skipped (no /etc/postgresql)".into();
    };
    let status = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match status {
        Ok(s) if s.success() => "PostgreSQL restarted (pg_ctlcluster restart)".into(),
        Ok(s) => format!("PostgreSQL restart failed ({s})"),
        Err(e) => format!("PostgreSQL restart not possible ({e})"),
    }
}

/// Every operation of the eval's namespace.
async fn all_operations(ledger: &SharedLedger) -> anyhow::Result<Vec<opgate_core::Operation>> {
    let mut all = Vec::new();
    let mut cursor = None;
    loop {
        let page = ledger
            .list(&ListFilter {
                namespace: Some(NAMESPACE.into()),
                limit: Some(500),
                cursor,
                ..ListFilter::default()
            })
            .await?;
        all.extend(page.operations);
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(all),
        }
    }
}

async fn count_operations(ledger: &SharedLedger) -> anyhow::Result<u64> {
    Ok(all_operations(ledger).await?.len() as u64)
}

/// The `q` quantile (nearest rank).
fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// Intent of each event id.
fn intents_by_event(workload: &Workload) -> HashMap<&str, usize> {
    workload
        .records
        .iter()
        .filter_map(|r| Some((r.event_id.as_deref()?, r.intent?)))
        .collect()
}

/// Duplicate effects, intents with an effect and latencies, from effects attributed to
/// intents (`intent_of_key`), against the first publication of each intent.
fn score_effects(
    kpis: &mut Kpis,
    effects: &opgate_sim::EffectsReport,
    intent_of_key: &HashMap<String, usize>,
    first_published: &HashMap<usize, u64>,
) {
    let mut per_intent: HashMap<usize, u64> = HashMap::new();
    let mut first_effect: HashMap<usize, u64> = HashMap::new();
    for e in &effects.log {
        match intent_of_key.get(&e.key) {
            Some(intent) => {
                *per_intent.entry(*intent).or_default() += 1;
                let first = first_effect.entry(*intent).or_insert(e.at_ms);
                *first = (*first).min(e.at_ms);
            }
            None => kpis.unattributed_effects += 1,
        }
    }
    kpis.effects = effects.total;
    kpis.intents_with_effect = per_intent.len() as u64;
    kpis.duplicate_effects = per_intent.values().map(|n| n.saturating_sub(1)).sum();
    let twice: HashSet<usize> = per_intent
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(i, _)| *i)
        .collect();
    kpis.duplicated = effects
        .effects
        .iter()
        .filter(|e| intent_of_key.get(&e.key).is_some_and(|i| twice.contains(i)))
        .map(|e| {
            format!(
                "intent {}: {} {} x{}",
                intent_of_key[&e.key], e.provider, e.key, e.count
            )
        })
        .take(20)
        .collect();
    kpis.overlapping_writes = effects.overlaps;
    let mut latencies: Vec<f64> = first_effect
        .iter()
        .filter_map(|(intent, at)| {
            let published = first_published.get(intent)?;
            Some(at.saturating_sub(*published) as f64)
        })
        .collect();
    kpis.latency_p50_ms = percentile(&mut latencies, 0.50);
    kpis.latency_p99_ms = percentile(&mut latencies, 0.99);
}

fn first_published(workload: &Workload, published: &HashMap<String, u64>) -> HashMap<usize, u64> {
    let mut first: HashMap<usize, u64> = HashMap::new();
    for r in &workload.records {
        if let (Some(event), Some(intent)) = (&r.event_id, r.intent)
            && let Some(at) = published.get(event)
        {
            let slot = first.entry(intent).or_insert(*at);
            *slot = (*slot).min(*at);
        }
    }
    first
}

async fn score_opgate(
    workload: &Workload,
    observer: &Observer,
    sim: &Sim,
    ledger: &SharedLedger,
    published: &HashMap<String, u64>,
) -> anyhow::Result<Kpis> {
    let mut k = Kpis {
        system: "opgate".into(),
        ..Kpis::default()
    };
    let intent_of_event = intents_by_event(workload);
    let operations = all_operations(ledger).await?;
    // An operation's intent is that of the proposal that created it; its key is what the
    // providers saw.
    let mut intent_of_key = HashMap::new();
    for op in &operations {
        if let Some(intent) = intent_of_event.get(op.event_id.as_str()) {
            intent_of_key.insert(
                opgate_core::key::scoped_key(&op.namespace, &op.idempotency_key),
                *intent,
            );
        }
    }
    score_effects(
        &mut k,
        &sim.effects(),
        &intent_of_key,
        &first_published(workload, published),
    );

    score_answers(&mut k, workload, &observer.lock());

    // Ambiguity and its resolution, from the ledger's attempts and histories: an
    // operation was ambiguous once an attempt may have acted without saying so (a
    // timeout after sending, a 5xx, an unreadable answer, a worker lost mid-call).
    let mut resolve_ms = Vec::new();
    let mut resolved_alone = 0u64;
    for op in &operations {
        if op.status == Status::NeedsAttention {
            k.needs_attention += 1;
        }
        if op.attempt_count == 0 {
            continue;
        }
        let attempts = ledger.attempts(op.operation_id).await?;
        let Some(since) = attempts.iter().find_map(|a| {
            let report = a.report.as_ref()?;
            let ambiguous = [
                Some(report.outcome.as_str()),
                report.error_category.as_deref(),
            ]
            .into_iter()
            .flatten()
            .any(|c| AMBIGUOUS.contains(&c));
            ambiguous.then(|| a.finished_at.unwrap_or(a.started_at))
        }) else {
            continue;
        };
        k.ambiguous += 1;
        if !op.status.is_terminal() {
            continue;
        }
        let events = ledger.events(op.operation_id).await?;
        // Workers sign their claims; any other signed event is a person's command.
        let by_person = events
            .iter()
            .any(|e| e.actor.is_some() && e.reason != "claimed");
        if !by_person && op.status != Status::NeedsAttention {
            resolved_alone += 1;
            resolve_ms.push((op.updated_at - since).as_seconds_f64().max(0.0) * 1_000.0);
        }
    }
    k.resolved_without_person = if k.ambiguous == 0 {
        1.0
    } else {
        resolved_alone as f64 / k.ambiguous as f64
    };
    if !resolve_ms.is_empty() {
        k.resolve_mean_ms = Some(resolve_ms.iter().sum::<f64>() / resolve_ms.len() as f64);
        k.resolve_p99_ms = Some(percentile(&mut resolve_ms, 0.99));
    }
    k.duplicate_effects_per_10k =
        k.duplicate_effects as f64 * 10_000.0 / workload.intents.max(1) as f64;
    Ok(k)
}

/// Lost proposals, false and missed dedupes and conflicts, from the answers on
/// `opgate.results`.
fn score_answers(k: &mut Kpis, workload: &Workload, seen: &crate::observe::Observed) {
    let events = workload.events();
    k.lost = events
        .iter()
        .filter(|e| !seen.answers.contains_key(**e))
        .count() as u64;
    let operation_of = |event: &str| seen.answers.get(event).and_then(|a| a.operation_id.clone());
    k.near_pairs = workload.near_pairs.len() as u64;
    k.false_dedupes = workload
        .near_pairs
        .iter()
        .filter(|p| {
            let near = operation_of(&p.near);
            near.is_some() && near == operation_of(&p.original)
        })
        .count() as u64;
    k.false_dedupe_rate = k.false_dedupes as f64 / k.near_pairs.max(1) as f64;

    // A duplicate proposal missed its dedupe when it became an operation of its own: its
    // answer names an operation other than the one its intent's first proposal got.
    let mut first_operation: HashMap<usize, String> = HashMap::new();
    let mut duplicates = HashSet::new();
    for r in &workload.records {
        let (Some(event), Some(intent)) = (r.event_id.as_deref(), r.intent) else {
            continue;
        };
        let Some(op) = operation_of(event) else {
            continue;
        };
        match r.kind {
            Kind::Fresh | Kind::NearDuplicate => {
                first_operation.entry(intent).or_insert(op);
            }
            Kind::Respelled | Kind::Replanned => {
                let acted_anew = first_operation.get(&intent) != Some(&op);
                if duplicates.insert(event) && acted_anew {
                    k.missed_dedupes += 1;
                }
            }
            _ => {}
        }
    }
    k.duplicate_proposals = duplicates.len() as u64;
    k.missed_dedupe_rate = k.missed_dedupes as f64 / k.duplicate_proposals.max(1) as f64;
    let conflicts = seen
        .answers
        .values()
        .filter(|a| {
            a.dedupe_reason.as_deref() == Some("exclusive_group")
                || a.error_category.as_deref() == Some("key_conflict")
        })
        .count();
    k.conflicts_per_1k = conflicts as f64 * 1_000.0 / workload.intents.max(1) as f64;
}

async fn run_baseline(
    kafka: &KafkaConfig,
    workload: &Workload,
    args: &EvalArgs,
) -> anyhow::Result<Kpis> {
    let (sim, sim_url) = start_providers(args).await?;
    let topic = kafka.topic(BASELINE_TOPIC);
    let (ready, is_ready) = tokio::sync::oneshot::channel();
    let consumer = baseline::run(
        kafka.client_config()?,
        topic.clone(),
        workload.records.len() + 1,
        ready,
        BaselineConfig {
            providers: sim_url,
            concurrency: 64,
            timeout: Duration::from_millis(1_000),
            tries: 3,
        },
    );
    let consumer = tokio::spawn(tokio::time::timeout(
        Duration::from_secs(args.timeout_secs),
        consumer,
    ));
    warm_up(kafka, &topic).await?;
    tokio::time::timeout(Duration::from_secs(120), is_ready)
        .await
        .context("the baseline did not consume the warm-up record in 120 s")??;
    let started = Instant::now();
    let published = publish_at_rate(kafka, &topic, workload, args.rate, &sim).await??;
    let run = consumer
        .await?
        .context("the baseline did not finish in --timeout-secs")??;
    let elapsed = started.elapsed();

    let mut k = Kpis {
        system: "naive baseline".into(),
        ..Kpis::default()
    };
    let intent_of_event = intents_by_event(workload);
    let intent_of_key: HashMap<String, usize> = intent_of_event
        .iter()
        .map(|(e, i)| ((*e).to_owned(), *i))
        .collect();
    let effects = sim.effects();
    score_effects(
        &mut k,
        &effects,
        &intent_of_key,
        &first_published(workload, &published),
    );
    let events = workload.events();
    let proposals: HashSet<&str> = workload
        .records
        .iter()
        .filter(|r| r.intent.is_some())
        .filter_map(|r| r.event_id.as_deref())
        .collect();
    k.lost = proposals
        .iter()
        .filter(|e| !run.answered.contains(**e))
        .count() as u64;
    let _ = events;
    k.near_pairs = workload.near_pairs.len() as u64;
    // The baseline never merges anything, so it never merges wrongly, and every duplicate
    // proposal that reached a provider without a key it shares acts again.
    let by_event = baseline::effects_by_event(&effects);
    let duplicates: HashSet<&str> = workload
        .records
        .iter()
        .filter(|r| matches!(r.kind, Kind::Respelled | Kind::Replanned))
        .filter_map(|r| r.event_id.as_deref())
        .collect();
    k.duplicate_proposals = duplicates.len() as u64;
    k.missed_dedupes = duplicates
        .iter()
        .filter(|e| by_event.get(**e).copied().unwrap_or(0) > 0)
        .count() as u64;
    k.missed_dedupe_rate = k.missed_dedupes as f64 / k.duplicate_proposals.max(1) as f64;
    k.ambiguous = run.ambiguous;
    k.resolved_without_person = 0.0;
    k.duplicate_effects_per_10k =
        k.duplicate_effects as f64 * 10_000.0 / workload.intents.max(1) as f64;
    k.elapsed_s = elapsed.as_secs_f64();
    k.records_per_s = workload.records.len() as f64 / k.elapsed_s.max(1e-9);
    Ok(k)
}

impl std::fmt::Display for EvalReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings: Vec<String> = self
            .settings
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "\n## opgate eval: {}\n", settings.join(", "))?;
        let mix: Vec<String> = self
            .workload
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "Workload: {}.\n", mix.join(", "))?;
        let b = self.baseline.as_ref();
        writeln!(f, "| KPI | opgate | naive baseline |")?;
        writeln!(f, "|---|---:|---:|")?;
        let o = &self.opgate;
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, a: String, b: Option<String>| {
            writeln!(f, "| {name} | {a} | {} |", b.unwrap_or_else(|| "-".into()))
        };
        let opt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
        row(
            f,
            "duplicate side effects",
            o.duplicate_effects.to_string(),
            b.map(|b| b.duplicate_effects.to_string()),
        )?;
        row(
            f,
            "duplicate side effects per 10k intents",
            format!("{:.1}", o.duplicate_effects_per_10k),
            b.map(|b| format!("{:.1}", b.duplicate_effects_per_10k)),
        )?;
        row(
            f,
            "effects no intent explains",
            o.unattributed_effects.to_string(),
            b.map(|b| b.unattributed_effects.to_string()),
        )?;
        row(
            f,
            "lost proposals (never answered)",
            o.lost.to_string(),
            b.map(|b| b.lost.to_string()),
        )?;
        row(
            f,
            "false dedupes (labelled near-duplicates merged)",
            format!(
                "{} of {} ({:.2}%)",
                o.false_dedupes,
                o.near_pairs,
                o.false_dedupe_rate * 100.0
            ),
            b.map(|b| format!("{} of {}", b.false_dedupes, b.near_pairs)),
        )?;
        row(
            f,
            "missed dedupes (duplicates that acted anew)",
            format!(
                "{} of {} ({:.2}%)",
                o.missed_dedupes,
                o.duplicate_proposals,
                o.missed_dedupe_rate * 100.0
            ),
            b.map(|b| {
                format!(
                    "{} of {} ({:.2}%)",
                    b.missed_dedupes,
                    b.duplicate_proposals,
                    b.missed_dedupe_rate * 100.0
                )
            }),
        )?;
        row(
            f,
            "ambiguous outcomes",
            o.ambiguous.to_string(),
            b.map(|b| b.ambiguous.to_string()),
        )?;
        row(
            f,
            "  resolved without a person",
            format!("{:.1}%", o.resolved_without_person * 100.0),
            b.map(|b| format!("{:.1}%", b.resolved_without_person * 100.0)),
        )?;
        row(
            f,
            "  time to resolve, mean / p99 (ms)",
            format!("{} / {}", opt(o.resolve_mean_ms), opt(o.resolve_p99_ms)),
            b.map(|_| "never resolved".into()),
        )?;
        row(
            f,
            "needs_attention at the end",
            o.needs_attention.to_string(),
            b.map(|_| "-".into()),
        )?;
        row(
            f,
            "entity conflicts per 1k intents",
            format!("{:.1}", o.conflicts_per_1k),
            b.map(|b| format!("{:.1}", b.conflicts_per_1k)),
        )?;
        row(
            f,
            "overlapping writes on one entity",
            o.overlapping_writes.to_string(),
            b.map(|b| b.overlapping_writes.to_string()),
        )?;
        row(
            f,
            "publish -> provider effect, p50 / p99 (ms)",
            format!("{:.0} / {:.0}", o.latency_p50_ms, o.latency_p99_ms),
            b.map(|b| format!("{:.0} / {:.0}", b.latency_p50_ms, b.latency_p99_ms)),
        )?;
        row(
            f,
            "elapsed (s)",
            format!("{:.1}", o.elapsed_s),
            b.map(|b| format!("{:.1}", b.elapsed_s)),
        )?;
        row(
            f,
            "records/s",
            format!("{:.0}", o.records_per_s),
            b.map(|b| format!("{:.0}", b.records_per_s)),
        )?;
        row(
            f,
            "ledger transactions / row writes per operation",
            match (o.transactions_per_operation, o.row_writes_per_operation) {
                (Some(t), Some(r)) => format!("{t:.1} / {r:.1}"),
                _ => "- (SQLite)".into(),
            },
            b.map(|_| "no ledger".into()),
        )?;
        if let Some(b) = b {
            writeln!(
                f,
                "\nopgate / baseline: throughput {:.2}x, p50 latency {:.2}x, p99 latency {:.2}x.",
                o.records_per_s / b.records_per_s.max(1e-9),
                o.latency_p50_ms / b.latency_p50_ms.max(1e-9),
                o.latency_p99_ms / b.latency_p99_ms.max(1e-9),
            )?;
        }
        for (system, k) in std::iter::once(o).chain(b).map(|k| (&k.system, k)) {
            if !k.duplicated.is_empty() {
                writeln!(f, "\nDuplicated by {system}: {}.", k.duplicated.join("; "))?;
            }
        }
        if !self.dlq.is_empty() {
            let dlq: Vec<String> = self.dlq.iter().map(|(k, v)| format!("{k} {v}")).collect();
            writeln!(f, "\nDead letters: {}.", dlq.join(", "))?;
        }
        if !self.chaos.is_empty() {
            writeln!(f, "\nChaos ({} actions):", self.chaos.len())?;
            for line in &self.chaos {
                writeln!(f, "- {line}")?;
            }
        }
        writeln!(
            f,
            "\nWorker processes that exited on their own: {}.",
            self.worker_crashes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opgate_sim::{EffectEntry, EffectsReport};

    fn effect(key: &str, at_ms: u64) -> EffectEntry {
        EffectEntry {
            provider: "payments".into(),
            key: key.into(),
            entity: None,
            received_ms: at_ms,
            at_ms,
        }
    }

    fn report(log: Vec<EffectEntry>) -> EffectsReport {
        EffectsReport {
            effects: Vec::new(),
            total: log.len() as u64,
            duplicates: 0,
            overlaps: 0,
            log,
        }
    }

    #[test]
    fn effects_are_scored_per_intent_not_per_key() {
        // Intent 0 acted under two keys (a missed dedupe): one duplicate effect, although
        // no key saw two effects. Intent 1 acted once; an effect no intent explains is
        // counted apart.
        let keys: HashMap<String, usize> = [("a".into(), 0), ("b".into(), 0), ("c".into(), 1)]
            .into_iter()
            .collect();
        let published: HashMap<usize, u64> = [(0, 100), (1, 200)].into_iter().collect();
        let mut k = Kpis::default();
        score_effects(
            &mut k,
            &report(vec![
                effect("a", 150),
                effect("b", 400),
                effect("c", 210),
                effect("zzz", 5),
            ]),
            &keys,
            &published,
        );
        assert_eq!(k.duplicate_effects, 1);
        assert_eq!(k.intents_with_effect, 2);
        assert_eq!(k.unattributed_effects, 1);
        // Latency is publish -> first effect of the intent: 50 and 10 ms.
        assert_eq!(k.latency_p50_ms, 10.0);
        assert_eq!(k.latency_p99_ms, 50.0);
    }

    fn clean_report() -> EvalReport {
        EvalReport {
            settings: BTreeMap::new(),
            workload: BTreeMap::new(),
            opgate: Kpis::default(),
            baseline: None,
            chaos: Vec::new(),
            dlq: BTreeMap::new(),
            worker_crashes: 0,
        }
    }

    #[test]
    fn any_broken_promise_fails_the_eval() {
        assert!(clean_report().verdict().is_ok());
        let broken: [fn(&mut EvalReport); 6] = [
            |r| r.opgate.duplicate_effects = 1,
            |r| r.opgate.unattributed_effects = 1,
            |r| r.opgate.lost = 1,
            |r| r.opgate.false_dedupes = 1,
            |r| r.opgate.overlapping_writes = 1,
            |r| r.worker_crashes = 1,
        ];
        for breaks in broken {
            let mut r = clean_report();
            breaks(&mut r);
            assert!(r.verdict().is_err(), "{:?}", r.opgate);
        }
    }

    /// Every proposal answered, with one operation per intent (poison: rejected).
    fn all_answered(w: &Workload) -> crate::observe::Observed {
        let mut seen = crate::observe::Observed::default();
        for r in &w.records {
            if let Some(e) = &r.event_id {
                seen.answers.insert(
                    e.clone(),
                    crate::observe::Answer {
                        status: "accepted".into(),
                        dedupe_reason: None,
                        operation_id: r.intent.map(|i| format!("op-{i}")),
                        error_category: None,
                        seen_at: Instant::now(),
                    },
                );
            }
        }
        seen
    }

    fn score(w: &Workload, seen: &crate::observe::Observed) -> (u64, u64, u64) {
        let mut k = Kpis::default();
        score_answers(&mut k, w, seen);
        assert!(k.duplicate_proposals > 0 && k.near_pairs > 0);
        (k.false_dedupes, k.missed_dedupes, k.lost)
    }

    fn first_of(w: &Workload, kind: Kind) -> String {
        w.records
            .iter()
            .find(|r| r.kind == kind)
            .and_then(|r| r.event_id.clone())
            .expect("a record of that kind")
    }

    #[test]
    fn a_merged_near_duplicate_a_missed_dedupe_and_a_lost_answer_are_counted() {
        let w = workload::generate(400, 3);
        assert_eq!(score(&w, &all_answered(&w)), (0, 0, 0));

        let mut merged = all_answered(&w);
        let pair = &w.near_pairs[0];
        let original = merged.answers[&pair.original].operation_id.clone();
        if let Some(a) = merged.answers.get_mut(&pair.near) {
            a.operation_id = original;
        }
        assert_eq!(score(&w, &merged).0, 1);

        let mut missed = all_answered(&w);
        if let Some(a) = missed.answers.get_mut(&first_of(&w, Kind::Respelled)) {
            a.operation_id = Some("another".into());
        }
        assert_eq!(score(&w, &missed), (0, 1, 0));

        let mut lost = all_answered(&w);
        lost.answers.remove(&first_of(&w, Kind::Fresh));
        assert_eq!(score(&w, &lost).2, 1);
    }
}
