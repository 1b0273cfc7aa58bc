//! The dispatcher and reconciler against the simulated providers: every fault x every
//! side-effect class, retry budgets, Retry-After, and per-entity serialization. Runs on
//! SQLite (plain `cargo test`) and on PostgreSQL (`--features integration`).

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use opgate_core::{Delivery, IngestItem, Limits, Operation, Proposal, Registry, Source, Status};
use opgate_sim::{FaultKind, FaultSpec, Sim, SimConfig};
use opgate_store::SharedLedger;
use opgate_worker::{Adapters, Dispatcher, DispatcherConfig, Reconciler, ReconcilerConfig};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const TOOLS: &str = r#"
[[tools]]
name = "charge"
side_effect_class = "irreversible"
key = "charge:{entity}:{args.amount}"
[tools.args]
amount = "money_minor"
[tools.adapter]
kind = "http"
url = "${SIM}/payments"
timeout_ms = 300
idempotency_header = "Idempotency-Key"
provider_retention = "24h"
lookup_url = "${SIM}/payments?idempotency_key={key}"
external_id_pointer = "/charge_id"
[tools.retry]
max_attempts = 4
base_ms = 10
max_ms = 40

[[tools]]
name = "reserve"
side_effect_class = "external_idempotent"
key = "reserve:{entity}:{args.amount}"
[tools.args]
amount = "as_is"
[tools.adapter]
kind = "http"
url = "${SIM}/tickets"
timeout_ms = 300
key_body_field = "client_token"
provider_retention = "24h"
lookup_url = "${SIM}/tickets?client_token={key}"
external_id_pointer = "/ticket_id"
[tools.retry]
max_attempts = 4
base_ms = 10
max_ms = 40

[[tools]]
name = "notify"
side_effect_class = "external_non_idempotent"
key = "notify:{entity}:{args.amount}"
[tools.args]
amount = "as_is"
[tools.adapter]
kind = "http"
url = "${SIM}/emails"
timeout_ms = 300
key_body_field = "client_reference"
lookup_url = "${SIM}/emails?client_reference={key}"
lookup_grace = "1500ms"
external_id_pointer = "/message_id"
[tools.retry]
max_attempts = 4
base_ms = 10
max_ms = 40

[[tools]]
name = "peek"
side_effect_class = "read"
key = "peek:{entity}:{args.amount}"
[tools.args]
amount = "as_is"
[tools.adapter]
kind = "http"
url = "${SIM}/tickets"
timeout_ms = 300
key_body_field = "client_token"
[tools.retry]
max_attempts = 4
base_ms = 10
max_ms = 40

# Misconfigured: the email provider needs client_reference, so every call is a 400.
[[tools]]
name = "broken_notify"
side_effect_class = "external_non_idempotent"
[tools.adapter]
kind = "http"
url = "${SIM}/emails"
timeout_ms = 300
"#;

struct World {
    sim: Sim,
    ledger: SharedLedger,
    registry: Arc<Registry>,
    adapters: Adapters,
    dispatcher: Dispatcher,
    reconciler: Reconciler,
}

