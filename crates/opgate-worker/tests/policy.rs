//! The dispatch policy end to end (issue 9, items 3-5): the real dispatcher, reconciler
//! and ledger (SQLite; PostgreSQL with `--features integration`) against a scripted
//! in-process provider that counts effects exactly.

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use opgate_core::outcome::AdapterOutcome;
use opgate_core::{
    Delivery, Event, IngestItem, Limits, Operation, Proposal, Registry, Source, Status,
};
use opgate_store::{ClaimRequest, Command, Handoff as _, SharedLedger};
use opgate_testkit::provider::{ScriptedProvider, Step};
use opgate_worker::{Adapters, Dispatcher, DispatcherConfig, Leased, Reconciler, ReconcilerConfig};
use serde_json::json;
use tokio::time::Instant;
use uuid::Uuid;

const TOOLS: &str = r#"
[[tools]]
name = "charge"
side_effect_class = "irreversible"
key = "charge:{entity}:{args.amount}"
[tools.args]
amount = "as_is"
[tools.adapter]
kind = "http"
url = "http://unused"
timeout_ms = 300
idempotency_header = "Idempotency-Key"
provider_retention = "2s"
lookup_grace = "200ms"
[tools.retry]
max_attempts = 4
base_ms = 10
max_ms = 20
"#;

struct World {
    ledger: SharedLedger,
    registry: Arc<Registry>,
    provider: Arc<ScriptedProvider>,
    dispatcher: Dispatcher,
    reconciler: Reconciler,
    _db: opgate_testkit::TestLedger,
}

async fn world(per_tool: usize) -> World {
    world_with(per_tool, per_tool).await
}

/// A world whose dispatcher claims up to `prefetch` operations per tool ahead of a free
/// permit.
async fn world_with(per_tool: usize, prefetch: usize) -> World {
    let db = opgate_testkit::TestLedger::new().await;
    let ledger = db.ledger.clone();
    let registry = Arc::new(Registry::from_toml(TOOLS).expect("registry"));
    let provider = Arc::new(ScriptedProvider::new(true));
    let mut adapters = Adapters::default();
    adapters.insert("charge", provider.clone());
    let dispatcher = Dispatcher::new(
        ledger.clone(),
        registry.clone(),
        adapters.clone(),
        DispatcherConfig {
            owner: "d1".into(),
            lease: Duration::from_secs(2),
            per_tool,
            prefetch,
            seed: Some(1),
            idle: Duration::from_millis(10),
            ..DispatcherConfig::default()
        },
    )
    .expect("dispatcher");
    let reconciler = Reconciler::new(
        ledger.clone(),
        registry.clone(),
        adapters,
        ReconcilerConfig {
            owner: "r1".into(),
            ..ReconcilerConfig::default()
        },
    );
    World {
        ledger,
        registry,
        provider,
        dispatcher,
        reconciler,
        _db: db,
    }
}

