//! `opgate dev --demo`: a scripted agent fleet that reproduces the incidents from the
//! field against a running `opgate dev`, then a seeded load run, and a final table.
//!
//! The fleet is an outside client: it publishes proposals to `opgate.proposals` on the
//! embedded broker (and some through `POST /v1/proposals`), reads every answer from
//! `opgate.results`, and asks the simulated providers what really happened. The table
//! therefore reports what agents and providers saw, not what opgate believes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use opgate_core::Status;
use opgate_kafka::config::{DLQ, PROPOSALS, RESULTS};
use opgate_sim::{FaultKind, FaultSpec, Sim};
use opgate_store::{ListFilter, SharedLedger};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::observe::Observer;
use crate::progress::Progress;
use crate::workload::{self, Kind};

/// Options of the demo fleet.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Proposals in the load run after the scripted incidents (0 skips it).
    #[arg(long, default_value_t = 200)]
    pub ops: usize,
    /// Share of provider calls in the load run that misbehave (0.0 to 1.0), spread over
    /// every fault kind the simulated providers know.
    #[arg(long, default_value_t = 0.05)]
    pub faults: f64,
    /// Seed of the load run (proposal mix, duplicates, faults).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Give up waiting for every proposal to settle after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_secs: u64,
}

/// What the demo talks to.
pub struct Target {
    /// Kafka bootstrap servers of the embedded broker.
    pub bootstrap: String,
    /// Admin API base URL.
    pub api: String,
    /// An operator token for the API.
    pub operator_token: String,
    /// The simulated providers (in process).
    pub sim: Sim,
    /// The ledger, for the history counts in the table.
    pub ledger: SharedLedger,
}

/// One scripted incident: what was sent and what must hold afterwards.
struct Incident {
    title: &'static str,
    expect: &'static str,
    check: Check,
}

/// An incident's check: `None` when it held, else what was seen instead.
type Check = Box<dyn Fn(&Report) -> Option<String> + Send + Sync>;

/// What a check can look at.
struct Report {
    /// Effects per scoped key at the providers.
    effects: HashMap<String, u64>,
    /// Final status per event id (through its operation).
    status_of_event: HashMap<String, String>,
    /// Operation id per event id.
    operation_of_event: HashMap<String, String>,
}

impl Report {
    fn effects_with_prefix(&self, prefix: &str) -> u64 {
        self.effects
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, c)| c)
            .sum()
    }

    fn status(&self, event_id: &str) -> &str {
        self.status_of_event
            .get(event_id)
            .map_or("unanswered", String::as_str)
    }
}

/// The fleet: a producer, an HTTP client and a results reader.
struct Fleet {
    producer: FutureProducer,
    http: reqwest::Client,
    target: Target,
    observed: Observer,
    /// Event ids sent (distinct) and the number of sends (with redeliveries).
    sent: HashSet<String>,
    sends: u64,
    http_sends: u64,
    poison: u64,
}

/// The demo's totals, printed as the final table.
#[derive(Debug, Default)]
pub struct Summary {
    proposals_sent: u64,
    distinct_events: u64,
    http_proposals: u64,
    answered: u64,
    accepted: u64,
    deduplicated: BTreeMap<String, u64>,
    rejected: BTreeMap<String, u64>,
    dlq: BTreeMap<String, u64>,
    operations: u64,
    dispatched: u64,
    attempts: u64,
    retried: u64,
    unknown: u64,
    reconciled: u64,
    needs_attention: u64,
    final_status: BTreeMap<String, u64>,
    effects: u64,
    duplicate_effects: u64,
    overlaps: u64,
    incidents: Vec<(String, String, Option<String>)>,
    unsettled: u64,
    elapsed: Duration,
}

impl Summary {
    /// Whether the run met its promises: every proposal answered and settled, no
    /// duplicate effect, no overlapping writes on an entity, every incident as expected.
    pub fn ok(&self) -> bool {
        self.answered == self.distinct_events
            && self.unsettled == 0
            && self.duplicate_effects == 0
            && self.overlaps == 0
            && self
                .incidents
                .iter()
                .all(|(_, _, failure)| failure.is_none())
    }
}

