//! Crash tests with real processes: `opgate run --roles dispatch,reconcile` is killed with
//! SIGKILL (or aborts at a crash point) and restarted; the reconciler must resolve every
//! operation with zero duplicate effects at the simulated providers.
//!
//! 1. Killed after the provider committed but before the outcome was recorded: the
//!    provider hangs after committing, the test kills the dispatcher as soon as the
//!    effect is visible; after restart the expired lease becomes `unknown_outcome` and
//!    the lookup finds the charge.
//! 2. Crashed after `dispatched` was persisted and before anything was sent
//!    (`OPGATE_CRASH_AT=after_claim`); after restart the lookup proves nothing happened
//!    and the operation is re-dispatched once.

#![allow(missing_docs)]

mod support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opgate_core::{Delivery, IngestItem, Limits, Proposal, Registry, Source, Status};
use opgate_sim::{FaultKind, FaultSpec, Sim, SimConfig};
use opgate_store::SharedLedger;
use serde_json::json;
use uuid::Uuid;

const TOOLS: &str = r#"
[worker]
lease_ms = 2500

[[tools]]
name = "charge"
side_effect_class = "irreversible"
key = "charge:{entity}:{args.amount}"
[tools.args]
amount = "money_minor"
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/payments"
timeout_ms = 1000
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${OPGATE_SIM_URL}/payments?idempotency_key={key}"
external_id_pointer = "/charge_id"

[[tools]]
name = "notify"
side_effect_class = "external_non_idempotent"
key = "notify:{entity}:{args.amount}"
[tools.args]
amount = "as_is"
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/emails"
timeout_ms = 1000
key_body_field = "client_reference"
lookup_url = "${OPGATE_SIM_URL}/emails?client_reference={key}"
lookup_grace = "1s"
"#;

struct Setup {
    dir: PathBuf,
    config: PathBuf,
    sim: Sim,
    sim_url: String,
    ledger: SharedLedger,
    registry: Registry,
}