impl World {
    async fn propose(&self, entity: &str, amount: u64) -> Uuid {
        let value = json!({"event_id": Uuid::now_v7().to_string(), "tool": "charge",
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

    async fn op(&self, id: Uuid) -> Operation {
        self.ledger
            .operation(id)
            .await
            .expect("read")
            .expect("exists")
    }

    fn key(&self, op: &Operation) -> String {
        opgate_core::key::scoped_key(&op.namespace, &op.idempotency_key)
    }
}

/// Item 3: attempt 1 times out after the provider committed; attempt 2 hears "key in
/// use" (409) while attempt 1 still runs there. The operation must not end
/// `failed_permanent` with an effect standing: it goes to the reconciler, which finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_4xx_after_a_timeout_after_commit_is_reconciled_not_failed() {
    let w = world(16).await;
    w.provider.script([
        Step::new(true, AdapterOutcome::SentNoAnswer),
        Step::new(false, AdapterOutcome::Rejected { status: Some(409) }),
    ]);
    let id = w.propose("a1", 5).await;
    w.dispatcher.run_once(8).await.expect("attempt 1");
    let op = w.op(id).await;
    assert_eq!(
        op.status,
        Status::FailedRetryable,
        "resend is safe: same key, inside retention"
    );
    assert!(op.ambiguous_since.is_some(), "the ambiguity is remembered");
    tokio::time::sleep(Duration::from_millis(50)).await;
    w.dispatcher.run_once(8).await.expect("attempt 2");
    let op = w.op(id).await;
    assert_eq!(
        op.status,
        Status::UnknownOutcome,
        "a 409 after an ambiguous attempt is not a failure"
    );
    w.reconciler.run_once().await.expect("reconcile");
    let op = w.op(id).await;
    assert_eq!(op.status, Status::CompletedSuccess);
    assert_eq!(w.provider.effects(&w.key(&op)), 1);
}

/// Item 3, the give-up path: an ambiguous attempt, then the provider cannot be reached
/// until the budget is spent. Ends unknown -> looked up, never failed while the effect
/// exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_sent_until_the_budget_is_spent_after_an_ambiguous_attempt_is_not_a_failure() {
    let w = world(16).await;
    w.provider
        .script([Step::new(true, AdapterOutcome::SentNoAnswer)]);
    w.provider
        .script((0..10).map(|_| Step::new(false, AdapterOutcome::NotSent)));
    let id = w.propose("a2", 5).await;
    for _ in 0..10 {
        w.dispatcher.run_once(8).await.expect("dispatch");
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let op = w.op(id).await;
    assert_eq!(op.status, Status::UnknownOutcome, "{:?}", op.error);
    w.reconciler.run_once().await.expect("reconcile");
    assert_eq!(w.op(id).await.status, Status::CompletedSuccess);
}

/// Item 3, a person's side: an operation that may have taken effect cannot be cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ambiguous_operation_cannot_be_cancelled() {
    let w = world(16).await;
    w.provider
        .script([Step::new(true, AdapterOutcome::SentNoAnswer)]);
    let id = w.propose("a3", 5).await;
    w.dispatcher.run_once(8).await.expect("attempt 1");
    assert_eq!(w.op(id).await.status, Status::FailedRetryable);
    let refused = w
        .ledger
        .apply(&Command {
            operation_id: id,
            event: Event::Cancel,
            actor: "ops".into(),
            reason: "changed my mind".into(),
            result: None,
        })
        .await;
    assert!(
        matches!(&refused, Err(opgate_store::Error::Conflict(m)) if m.contains("may have taken effect")),
        "{refused:?}"
    );
    assert_eq!(w.op(id).await.status, Status::FailedRetryable);
}

/// Item 4: the resend window counts from the first ambiguous attempt and is checked when
/// the resend would be sent. After an outage longer than the provider's retention (2 s
/// here) nothing is resent: the operation is looked up instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resend_after_the_providers_retention_is_never_sent() {
    let w = world(16).await;
    w.provider
        .script([Step::new(false, AdapterOutcome::SentNoAnswer)]);
    let id = w.propose("a4", 5).await;
    w.dispatcher.run_once(8).await.expect("attempt 1");
    assert_eq!(w.op(id).await.status, Status::FailedRetryable);
    // The dispatchers were down past the retention.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    w.dispatcher.run_once(8).await.expect("after the outage");
    let op = w.op(id).await;
    assert_eq!(op.status, Status::UnknownOutcome);
    assert_eq!(
        op.error.as_ref().map(|e| e.category.as_str()),
        Some("resend_window_passed")
    );
    assert_eq!(w.provider.calls(), 1, "no blind resend");
    // The lookup misses past the grace (200 ms): proof of absence, so the ambiguity is
    // settled and the next attempt is a fresh send.
    tokio::time::sleep(Duration::from_millis(250)).await;
    w.reconciler.run_once().await.expect("reconcile");
    let op = w.op(id).await;
    assert_eq!(op.status, Status::PendingDispatch);
    assert_eq!(op.ambiguous_since, None);
    w.dispatcher.run_once(8).await.expect("fresh attempt");
    let op = w.op(id).await;
    assert_eq!(op.status, Status::CompletedSuccess);
    assert_eq!(w.provider.effects(&w.key(&op)), 1);
}