/// Runs the scripted incidents and the load run, waits for every answer, and returns the
/// totals.
pub async fn run(target: Target, args: &DemoArgs) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.timeout_secs);
    let mut fleet = Fleet::new(target)?;
    let cancel = CancellationToken::new();
    let reader = fleet.spawn_reader(cancel.clone())?;

    say("scripted incidents from the field");
    let incidents = fleet.incidents().await?;
    fleet.settle("incidents", deadline).await?;
    let multi_step = fleet.compensate_failed_flow().await?;
    fleet.settle("compensation", deadline).await?;

    if args.ops > 0 {
        say(&format!(
            "load run: {} proposals, {:.0}% provider faults, seed {}",
            args.ops,
            args.faults * 100.0,
            args.seed
        ));
        fleet.load(args).await?;
        fleet.settle("load", deadline).await?;
    }
    let report = fleet.report();
    let mut summary = fleet.summary().await?;
    for incident in incidents.iter().chain(std::iter::once(&multi_step)) {
        summary.incidents.push((
            incident.title.to_owned(),
            incident.expect.to_owned(),
            (incident.check)(&report),
        ));
    }
    summary.elapsed = started.elapsed();
    cancel.cancel();
    let _ = reader.await;
    Ok(summary)
}

fn say(line: &str) {
    println!("\n== {line}");
}

fn proposal(
    event_id: &str,
    namespace: &str,
    agent: &str,
    tool: &str,
    entity: (&str, &str),
    args: Value,
) -> Value {
    json!({"event_id": event_id, "namespace": namespace, "agent_id": agent, "tool": tool,
        "entity": {"type": entity.0, "id": entity.1}, "args": args})
}

