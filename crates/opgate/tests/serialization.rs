//! Per-entity serialization across processes: two `opgate run --roles dispatch`
//! processes share one ledger; 50 proposals on one entity run one at a time, in ingest
//! order, while other entities proceed in parallel. The simulated provider records
//! overlapping calls per entity.

#![allow(missing_docs)]

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use opgate_core::{Delivery, IngestItem, Limits, Proposal, Registry, Source, Status};
use opgate_sim::{Sim, SimConfig};
use serde_json::json;
use uuid::Uuid;

const TOOLS: &str = r#"
[worker]
lease_ms = 5000

[[tools]]
name = "charge"
side_effect_class = "irreversible"
key = "charge:{entity}:{args.amount}"
[tools.args]
amount = "money_minor"
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/payments"
timeout_ms = 2000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${OPGATE_SIM_URL}/payments?idempotency_key={key}"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_dispatcher_processes_serialize_one_entity_in_ingest_order() {
    let dir = std::env::temp_dir().join(format!("opgate-serial-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = opgate_testkit::database_url(&dir).await;
    let config = dir.join("opgate.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{url}\"\n{TOOLS}")).expect("config");
    opgate_store::migrate(&url).await.expect("migrate");
    let ledger = opgate_store::open(&url).await.expect("ledger");
    let registry = Registry::from_toml(TOOLS).expect("registry");
    let sim = Sim::new(SimConfig {
        work: Duration::from_millis(5),
        ..SimConfig::default()
    });
    let (addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("sim");

    let mut batch = Vec::new();
    for n in 1..=50u64 {
        for entity in ["hot".to_owned(), format!("cold-{n}")] {
            let value = json!({"event_id": Uuid::now_v7().to_string(), "tool": "charge",
                "entity": {"type": "account", "id": entity}, "args": {"amount": n}});
            let proposal = Proposal::from_value(value, &Limits::default()).expect("proposal");
            batch.push(IngestItem::from_proposal(
                &registry,
                &proposal,
                Delivery {
                    principal: None,
                    source: Source::Http,
                    traceparent: None,
                },
            ));
        }
    }
    ledger.ingest(&batch).await.expect("ingest");

    let spawn = |n: usize| -> support::Reaped {
        support::Reaped::spawn(
            Command::new(env!("CARGO_BIN_EXE_opgate"))
                .args(["run", "--config"])
                .arg(&config)
                .args(["--roles", "dispatch"])
                .env("OPGATE_SIM_URL", format!("http://{addr}"))
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(dir.join(format!("dispatcher-{n}.log"))).expect("log"),
                )),
        )
    };
    let mut children = [spawn(1), spawn(2)];
    let started = Instant::now();
    while sim.effects().total < 100 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "only {} of 100 effects; logs in {}",
            sim.effects().total,
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The provider has seen every call; wait for the dispatchers to record the outcomes.
    let completed = opgate_store::ListFilter {
        status: Some(Status::CompletedSuccess),
        limit: Some(500),
        ..Default::default()
    };
    while ledger
        .list(&completed)
        .await
        .expect("list")
        .operations
        .len()
        < 100
    {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "outcomes not recorded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for child in &mut children {
        child.kill().expect("kill");
        child.wait().expect("reap");
    }
    let report = sim.effects();
    assert_eq!(
        (report.total, report.duplicates, report.overlaps),
        (100, 0, 0),
        "no duplicate, no overlap on one entity"
    );
    let hot: Vec<&str> = report
        .log
        .iter()
        .filter(|e| e.entity.as_deref() == Some("account:hot"))
        .map(|e| e.key.as_str())
        .collect();
    let expected: Vec<String> = (1..=50)
        .map(|n| format!("default/charge:hot:{}:v1", n * 100))
        .collect();
    assert_eq!(
        hot, expected,
        "the hot entity's charges ran in ingest order"
    );
    let first = report
        .log
        .iter()
        .position(|e| e.entity.as_deref() == Some("account:hot"))
        .expect("hot");
    let last = report
        .log
        .iter()
        .rposition(|e| e.entity.as_deref() == Some("account:hot"))
        .expect("hot");
    assert!(
        report.log[first..last]
            .iter()
            .any(|e| e.entity.as_deref() != Some("account:hot")),
        "other entities ran meanwhile"
    );
}