/// Item 5: a claim whose lease cannot cover the call (it waited in-process, or the
/// process is draining) is given back unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_without_lease_left_for_the_call_is_given_back_unsent() {
    let w = world(16).await;
    let id = w.propose("a5", 5).await;
    let asked = Instant::now();
    let claim = w
        .ledger
        .claim(&ClaimRequest {
            owner: "d1".into(),
            lease: Duration::from_millis(500),
            limit: 1,
            ..Default::default()
        })
        .await
        .expect("claim")
        .pop()
        .expect("one claim");
    // 500 ms lease, 300 ms tool timeout: after 300 ms of waiting, 200 ms are left.
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.dispatcher
        .dispatch(Leased::new(claim, asked, Duration::from_millis(500)))
        .await;
    let op = w.op(id).await;
    assert_eq!(op.status, Status::FailedRetryable);
    assert_eq!(
        op.error.as_ref().map(|e| e.category.as_str()),
        Some("lease_too_short_to_send")
    );
    assert_eq!(w.provider.calls(), 0, "nothing was sent");
    // It is claimable again at once, and then sent.
    w.dispatcher.run_once(8).await.expect("again");
    assert_eq!(w.op(id).await.status, Status::CompletedSuccess);
    assert_eq!(w.provider.calls(), 1);
}

/// Item 5: claims are sized by the tool's free permits plus its prefetch places. With
/// `per_tool = 1` and `prefetch = 1` the provider never sees two calls at once; one more
/// operation waits for the permit, and since the permit is given back when the call
/// returns, a third may be claimed while an outcome is being recorded: at most three are
/// `dispatched` at once, never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_are_sized_by_the_tools_free_permits() {
    let w = world_with(1, 1).await;
    let slow = || Step {
        delay: Duration::from_millis(150),
        ..Step::ok()
    };
    w.provider.script((0..6).map(|_| slow()));
    let ids: Vec<Uuid> = futures_ids(&w, 6).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let page = w
            .ledger
            .list(&opgate_store::ListFilter {
                status: Some(Status::Dispatched),
                ..Default::default()
            })
            .await
            .expect("list");
        assert!(
            page.operations.len() <= 3,
            "{} claimed at once",
            page.operations.len()
        );
        let mut done = 0;
        for id in &ids {
            if w.op(*id).await.status == Status::CompletedSuccess {
                done += 1;
            }
        }
        if done == ids.len() {
            break;
        }
        assert!(Instant::now() < deadline, "only {done} completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    running.await.expect("dispatcher");
    assert_eq!(w.provider.overlaps(), 0);
    assert_eq!(
        w.provider.max_in_flight(),
        1,
        "per_tool = 1: one call at the provider at a time"
    );
}