impl Fleet {
    fn new(target: Target) -> anyhow::Result<Self> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &target.bootstrap)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .create()
            .context("creating the demo fleet's producer")?;
        Ok(Self {
            producer,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()?,
            target,
            observed: Observer::default(),
            sent: HashSet::new(),
            sends: 0,
            http_sends: 0,
            poison: 0,
        })
    }

    /// Reads `opgate.results` and `opgate.dlq` from the beginning until cancelled.
    fn spawn_reader(
        &self,
        cancel: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let mut client = ClientConfig::new();
        client.set("bootstrap.servers", &self.target.bootstrap);
        self.observed.spawn_reader(client, RESULTS, DLQ, cancel)
    }

    /// Publishes a proposal to `opgate.proposals`, keyed by its entity.
    async fn send(&mut self, proposal: &Value) -> anyhow::Result<()> {
        let key = format!(
            "{}:{}",
            proposal["entity"]["type"].as_str().unwrap_or_default(),
            proposal["entity"]["id"].as_str().unwrap_or_default()
        );
        let payload = serde_json::to_vec(proposal)?;
        self.producer
            .send(
                FutureRecord::to(PROPOSALS).key(&key).payload(&payload),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| anyhow::anyhow!("publishing a proposal: {e}"))?;
        if let Some(id) = proposal["event_id"].as_str() {
            self.sent.insert(id.to_owned());
        }
        self.sends += 1;
        Ok(())
    }

    /// Publishes bytes that are not a proposal (they must land in the DLQ).
    async fn send_poison(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.producer
            .send(
                FutureRecord::to(PROPOSALS).key("poison").payload(bytes),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| anyhow::anyhow!("publishing a poison record: {e}"))?;
        self.poison += 1;
        Ok(())
    }

    /// Posts a proposal to the admin API (an agent without a Kafka client).
    async fn post(&mut self, proposal: &Value) -> anyhow::Result<Value> {
        let response = self
            .http
            .post(format!("{}/v1/proposals", self.target.api))
            .bearer_auth(&self.target.operator_token)
            .json(proposal)
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        anyhow::ensure!(
            status.is_success(),
            "POST /v1/proposals answered {status}: {body}"
        );
        if let Some(id) = proposal["event_id"].as_str() {
            self.sent.insert(id.to_owned());
        }
        self.sends += 1;
        self.http_sends += 1;
        Ok(body)
    }

    fn fault(&self, provider: &str, prefix: &str, fault: FaultKind, times: u32) {
        self.target.sim.add_fault(FaultSpec {
            provider: provider.into(),
            match_prefix: Some(prefix.into()),
            fault,
            times: Some(times),
            probability: None,
        });
    }

    /// The incidents, each sent and paired with its check.
    async fn incidents(&mut self) -> anyhow::Result<Vec<Incident>> {
        let mut incidents = Vec::new();

        // 1. A payment call times out after the provider committed the charge.
        self.fault(
            "payments",
            "demo/payment:order_1001:",
            FaultKind::TimeoutAfterCommit,
            1,
        );
        self.send(&proposal(
            "inc1-evt",
            "demo",
            "checkout-bot",
            "capture_payment",
            ("order", "order_1001"),
            json!({"amount": "49.00", "currency": "usd"}),
        ))
        .await?;
        incidents.push(Incident {
            title: "payment timed out after the provider committed",
            expect: "1 charge (resent under the same key, which the provider honours)",
            check: Box::new(|r| {
                expect_effects(r, "demo/payment:order_1001:", 1)
                    .or_else(|| expect_status(r, "inc1-evt", "completed_success"))
            }),
        });

        // 2. A user asks three times across channels: chat and email agents over Kafka,
        // a voice agent over HTTP; the amount and currency are spelled three ways.
        self.send(&proposal(
            "inc2-chat",
            "demo",
            "chat-bot",
            "capture_payment",
            ("order", "order_1002"),
            json!({"amount": "19.90", "currency": "USD"}),
        ))
        .await?;
        self.send(&proposal(
            "inc2-email",
            "demo",
            "email-bot",
            "capture_payment",
            ("order", "order_1002"),
            json!({"amount": 19.9, "currency": " usd"}),
        ))
        .await?;
        self.post(&proposal(
            "inc2-voice",
            "demo",
            "voice-bot",
            "capture_payment",
            ("order", "order_1002"),
            json!({"amount": "19.9", "currency": "usd"}),
        ))
        .await?;
        incidents.push(Incident {
            title: "a user asked three times across channels (Kafka x2, HTTP)",
            expect: "1 operation, 2 key dedupes, 1 charge",
            check: Box::new(|r| {
                expect_effects(r, "demo/payment:order_1002:", 1).or_else(|| {
                    let ops: HashSet<_> = ["inc2-chat", "inc2-email", "inc2-voice"]
                        .iter()
                        .filter_map(|e| r.operation_of_event.get(*e))
                        .collect();
                    (ops.len() != 1).then(|| format!("{} operations", ops.len()))
                })
            }),
        });

        // 3. An email provider without idempotency, under retries: the first send hangs
        // before committing, a second user's send hangs after committing, and the agent
        // retries both proposals itself. Then another agent re-runs the whole onboarding
        // workflow for the first user: a new workflow, the same welcome email.
        self.fault(
            "emails",
            "demo/send_email:wf:onboard-user_2001:",
            FaultKind::TimeoutBeforeCommit,
            1,
        );
        self.fault(
            "emails",
            "demo/send_email:wf:onboard-user_2002:",
            FaultKind::TimeoutAfterCommit,
            1,
        );
        let welcome = |event: String, user: &str, workflow: String| {
            let mut p = proposal(
                &event,
                "demo",
                "onboarding-bot",
                "send_email",
                ("user", user),
                json!({"to": format!(" {user}@Example.com"), "template": "Welcome"}),
            );
            p["workflow_id"] = json!(workflow);
            p["step"] = json!(1);
            p
        };
        for user in ["user_2001", "user_2002"] {
            for retry in 0..2 {
                self.send(&welcome(
                    format!("inc3-{user}-{retry}"),
                    user,
                    format!("onboard-{user}"),
                ))
                .await?;
            }
        }
        self.send(&welcome(
            "inc3-rerun".into(),
            "user_2001",
            "onboard-user_2001-rerun".into(),
        ))
        .await?;
        incidents.push(Incident {
            title: "email provider without idempotency, under retries and a re-run",
            expect: "1 email per user (key dedupe, then dedupe window)",
            check: Box::new(|r| {
                expect_effects(r, "demo/send_email:wf:onboard-user_2001", 1)
                    .or_else(|| expect_effects(r, "demo/send_email:wf:onboard-user_2002", 1))
            }),
        });

        // 4. An agent re-plans and mints a fresh order id on its retry.
        for (n, minted) in ["ord-7f1", "ord-93c"].iter().enumerate() {
            self.send(&proposal(
                &format!("inc4-{n}"),
                "demo",
                "shopping-bot",
                "place_order",
                ("cart", "cart_3001"),
                json!({"sku": "sku-42", "quantity": 2, "client_order_id": minted}),
            ))
            .await?;
        }
        incidents.push(Incident {
            title: "an agent re-planned and minted a fresh order id",
            expect: "1 order (the key is the business identity)",
            check: Box::new(|r| expect_effects(r, "demo/order:cart_3001:", 1)),
        });

        // 5. Two agents race a refund and an account credit on one account.
        self.send(&proposal(
            "inc5-refund",
            "demo",
            "billing-bot",
            "issue_refund",
            ("account", "acct_4001"),
            json!({"amount": "25.00", "currency": "eur"}),
        ))
        .await?;
        self.post(&proposal(
            "inc5-credit",
            "demo",
            "support-bot",
            "credit_account",
            ("account", "acct_4001"),
            json!({"amount": "25.00", "currency": "eur"}),
        ))
        .await?;
        incidents.push(Incident {
            title: "two agents raced a refund and an account credit",
            expect: "1 make-good (exclusive group), never overlapping",
            check: Box::new(|r| {
                let both = r.effects_with_prefix("demo/refund:acct_4001:")
                    + r.effects_with_prefix("demo/credit:acct_4001:");
                (both != 1).then(|| format!("{both} make-goods"))
            }),
        });

        // 6. A multi-step flow whose last step fails: ticket, payment, then the order
        // system refuses the order until the step's retry budget is spent.
        self.fault(
            "orders",
            "demo/order:cart_5001:",
            FaultKind::ErrorNotCommitted,
            1_000,
        );
        let steps = [
            (
                "create_ticket",
                ("customer", "cust_5001"),
                json!({"subject": "order for cust_5001"}),
            ),
            (
                "capture_payment",
                ("order", "order_5001"),
                json!({"amount": "120.00", "currency": "usd"}),
            ),
            (
                "place_order",
                ("cart", "cart_5001"),
                json!({"sku": "sku-7", "quantity": 1}),
            ),
        ];
        for (n, (tool, entity, args)) in steps.into_iter().enumerate() {
            let mut p = proposal(
                &format!("inc6-step{}", n + 1),
                "demo",
                "workflow-bot",
                tool,
                entity,
                args,
            );
            p["workflow_id"] = json!("wf-5001");
            p["run_id"] = json!("run-1");
            p["step"] = json!(n + 1);
            self.send(&p).await?;
        }

        // 7. Messages that are not proposals.
        self.send_poison(b"{not json").await?;
        self.send_poison(br#"{"event_id": "inc7", "tool": "launch_rockets", "entity": {"type": "x", "id": "1"}, "args": {}}"#).await?;
        incidents.push(Incident {
            title: "a malformed record and an unknown tool",
            expect: "2 DLQ records, 1 rejected answer; the partition moves on",
            check: Box::new(|r| expect_status(r, "inc7", "rejected")),
        });
        Ok(incidents)
    }

    /// Once the multi-step flow's last step has failed, the coordinator compensates the
    /// payment of step 2 through the admin API (a refund operation).
    async fn compensate_failed_flow(&mut self) -> anyhow::Result<Incident> {
        let payment = self.operation_of("inc6-step2")?;
        let response = self
            .http
            .post(format!(
                "{}/v1/operations/{payment}/compensate",
                self.target.api
            ))
            .bearer_auth(&self.target.operator_token)
            .json(&json!({"reason": "step 3 (place_order) failed permanently"}))
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        anyhow::ensure!(status.is_success(), "compensate answered {status}: {body}");
        if let Some(id) = body["compensation"]["event_id"].as_str() {
            self.sent.insert(id.to_owned());
        }
        Ok(Incident {
            title: "a multi-step flow whose last step failed",
            expect: "step 3 failed, step 2 refunded (compensated)",
            check: Box::new(|r| {
                expect_status(r, "inc6-step3", "failed_permanent")
                    .or_else(|| expect_status(r, "inc6-step2", "compensated"))
                    .or_else(|| expect_effects(r, "demo/refund:order_5001:", 1))
            }),
        })
    }

    fn operation_of(&self, event_id: &str) -> anyhow::Result<String> {
        let seen = self.observed.lock();
        seen.answers
            .get(event_id)
            .and_then(|a| a.operation_id.clone())
            .with_context(|| format!("no operation answered event {event_id}"))
    }

    /// The load run: the eval's labelled workload ([`workload::generate`]: every tool,
    /// redeliveries, re-spelled and re-planned duplicates, near-duplicates, poison) with
    /// probabilistic provider faults, published without waiting for each ack.
    async fn load(&mut self, args: &DemoArgs) -> anyhow::Result<()> {
        if args.faults > 0.0 {
            // Each fault kind fires with an equal share; together they hit about
            // `faults` of the calls.
            let share = (args.faults / FaultKind::ALL.len() as f64).clamp(0.0, 1.0);
            for provider in opgate_sim::PROVIDERS {
                for fault in FaultKind::ALL {
                    self.target.sim.add_fault(FaultSpec {
                        provider: provider.into(),
                        match_prefix: Some(format!("{}/", workload::NAMESPACE)),
                        fault,
                        times: None,
                        probability: Some(share),
                    });
                }
            }
        }
        let load = workload::generate(args.ops, args.seed);
        let progress = Progress::new();
        let mut pending = Vec::with_capacity(load.records.len());
        for (i, record) in load.records.iter().enumerate() {
            let delivery = self
                .producer
                .send_result(
                    FutureRecord::to(PROPOSALS)
                        .key(&record.key)
                        .payload(&record.value),
                )
                .map_err(|(e, _)| anyhow::anyhow!("publishing a proposal: {e}"))?;
            pending.push(delivery);
            if record.kind == Kind::Poison {
                self.poison += 1;
            } else {
                self.sends += 1;
            }
            if let Some(event) = &record.event_id {
                self.sent.insert(event.clone());
            }
            if i % 500 == 0 {
                progress.line(&format!("load: published {}/{}", i + 1, load.records.len()));
            }
        }
        for delivery in pending {
            delivery
                .await
                .context("the producer stopped")?
                .map_err(|(e, _)| anyhow::anyhow!("publishing a proposal: {e}"))?;
        }
        progress.done();
        Ok(())
    }

    /// Waits until every sent event is answered and every answered operation's latest
    /// result is settled (terminal, or waiting for a person).
    async fn settle(&mut self, phase: &str, deadline: Instant) -> anyhow::Result<()> {
        self.producer.flush(Duration::from_secs(10))?;
        let progress = Progress::new();
        loop {
            let (answered, settled, operations, messages, dlq) = {
                let seen = self.observed.lock();
                let answered = self
                    .sent
                    .iter()
                    .filter(|e| seen.answers.contains_key(*e))
                    .count();
                let settled = seen.latest.len() - seen.unsettled();
                let dlq: u64 = seen.dlq.values().sum();
                (answered, settled, seen.latest.len(), seen.messages, dlq)
            };
            let effects = self.target.sim.effects();
            progress.line(&format!(
                "{phase}: answered {answered}/{} · settled {settled}/{operations} operations · {messages} results · {dlq} dlq · {} effects, {} duplicate",
                self.sent.len(),
                effects.total,
                effects.duplicates
            ));
            if answered == self.sent.len() && settled == operations && dlq >= self.poison {
                progress.done();
                return Ok(());
            }
            if Instant::now() >= deadline {
                progress.done();
                println!("gave up waiting (--timeout-secs)");
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn report(&self) -> Report {
        let seen = self.observed.lock();
        let mut effects = HashMap::new();
        for e in self.target.sim.effects().effects {
            *effects.entry(e.key).or_default() += e.count;
        }
        let mut status_of_event = HashMap::new();
        let mut operation_of_event = HashMap::new();
        for (event, answer) in &seen.answers {
            let status = match &answer.operation_id {
                Some(op) => {
                    operation_of_event.insert(event.clone(), op.clone());
                    seen.latest
                        .get(op)
                        .map_or(answer.status.clone(), |l| l.status.clone())
                }
                None => answer.status.clone(),
            };
            status_of_event.insert(event.clone(), status);
        }
        Report {
            effects,
            status_of_event,
            operation_of_event,
        }
    }

    /// Totals from the fleet's own view, the ledger's histories and the providers.
    async fn summary(&self) -> anyhow::Result<Summary> {
        let mut s = Summary {
            proposals_sent: self.sends + self.poison,
            distinct_events: self.sent.len() as u64,
            http_proposals: self.http_sends,
            ..Summary::default()
        };
        {
            let seen = self.observed.lock();
            for event in &self.sent {
                let Some(answer) = seen.answers.get(event) else {
                    continue;
                };
                s.answered += 1;
                match (answer.status.as_str(), &answer.dedupe_reason) {
                    (_, Some(reason)) => *s.deduplicated.entry(reason.clone()).or_default() += 1,
                    ("rejected", None) => {
                        *s.rejected.entry("at ingest".into()).or_default() += 1;
                    }
                    _ => s.accepted += 1,
                }
            }
            s.unsettled = seen.unsettled() as u64;
            s.dlq = seen.dlq.clone();
        }
        // A redelivered event gets no new answer (it was answered once), so this count is
        // opgate's own: the ingest path's inbox hits in this process.
        let inbox_hits = opgate_metrics::metrics()
            .dedupe_hits
            .with_label_values(&["inbox"])
            .get();
        if inbox_hits > 0 {
            s.deduplicated
                .insert("inbox (redelivered event)".into(), inbox_hits);
        }
        // The ledger's view: every operation's history.
        for namespace in ["demo", workload::NAMESPACE] {
            let mut cursor = None;
            loop {
                let page = self
                    .target
                    .ledger
                    .list(&ListFilter {
                        namespace: Some(namespace.into()),
                        limit: Some(500),
                        cursor,
                        ..ListFilter::default()
                    })
                    .await?;
                for op in &page.operations {
                    s.operations += 1;
                    s.attempts += u64::from(op.attempt_count);
                    *s.final_status
                        .entry(op.status.as_str().to_owned())
                        .or_default() += 1;
                    let events = self.target.ledger.events(op.operation_id).await?;
                    let entered = |st: Status| events.iter().any(|e| e.to == st);
                    if entered(Status::Dispatched) {
                        s.dispatched += 1;
                    }
                    s.retried += events
                        .iter()
                        .filter(|e| e.to == Status::FailedRetryable)
                        .count() as u64;
                    if entered(Status::UnknownOutcome) {
                        s.unknown += 1;
                        if op.status != Status::UnknownOutcome
                            && op.status != Status::NeedsAttention
                        {
                            s.reconciled += 1;
                        }
                    }
                    if op.status == Status::NeedsAttention {
                        s.needs_attention += 1;
                    }
                }
                match page.next_cursor {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
            }
        }
        let effects = self.target.sim.effects();
        s.effects = effects.total;
        s.duplicate_effects = effects.duplicates;
        s.overlaps = effects.overlaps;
        Ok(s)
    }
}

fn expect_effects(r: &Report, prefix: &str, want: u64) -> Option<String> {
    let got = r.effects_with_prefix(prefix);
    (got != want).then(|| format!("{got} effects for {prefix}*, expected {want}"))
}

fn expect_status(r: &Report, event: &str, want: &str) -> Option<String> {
    let got = r.status(event);
    (got != want).then(|| format!("{event} ended {got}, expected {want}"))
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, value: String| {
            writeln!(f, "  {name:<44} {value:>10}")
        };
        writeln!(f, "\n== incidents")?;
        for (title, expect, failure) in &self.incidents {
            match failure {
                None => writeln!(f, "  ok    {title}: {expect}")?,
                Some(why) => writeln!(f, "  FAIL  {title}: expected {expect}; {why}")?,
            }
        }
        writeln!(f, "\n== totals ({:.1}s)", self.elapsed.as_secs_f64())?;
        row(f, "proposals published", self.proposals_sent.to_string())?;
        row(
            f,
            "  through HTTP (POST /v1/proposals)",
            self.http_proposals.to_string(),
        )?;
        row(f, "  distinct events", self.distinct_events.to_string())?;
        row(f, "  answered on opgate.results", self.answered.to_string())?;
        row(f, "accepted (new operations)", self.accepted.to_string())?;
        for (reason, n) in &self.deduplicated {
            row(f, &format!("deduplicated: {reason}"), n.to_string())?;
        }
        for (reason, n) in &self.rejected {
            row(f, &format!("rejected {reason}"), n.to_string())?;
        }
        for (reason, n) in &self.dlq {
            row(f, &format!("dead-lettered: {reason}"), n.to_string())?;
        }
        row(f, "operations in the ledger", self.operations.to_string())?;
        row(f, "dispatched", self.dispatched.to_string())?;
        row(f, "attempts", self.attempts.to_string())?;
        row(f, "retried (failed_retryable)", self.retried.to_string())?;
        row(
            f,
            "unknown -> reconciled",
            format!("{} -> {}", self.unknown, self.reconciled),
        )?;
        row(f, "needs_attention", self.needs_attention.to_string())?;
        for (status, n) in &self.final_status {
            row(f, &format!("  final: {status}"), n.to_string())?;
        }
        row(f, "effects seen by the providers", self.effects.to_string())?;
        row(f, "duplicate effects", self.duplicate_effects.to_string())?;
        row(
            f,
            "overlapping writes on one entity",
            self.overlaps.to_string(),
        )?;
        row(f, "unsettled operations", self.unsettled.to_string())?;
        Ok(())
    }
}

/// Fails unless every expectation held (used for the exit status).
pub fn verdict(summary: &Summary) -> anyhow::Result<()> {
    if summary.ok() {
        println!("\nall proposals answered, 0 duplicate effects");
        Ok(())
    } else {
        bail!("the demo's expectations did not hold (see the table)")
    }
}