async fn setup(sim_config: SimConfig) -> Setup {
    let dir = std::env::temp_dir().join(format!("opgate-crash-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = opgate_testkit::database_url(&dir).await;
    let config = dir.join("opgate.toml");
    std::fs::write(&config, format!("[database]\nurl = \"{url}\"\n{TOOLS}")).expect("config");
    opgate_store::migrate(&url).await.expect("migrate");
    let ledger = opgate_store::open(&url).await.expect("ledger");
    let sim = Sim::new(sim_config);
    let (addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("sim");
    Setup {
        dir,
        config,
        sim,
        sim_url: format!("http://{addr}"),
        ledger,
        registry: Registry::from_toml(TOOLS).expect("registry"),
    }
}

impl Setup {
    fn spawn(&self, crash_at: Option<&str>) -> support::Reaped {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_opgate"));
        cmd.args(["run", "--config"])
            .arg(&self.config)
            .args(["--roles", "dispatch,reconcile"])
            .env("OPGATE_SIM_URL", &self.sim_url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(self.dir.join(format!("opgate-{}.log", Uuid::now_v7())))
                    .expect("log"),
            ));
        if let Some(point) = crash_at {
            cmd.env("OPGATE_CRASH_AT", point);
        }
        support::Reaped::spawn(&mut cmd)
    }

    async fn propose(&self, tool: &str, entity: &str, amount: u64) -> Uuid {
        let value = json!({"event_id": Uuid::now_v7().to_string(), "tool": tool,
            "entity": {"type": "account", "id": entity}, "args": {"amount": amount}});
        let proposal = Proposal::from_value(value, &Limits::default()).expect("proposal");
        let item = IngestItem::from_proposal(
            &self.registry,
            &proposal,
            Delivery {
                principal: None,
                source: Source::Http,
                traceparent: None,
            },
        );
        self.ledger.ingest(&[item]).await.expect("ingest")[0]
            .operation
            .as_ref()
            .expect("op")
            .operation_id
    }

    async fn wait_status(&self, id: Uuid, want: Status, timeout: Duration) {
        let started = Instant::now();
        loop {
            let op = self
                .ledger
                .operation(id)
                .await
                .expect("read")
                .expect("exists");
            if op.status == want {
                return;
            }
            assert!(
                started.elapsed() < timeout,
                "operation {id} is {} after {timeout:?}, expected {want}; logs in {}",
                op.status,
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn kill9(child: &mut Child) {
    // SIGKILL: no destructor, no graceful shutdown, leases left as they are.
    child.kill().expect("kill -9");
    child.wait().expect("reap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_after_the_provider_committed_is_reconciled_without_a_second_effect() {
    let s = Arc::new(
        setup(SimConfig {
            hang: Duration::from_secs(30),
            ..SimConfig::default()
        })
        .await,
    );
    for provider in ["payments", "emails"] {
        s.sim.add_fault(FaultSpec {
            provider: provider.into(),
            match_prefix: None,
            fault: FaultKind::TimeoutAfterCommit,
            times: Some(1),
            probability: None,
        });
    }
    let charge = s.propose("charge", "a1", 10).await;
    let mut child = s.spawn(None);
    // Kill the dispatcher the moment the provider has committed (it is still waiting for
    // the answer: the provider hangs after committing).
    let started = Instant::now();
    while s.sim.effects().total < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the dispatcher never called the provider"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kill9(&mut child);
    assert_eq!(
        s.ledger
            .operation(charge)
            .await
            .expect("read")
            .expect("op")
            .status,
        Status::Dispatched,
        "killed before the outcome was recorded"
    );

    let notify = s.propose("notify", "a2", 10).await;
    let mut child = s.spawn(None);
    while s.sim.effects().total < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the email was never sent"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    kill9(&mut child);

    let mut child = s.spawn(None);
    s.wait_status(charge, Status::CompletedSuccess, Duration::from_secs(30))
        .await;
    s.wait_status(notify, Status::CompletedSuccess, Duration::from_secs(30))
        .await;
    kill9(&mut child);
    let report = s.sim.effects();
    assert_eq!(
        (report.total, report.duplicates),
        (2, 0),
        "one charge and one email, no duplicate"
    );
    let events = s.ledger.events(charge).await.expect("events");
    let reasons: Vec<_> = events.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons.contains(&"lease_expired") && reasons.contains(&"lookup_found"),
        "{reasons:?}"
    );
    let op = s.ledger.operation(charge).await.expect("read").expect("op");
    assert_eq!(op.attempt_count, 1, "resolved by lookup, never resent");
    assert!(op.external_object_id.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crashed_after_dispatched_was_persisted_is_redispatched_once() {
    let s = setup(SimConfig::default()).await;
    let charge = s.propose("charge", "b1", 10).await;
    let notify = s.propose("notify", "b2", 10).await;
    let mut crashing = s.spawn(Some("after_claim"));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = crashing.try_wait().expect("wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the crash point never fired"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!status.success(), "the crash point aborted the process");
    let claimed = [charge, notify];
    let mut dispatched = 0;
    for id in claimed {
        if s.ledger
            .operation(id)
            .await
            .expect("read")
            .expect("op")
            .status
            == Status::Dispatched
        {
            dispatched += 1;
        }
    }
    assert!(
        dispatched >= 1,
        "at least one operation was left dispatched by the crash"
    );
    assert_eq!(
        s.sim.effects().total,
        0,
        "nothing was sent before the crash"
    );

    let mut child = s.spawn(None);
    s.wait_status(charge, Status::CompletedSuccess, Duration::from_secs(30))
        .await;
    s.wait_status(notify, Status::CompletedSuccess, Duration::from_secs(30))
        .await;
    kill9(&mut child);
    let report = s.sim.effects();
    assert_eq!((report.total, report.duplicates), (2, 0));
}