/// A lease that runs out while a claimed operation waits for its tool's permit: with
/// `per_tool = 1` and one place of prefetch, one claim takes two operations; the first
/// call holds the permit for 1.9 s of the 2 s lease, so when the second operation gets
/// the permit less than one tool timeout (300 ms) of its lease is left. It is given back
/// unsent, claimed again, and sent once: one effect each, never two calls at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefetched_claim_whose_lease_ran_out_while_waiting_is_given_back_unsent() {
    let w = first_call_holds_most_of_the_lease().await;
    let first = w.propose("p1", 1).await;
    let second = w.propose("p2", 2).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while w.op(first).await.status != Status::CompletedSuccess
        || w.op(second).await.status != Status::CompletedSuccess
    {
        assert!(Instant::now() < deadline, "not both completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    running.await.expect("dispatcher");
    given_back_unsent_then_sent_once(&w, first, second).await;
}

/// One permit and one place ahead (`per_tool = 1`, `prefetch = 1`), a 2 s lease, and a
/// provider whose first call takes 1.9 s: whatever waits for that permit has less than
/// one tool timeout of lease left when it gets it.
async fn first_call_holds_most_of_the_lease() -> World {
    let w = world_with(1, 1).await;
    w.provider.script([
        Step {
            delay: Duration::from_millis(1900),
            ..Step::ok()
        },
        Step::ok(),
    ]);
    w
}

/// After a lease ran out while `second` waited for the permit `first`'s call held:
/// `second` was given back unsent once (no lease left to send), then sent; one call per
/// operation, never two at once, one effect each.
async fn given_back_unsent_then_sent_once(w: &World, first: Uuid, second: Uuid) {
    let attempts = w.ledger.attempts(second).await.expect("attempts");
    let outcomes: Vec<Option<&str>> = attempts
        .iter()
        .map(|a| a.report.as_ref().map(|r| r.outcome.as_str()))
        .collect();
    assert_eq!(
        outcomes,
        [Some("not_sent"), Some("committed")],
        "given back unsent once, then sent"
    );
    assert_eq!(
        attempts[0]
            .report
            .as_ref()
            .and_then(|r| r.error_category.as_deref()),
        Some("lease_too_short_to_send")
    );
    assert_eq!(w.provider.calls(), 2, "one call per operation");
    assert_eq!(w.provider.max_in_flight(), 1);
    for id in [first, second] {
        let op = w.op(id).await;
        assert_eq!(w.provider.effects(&w.key(&op)), 1);
    }
}

/// The same lease running out, for operations claimed at ingest: with `per_tool = 1` and
/// one place ahead, an offer has room for two; the ingest claims both, the first call
/// holds the permit for 1.9 s of the 2 s lease, and the second, waiting for it, is given
/// back unsent, claimed again by the dispatcher and sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_made_at_ingest_whose_lease_ran_out_while_waiting_is_given_back_unsent() {
    let w = first_call_holds_most_of_the_lease().await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let offer = first_offer(&w, 2).await;
    assert_eq!(
        offer.request.tool_room.get("charge"),
        Some(&2),
        "a permit and a place"
    );
    let batch = vec![charge(&w, "l1", 1), charge(&w, "l2", 2)];
    let (outcomes, claims) = w
        .ledger
        .ingest_and_claim(&batch, Duration::from_secs(1), &offer.request)
        .await
        .expect("ingest and claim");
    assert_eq!(claims.len(), 2);
    offer.take(claims);
    let ids: Vec<Uuid> = outcomes
        .iter()
        .map(|o| o.operation.as_ref().expect("op").operation_id)
        .collect();
    until_completed(&w, &ids).await;
    cancel.cancel();
    running.await.expect("dispatcher");
    given_back_unsent_then_sent_once(&w, ids[0], ids[1]).await;
}

async fn futures_ids(w: &World, n: u64) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(w.propose(&format!("e{i}"), i + 1).await);
    }
    ids
}

/// One proposal of `charge` as an ingest item.
fn charge(w: &World, entity: &str, amount: u64) -> IngestItem {
    let value = json!({"event_id": Uuid::now_v7().to_string(), "tool": "charge",
        "entity": {"type": "account", "id": entity}, "args": {"amount": amount}});
    let proposal = Proposal::from_value(value, &Limits::default()).expect("proposal");
    IngestItem::from_proposal(
        &w.registry,
        &proposal,
        Delivery {
            principal: None,
            source: Source::Http,
            traceparent: None,
        },
    )
}

fn wanted(n: usize) -> std::collections::BTreeMap<String, usize> {
    std::collections::BTreeMap::from([("charge".to_owned(), n)])
}