async fn world(sim_config: SimConfig) -> World {
    let sim = Sim::new(sim_config);
    let (addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("sim");
    let url = format!("http://{addr}");
    let registry = Arc::new(Registry::from_toml(TOOLS).expect("registry"));
    let adapters = Adapters::from_registry(&registry, |name| (name == "SIM").then(|| url.clone()))
        .expect("adapters");
    // Keep the fixture's pools alive with the world (a SQLite file or a PostgreSQL schema).
    let ledger = opgate_testkit::TestLedger::new().await.ledger;
    let dispatcher = Dispatcher::new(
        ledger.clone(),
        registry.clone(),
        adapters.clone(),
        DispatcherConfig {
            owner: "d1".into(),
            lease: Duration::from_secs(5),
            seed: Some(7),
            ..DispatcherConfig::default()
        },
    )
    .expect("dispatcher");
    let reconciler = Reconciler::new(
        ledger.clone(),
        registry.clone(),
        adapters.clone(),
        ReconcilerConfig {
            owner: "r1".into(),
            ..ReconcilerConfig::default()
        },
    );
    World {
        sim,
        ledger,
        registry,
        adapters,
        dispatcher,
        reconciler,
    }
}

impl World {
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
        let out = self.ledger.ingest(&[item]).await.expect("ingest");
        out[0].operation.as_ref().expect("accepted").operation_id
    }

    /// Dispatch and reconcile rounds until the operation settles.
    async fn settle(&self, id: Uuid, timeout: Duration) -> Operation {
        let started = Instant::now();
        loop {
            self.dispatcher.run_once(16).await.expect("dispatch round");
            self.reconciler.run_once().await.expect("reconcile round");
            let op = self
                .ledger
                .operation(id)
                .await
                .expect("read")
                .expect("exists");
            if op.status.is_terminal() || op.status == Status::NeedsAttention {
                return op;
            }
            assert!(
                started.elapsed() < timeout,
                "operation stuck in {} after {timeout:?}",
                op.status
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn effects_for(&self, key_fragment: &str) -> u64 {
        self.sim
            .effects()
            .effects
            .iter()
            .filter(|e| e.key.contains(key_fragment))
            .map(|e| e.count)
            .sum()
    }
}

fn sim_config() -> SimConfig {
    SimConfig {
        hang: Duration::from_millis(1500),
        propagation: Duration::from_millis(800),
        ..SimConfig::default()
    }
}

/// Expected (final status, attempts, effects) for a fault on a class.
fn expected(tool: &str, fault: FaultKind) -> (Status, u32, u64) {
    use FaultKind as F;
    let ok = Status::CompletedSuccess;
    match (tool, fault) {
        (_, F::SlowPropagation) => (ok, 1, 1),
        // No idempotency at the provider: ambiguity is resolved by lookup, never by resending.
        ("notify", F::TimeoutAfterCommit | F::ErrorCommitted | F::Malformed) => (ok, 1, 1),
        ("notify", F::TimeoutBeforeCommit | F::ErrorNotCommitted) => (ok, 2, 1),
        // The provider honours the key inside its retention (or it is a read): resend it.
        (_, _) => (ok, 2, 1),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_fault_on_every_class_ends_right_with_at_most_one_effect() {
    let w = Arc::new(world(sim_config()).await);
    let mut cells = tokio::task::JoinSet::new();
    for (t, tool) in ["charge", "reserve", "notify", "peek"]
        .into_iter()
        .enumerate()
    {
        for (f, fault) in FaultKind::ALL.into_iter().enumerate() {
            let w = w.clone();
            cells.spawn(async move {
                let entity = format!("cell-{t}-{f}");
                w.sim.add_fault(FaultSpec {
                    provider: match tool {
                        "charge" => "payments",
                        "notify" => "emails",
                        _ => "tickets",
                    }
                    .into(),
                    match_prefix: Some(format!("default/{tool}:{entity}:")),
                    fault,
                    times: Some(1),
                    probability: None,
                });
                let id = w.propose(tool, &entity, 100).await;
                let op = w.settle(id, Duration::from_secs(30)).await;
                let effects = w.effects_for(&format!("{tool}:{entity}:"));
                ((tool, fault), (op.status, op.attempt_count, effects))
            });
        }
    }
    let mut results = BTreeMap::new();
    while let Some(done) = cells.join_next().await {
        let ((tool, fault), got) = done.expect("cell");
        results.insert(format!("{tool} x {fault:?}"), (got, expected(tool, fault)));
    }
    let wrong: Vec<_> = results
        .iter()
        .filter(|(_, (got, want))| got != want)
        .collect();
    assert!(
        wrong.is_empty(),
        "(status, attempts, effects) got vs expected: {wrong:#?}"
    );
    assert_eq!(results.len(), 28);
    assert_eq!(
        w.sim.effects().duplicates,
        0,
        "no intended effect happened twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exhausted_budget_ends_the_loop_without_an_effect() {
    let w = world(sim_config()).await;
    w.sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: None,
        fault: FaultKind::ErrorNotCommitted,
        times: None,
        probability: None,
    });
    let id = w.propose("charge", "acct-1", 5).await;
    let op = w.settle(id, Duration::from_secs(30)).await;
    assert_eq!(
        op.status,
        Status::NeedsAttention,
        "the budget (4 attempts) ends in needs_attention"
    );
    assert_eq!(w.effects_for("charge:acct-1"), 0);
    let attempts = w.ledger.attempts(id).await.expect("attempts");
    let sent = attempts
        .iter()
        .filter(|a| a.report.as_ref().is_some_and(|r| r.outcome != "not_sent"))
        .count();
    assert_eq!(sent, 4, "exactly max_attempts calls: {attempts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rejection_is_permanent_after_one_attempt() {
    let w = world(sim_config()).await;
    let id = w.propose("broken_notify", "acct-1", 5).await;
    let op = w.settle(id, Duration::from_secs(10)).await;
    assert_eq!((op.status, op.attempt_count), (Status::FailedPermanent, 1));
    assert_eq!(
        op.error.as_ref().map(|e| e.category.as_str()),
        Some("rejected")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retry_after_is_honoured_on_the_database_clock() {
    let w = world(SimConfig {
        retry_after_secs: 1,
        ..sim_config()
    })
    .await;
    w.sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: None,
        fault: FaultKind::Throttle,
        times: Some(1),
        probability: None,
    });
    let id = w.propose("charge", "acct-1", 5).await;
    let op = w.settle(id, Duration::from_secs(10)).await;
    assert_eq!((op.status, op.attempt_count), (Status::CompletedSuccess, 2));
    let attempts = w.ledger.attempts(id).await.expect("attempts");
    let first_done = attempts[0].finished_at.expect("finished");
    let gap = attempts[1].started_at - first_done;
    assert!(
        gap >= time::Duration::seconds(1),
        "second attempt {gap} after the 429 with Retry-After: 1"
    );
    assert_eq!(op.error, None);
    let events = w.ledger.events(id).await.expect("events");
    assert!(
        events
            .iter()
            .any(|e| e.to == Status::FailedRetryable && e.reason == "throttled")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_entity_is_served_one_at_a_time_in_ingest_order_by_two_dispatchers() {
    let w = world(SimConfig {
        work: Duration::from_millis(5),
        ..sim_config()
    })
    .await;
    let mut hot = Vec::new();
    for n in 1..=50 {
        hot.push(w.propose("charge", "hot", n).await);
        w.propose("charge", &format!("cold-{n}"), n).await;
    }
    // A second dispatcher with its own lease owner, racing the first for the same work.
    let second = Dispatcher::new(
        w.ledger.clone(),
        w.registry.clone(),
        w.adapters.clone(),
        DispatcherConfig {
            owner: "d2".into(),
            lease: Duration::from_secs(5),
            seed: Some(8),
            ..DispatcherConfig::default()
        },
    )
    .expect("second dispatcher");
    let cancel = CancellationToken::new();
    let a = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let b = tokio::spawn(second.run(cancel.clone()));
    let started = Instant::now();
    loop {
        let done = w.sim.effects().total;
        if done == 100 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "only {done} of 100 effects"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    a.await.expect("a");
    b.await.expect("b");
    let report = w.sim.effects();
    assert_eq!(report.overlaps, 0, "no two calls on one entity overlapped");
    assert_eq!(report.duplicates, 0);
    let hot_order: Vec<u64> = report
        .log
        .iter()
        .filter(|e| e.entity.as_deref() == Some("account:hot"))
        .map(|e| {
            e.key
                .split(':')
                .nth(2)
                .and_then(|a| a.parse().ok())
                .unwrap_or(0)
        })
        .collect();
    let expected: Vec<u64> = (1..=50).map(|n| n * 100).collect();
    assert_eq!(
        hot_order, expected,
        "the hot entity's charges ran in ingest order"
    );
    let first_hot = report
        .log
        .iter()
        .position(|e| e.entity.as_deref() == Some("account:hot"))
        .expect("hot");
    let last_hot = report
        .log
        .iter()
        .rposition(|e| e.entity.as_deref() == Some("account:hot"))
        .expect("hot");
    let cold_between = report.log[first_hot..last_hot]
        .iter()
        .filter(|e| e.entity.as_deref() != Some("account:hot"))
        .count();
    assert!(
        cold_between > 0,
        "other entities proceeded while the hot one was serialized"
    );
    for id in hot {
        let op = w.ledger.operation(id).await.expect("read").expect("exists");
        assert_eq!((op.status, op.attempt_count), (Status::CompletedSuccess, 1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_records_every_call_in_flight() {
    // Each call takes 200 ms at the provider (the timeout is 300 ms); cancel while in flight.
    let w = world(SimConfig {
        work: Duration::from_millis(200),
        ..sim_config()
    })
    .await;
    let mut ids = Vec::new();
    for n in 1..=5 {
        ids.push(w.propose("charge", &format!("acct-{n}"), n).await);
    }
    let cancel = CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let started = Instant::now();
    while w
        .ledger
        .list(&opgate_store::ListFilter {
            status: Some(Status::Dispatched),
            ..Default::default()
        })
        .await
        .expect("list")
        .operations
        .len()
        < 5
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "calls never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    running.await.expect("dispatcher stopped");
    for id in ids {
        let op = w.ledger.operation(id).await.expect("read").expect("exists");
        assert_eq!(
            op.status,
            Status::CompletedSuccess,
            "shutdown waited for the call and recorded it"
        );
        assert!(op.lease_owner.is_none());
    }
    assert_eq!(w.sim.effects().total, 5);
}
