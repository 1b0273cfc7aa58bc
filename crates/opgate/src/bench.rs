//! `opgate bench ingest`: the Kafka ingest path's throughput, measured end to end on the
//! embedded broker (librdkafka's mock cluster) and a real ledger, written to BENCHMARKS.md.
//!
//! The workload is the one the tests check for exactness: N records on P partitions, 20%
//! of them redeliveries of earlier events and 10% the same payment spelled differently.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use opgate_core::{Limits, Registry};
use opgate_kafka::config::PROPOSALS;
use opgate_kafka::topics::builtin_specs;
use opgate_kafka::{EmbeddedBroker, IngestStats, IngestWorker};
use rand::{Rng, SeedableRng};
use tokio_util::sync::CancellationToken;

const TOOLS: &str = r#"
[[tools]]
name = "pay"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"
"#;

/// Options of `opgate bench ingest`.
#[derive(Debug, clap::Args)]
pub struct IngestBench {
    /// Records to produce.
    #[arg(long, default_value_t = 10_000)]
    pub proposals: usize,
    /// Partitions of the proposals topic.
    #[arg(long, default_value_t = 8)]
    pub partitions: i32,
    /// Records per ingest batch.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Ledger URL (default: a fresh SQLite file in the temp dir).
    #[arg(long)]
    pub database_url: Option<String>,
    /// Append the figures to this Markdown file.
    #[arg(long)]
    pub write: Option<PathBuf>,
}

/// Runs the ingest benchmark and prints (and optionally records) the figures.
pub async fn ingest(opts: IngestBench) -> anyhow::Result<()> {
    let (records, events, keys) = workload(opts.proposals, 42, 10)?;
    let mut specs = builtin_specs()?;
    for spec in &mut specs {
        if spec.name == PROPOSALS {
            spec.partitions = opts.partitions;
        }
    }
    let broker = EmbeddedBroker::start(1, "", &specs)?;
    let mut config = broker.kafka_config();
    config.batch.max_messages = opts.batch;

    let (_url, backend, ledger) = empty_ledger(opts.database_url.as_deref(), "ingest").await?;

    opgate_fleet::client::publish(&config, &records).await?;

    let registry = Arc::new(Registry::from_toml(TOOLS)?);
    let worker = IngestWorker::new(&config, ledger.clone(), registry, Limits::default())?;
    let stats = worker.stats();
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let handle = tokio::spawn(worker.run(cancel.clone()));
    let total = |s: &IngestStats| {
        IngestStats::get(&s.accepted)
            + IngestStats::get(&s.deduplicated_key)
            + IngestStats::get(&s.deduplicated_inbox)
            + IngestStats::get(&s.rejected)
    };
    // The first stored batch marks the end of joining the group (the mock cluster delays
    // a new group's first rebalance by 3 s, as Kafka does): the steady-state rate is
    // measured from there.
    let mut first: Option<(Instant, u64)> = None;
    while total(&stats) < records.len() as u64 {
        if started.elapsed() > Duration::from_secs(600) {
            bail!("ingest did not finish in 10 minutes");
        }
        if first.is_none() && total(&stats) > 0 {
            first = Some((Instant::now(), total(&stats)));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.elapsed();
    let (first_at, first_count) = first.unwrap_or((started, 0));
    let joined = first_at - started;
    let steady = elapsed.saturating_sub(joined);
    let steady_rate = (records.len() as u64 - first_count) as f64 / steady.as_secs_f64().max(1e-9);
    cancel.cancel();
    handle.await??;

    let accepted = IngestStats::get(&stats.accepted);
    if accepted != keys as u64 {
        bail!("expected {keys} operations, the worker accepted {accepted}");
    }
    let rate = records.len() as f64 / elapsed.as_secs_f64();
    let batches = IngestStats::get(&stats.batches);
    let line = format!(
        "| {} | {} | {} | {} | {backend} | {} | {:.2} s | {:.0} | {:.2} s | **{steady_rate:.0}** | {batches} |",
        today(),
        records.len(),
        events,
        keys,
        opts.partitions,
        elapsed.as_secs_f64(),
        rate,
        joined.as_secs_f64(),
    );
    println!(
        "ingest: {} records ({events} events, {keys} keys) on {} partitions into {backend}: {:.2} s in all, {rate:.0} proposals/s; \
         after joining the group ({:.2} s): {steady_rate:.0} proposals/s; {batches} ledger transactions",
        records.len(),
        opts.partitions,
        elapsed.as_secs_f64(),
        joined.as_secs_f64(),
    );
    if let Some(path) = opts.write {
        append_row(&path, &line)?;
    }
    Ok(())
}

/// Appends a table row to a Markdown file.
pub(crate) fn append_row(path: &std::path::Path, line: &str) -> anyhow::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)?;
    writeln!(file, "{line}")?;
    println!("appended to {}", path.display());
    Ok(())
}