/// Waits until the running dispatcher offers room (its first claim found no backlog).
async fn first_offer(w: &World, n: usize) -> opgate_store::Offer {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(offer) = w.dispatcher.offer(&wanted(n)) {
            return offer;
        }
        assert!(
            Instant::now() < deadline,
            "the dispatcher never offered room"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn until_completed(w: &World, ids: &[Uuid]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for id in ids {
        while w.op(*id).await.status != Status::CompletedSuccess {
            assert!(Instant::now() < deadline, "{id} not completed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Ingests one charge for each of `amounts` with a claim under `offer`, hands the claims
/// back (each is claimed), and waits until every one completed with one effect at the
/// provider and one attempt.
async fn ingest_claim_and_settle(
    w: &World,
    amounts: std::ops::RangeInclusive<u64>,
    offer: opgate_store::Offer,
) {
    let batch: Vec<IngestItem> = amounts.map(|n| charge(w, &format!("h{n}"), n)).collect();
    let (outcomes, claims) = w
        .ledger
        .ingest_and_claim(&batch, Duration::from_secs(1), &offer.request)
        .await
        .expect("ingest and claim");
    assert_eq!(claims.len(), batch.len(), "each one claimed at ingest");
    offer.take(claims);
    let ids: Vec<Uuid> = outcomes
        .iter()
        .map(|o| o.operation.as_ref().expect("op").operation_id)
        .collect();
    until_completed(w, &ids).await;
    for id in &ids {
        let op = w.op(*id).await;
        assert_eq!(w.provider.effects(&w.key(&op)), 1);
        assert_eq!(op.attempt_count, 1, "claimed once, at ingest");
    }
}

/// Claim at ingest: the room a dispatcher offers is what a claim of its own could take
/// (free permits and places ahead, at most what the batch holds), promised to the offer
/// until it is taken or dropped, so two offers never promise the same room. The claims
/// an ingest hands back are sent once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn room_offered_to_an_ingest_is_promised_once_and_its_claims_are_sent_once() {
    let w = world_with(3, 3).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    // Three permits free and three places ahead (`prefetch`): room for six, of which
    // the batch holds two.
    let first = first_offer(&w, 2).await;
    assert_eq!(first.request.limit, 2);
    assert_eq!(first.request.tool_room.get("charge"), Some(&2));
    assert_eq!(first.request.owner, "d1");
    // While it is out, another offer gets only what is left.
    let second = w.dispatcher.offer(&wanted(3)).expect("four left");
    assert_eq!(second.request.tool_room.get("charge"), Some(&3));
    let third = w.dispatcher.offer(&wanted(3)).expect("one left");
    assert_eq!(third.request.tool_room.get("charge"), Some(&1));
    assert!(
        w.dispatcher.offer(&wanted(3)).is_none(),
        "all the room is promised"
    );
    // A failed ingest drops its offer: the room comes back.
    drop(second);
    let again = w.dispatcher.offer(&wanted(5)).expect("given back");
    assert_eq!(again.request.tool_room.get("charge"), Some(&3));
    drop(again);
    drop(third);

    ingest_claim_and_settle(&w, 1..=2, first).await;
    assert!(
        w.provider.max_in_flight() <= 2,
        "per_tool holds for handed claims"
    );
    // Handed back and settled: every permit and place is offered again.
    let whole = w.dispatcher.offer(&wanted(9)).expect("room");
    assert_eq!(whole.request.tool_room.get("charge"), Some(&6));
    // An ingest claims more than the free permits: the ones beyond them wait for a
    // permit, as a claim taken ahead does; per_tool holds and each is sent once.
    w.provider.script((0..5).map(|_| Step {
        delay: Duration::from_millis(100),
        ..Step::ok()
    }));
    ingest_claim_and_settle(&w, 3..=7, whole).await;
    assert_eq!(
        w.provider.max_in_flight(),
        3,
        "per_tool holds for claims handed beyond the free permits, and they fill it"
    );
    cancel.cancel();
    running.await.expect("dispatcher");
}

/// No room is offered before the dispatcher has found no backlog (what an ingest creates
/// would be claimed ahead of older operations), nor once it is stopping. An offer made
/// before the stop and taken after it is still sent: the drain waits for it. An offer
/// dropped after the stop does not hold the drain up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_room_is_offered_behind_a_backlog_or_after_a_stop_and_an_offer_out_is_drained() {
    let w = world_with(4, 4).await;
    assert!(
        w.dispatcher.offer(&wanted(1)).is_none(),
        "not running: no claim has found the queue empty"
    );
    // A backlog: the first claim takes up to the room, the rest wait.
    let backlog = futures_ids(&w, 12).await;
    let slow = || Step {
        delay: Duration::from_millis(100),
        ..Step::ok()
    };
    w.provider.script((0..12).map(|_| slow()));
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        w.dispatcher.offer(&wanted(1)).is_none(),
        "a backlog waits: no claim at ingest"
    );
    until_completed(&w, &backlog).await;
    let out = first_offer(&w, 1).await;
    let dropped = w.dispatcher.offer(&wanted(1)).expect("room for another");
    cancel.cancel();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        w.dispatcher.offer(&wanted(1)).is_none(),
        "stopping: no new offer"
    );
    drop(dropped);
    let (outcomes, claims) = w
        .ledger
        .ingest_and_claim(
            &[charge(&w, "late", 99)],
            Duration::from_secs(1),
            &out.request,
        )
        .await
        .expect("ingest and claim");
    assert_eq!(claims.len(), 1);
    out.take(claims);
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .expect("the drain ends once the offers are settled")
        .expect("dispatcher");
    let late = w
        .op(outcomes[0].operation.as_ref().expect("op").operation_id)
        .await;
    assert_eq!(
        late.status,
        Status::CompletedSuccess,
        "sent during the drain"
    );
    assert_eq!(w.provider.effects(&w.key(&late)), 1);
}

/// A lease that runs out while an ingest holds its claim: the dispatcher's clock for a
/// claim made at ingest starts when it made the offer, so an ingest transaction that
/// took most of the lease (here 1.8 s of 2 s, as one held up by locks and retries would)
/// hands back a claim with less than one tool timeout (300 ms) left. It is given back
/// unsent, claimed again by the dispatcher, and sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_made_by_a_slow_ingest_is_given_back_unsent_then_sent_once() {
    let w = world(4).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(w.dispatcher.clone().run(cancel.clone()));
    let offer = first_offer(&w, 1).await;
    tokio::time::sleep(Duration::from_millis(1800)).await;
    let (outcomes, claims) = w
        .ledger
        .ingest_and_claim(
            &[charge(&w, "slow", 7)],
            Duration::from_secs(1),
            &offer.request,
        )
        .await
        .expect("ingest and claim");
    assert_eq!(claims.len(), 1);
    offer.take(claims);
    let id = outcomes[0].operation.as_ref().expect("op").operation_id;
    until_completed(&w, &[id]).await;
    cancel.cancel();
    running.await.expect("dispatcher");
    let attempts = w.ledger.attempts(id).await.expect("attempts");
    let outcomes: Vec<Option<&str>> = attempts
        .iter()
        .map(|a| a.report.as_ref().map(|r| r.outcome.as_str()))
        .collect();
    assert_eq!(outcomes, [Some("not_sent"), Some("committed")]);
    assert_eq!(
        attempts[0]
            .report
            .as_ref()
            .and_then(|r| r.error_category.as_deref()),
        Some("lease_too_short_to_send")
    );
    assert_eq!(w.provider.calls(), 1, "sent once");
    assert_eq!(w.provider.effects(&w.key(&w.op(id).await)), 1);
}