/// A migrated ledger for a benchmark with no operation in the benchmark's namespace
/// (`bench`; others may hold history, as for the P4 figures): the given URL, or a fresh
/// SQLite file in the temp dir. Returns its URL, the backend's name and the ledger.
pub(crate) async fn empty_ledger(
    url: Option<&str>,
    bench: &str,
) -> anyhow::Result<(String, &'static str, opgate_store::SharedLedger)> {
    let (url, backend) = match url {
        Some(url) if url.starts_with("postgres") => (url.to_owned(), "PostgreSQL"),
        Some(url) => (url.to_owned(), "SQLite"),
        None => {
            let path = std::env::temp_dir().join(format!("opgate-{bench}-{}.db", uuid_like()));
            (format!("sqlite://{}", path.display()), "SQLite")
        }
    };
    opgate_store::migrate(&url).await?;
    let ledger = opgate_store::open(&url).await?;
    let mine = opgate_store::ListFilter {
        namespace: Some("bench".into()),
        limit: Some(1),
        ..Default::default()
    };
    if !ledger.list(&mine).await?.operations.is_empty() {
        bail!("the benchmark needs a ledger without operations in namespace `bench`: {url}");
    }
    Ok((url, backend, ledger))
}

/// A benchmark's records, each (Kafka key, value).
pub(crate) type Records = Vec<(String, Vec<u8>)>;

/// (records as (key, value)), distinct events, distinct keys; `per_entity` operations
/// share each order (their dispatches are serialized). Too few records to make one key
/// (fewer than 3) is an error.
pub(crate) fn workload(
    n: usize,
    seed: u64,
    per_entity: usize,
) -> anyhow::Result<(Records, usize, usize)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let events = n * 8 / 10;
    let keys = events * 7 / 8;
    if keys == 0 {
        bail!("{n} records make no distinct operation: the workload needs at least 3");
    }
    let entities = (keys / per_entity.max(1)).max(1);
    let make = |event: String, k: usize, spelled: bool| {
        let order = format!("o{}", k % entities);
        let amount = if spelled {
            format!("{}", k / entities + 1)
        } else {
            format!("{}.00", k / entities + 1)
        };
        let value = serde_json::json!({"event_id": event, "namespace": "bench", "tool": "pay",
            "entity": {"type": "order", "id": order}, "args": {"amount": amount, "currency": "usd"}});
        (format!("order:{order}"), value.to_string().into_bytes())
    };
    let mut records: Vec<_> = (0..keys).map(|k| make(format!("e{k}"), k, false)).collect();
    for i in 0..events - keys {
        records.push(make(format!("d{i}"), rng.random_range(0..keys), true));
    }
    for _ in 0..n - events {
        let pick = records[rng.random_range(0..events)].clone();
        records.push(pick);
    }
    Ok((records, events, keys))
}

pub(crate) fn today() -> String {
    let now = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}",
        now.year(),
        u8::from(now.month()),
        now.day()
    )
}

fn uuid_like() -> String {
    format!("{:x}", rand::random::<u64>())
}
