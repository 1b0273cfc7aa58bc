//! The storage conformance suite: one generic function per behaviour, run against
//! SQLite always and against PostgreSQL with `--features integration`
//! (`OPGATE_TEST_DATABASE_URL`), each test on a fresh database or schema.

#![allow(missing_docs)]

mod support;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opgate_core::{Event, Resolution, Status};
use opgate_store::{Command, Error, IngestDecision, Ledger, ListFilter, Recording, RelayRound};
use serde_json::json;
use support::{Harness, Raw, claim_request, item, item_with, pay};

const LONG: Duration = Duration::from_secs(300);

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::support::sqlite().await).await;
                }
            )*
        }
        #[cfg(feature = "integration")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::support::postgres().await).await;
                }
            )*
        }
    };
}

conformance!(
    duplicate_event_id_is_an_inbox_hit,
    duplicate_key_from_another_event_is_a_dedupe_hit,
    concurrent_ingest_of_one_key_makes_one_operation,
    racing_claimers_never_double_claim_an_operation_or_entity,
    claims_are_fifo_per_entity,
    stale_epoch_is_rejected,
    lease_expiry_is_visible_to_the_reconciler,
    illegal_transition_is_refused,
    result_outbox_covers_every_decision_and_transition,
    a_refusal_redelivered_is_answered_once,
    reads_never_wait_for_their_entity,
    approval_parks_until_approved,
    workflow_step_key_conflict_is_rejected,
    the_same_key_from_another_tool_is_a_conflict,
    an_ambiguity_holds_its_entity_until_resolved,
    retries_are_durable_and_keep_entity_order,
    the_schema_enforces_one_write_in_flight_per_entity,
    the_schema_refuses_unknown_states,
    schema_version_is_checked,
    reaper_deletes_only_past_retention,
    list_filters_and_paginates,
    recording_keeps_attempt_and_result_details,
    dedupe_window_suppresses_the_same_action_across_keys,
    exclusive_group_lets_one_tool_act_per_window,
    an_exclusive_group_holds_with_a_key_duplicate_between_its_members,
    compensation_holds_the_original_until_it_settles,
    a_failed_compensation_leaves_the_effect_standing_and_can_be_retried,
    stats_show_live_operations_queue_depth_and_relay_backlog,
    racing_members_of_an_exclusive_group_make_one_operation,
    the_key_decides_before_the_guards,
    a_compensation_passes_writes_queued_behind_its_original,
    compensating_while_another_write_is_in_flight_is_a_conflict,
    an_event_id_reused_with_other_content_is_a_conflict,
    event_ids_are_per_namespace,
    one_batch_decides_each_proposal_as_one_at_a_time_would,
    results_of_one_operation_are_leased_in_order,
    a_relay_round_holds_its_rows_until_it_ends_or_its_lease_runs_out,
    the_schemas_state_lists_are_the_state_machines,
    two_writes_on_one_entity_conflict_exactly_when_the_first_holds_it,
    commits_that_make_work_wake_the_workers,
    the_console_reads_activity_results_and_id_ranges,
    each_inbox_row_holds_its_proposals_final_decision,
    an_ingest_claims_what_it_created_as_a_claim_would,
    racing_ingest_claims_never_put_two_writes_of_one_entity_in_flight,
    a_duplicate_of_an_operation_claimed_in_its_batch_is_answered_after_the_claim,
    only_commits_that_leave_work_claimable_wake_the_dispatcher,
);

async fn ops_count(h: &Harness) -> i64 {
    h.count("SELECT COUNT(*) FROM operations").await
}

async fn claim_one(ledger: &dyn Ledger, owner: &str) -> opgate_store::Claim {
    let mut claims = ledger
        .claim(&claim_request(owner, LONG, 1))
        .await
        .expect("claim");
    assert_eq!(claims.len(), 1, "expected one claimable operation");
    claims.remove(0)
}

/// Publishes every pending result row, as a relay would (up to 100); how many.
async fn publish_all(ledger: &dyn Ledger) -> usize {
    let rows = ledger
        .claim_results(&claim_request("relay", LONG, 100))
        .await
        .expect("claim results");
    ledger
        .mark_published(&rows.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .expect("mark published");
    rows.len()
}

async fn record_ok(ledger: &dyn Ledger, rec: Recording) -> opgate_core::Operation {
    ledger
        .record(&[rec])
        .await
        .expect("record batch")
        .remove(0)
        .expect("recording accepted")
}

async fn duplicate_event_id_is_an_inbox_hit(h: Harness) {
    let l = h.ledger.as_ref();
    let first = l.ingest(&[pay("e1", "o1", "49.00")]).await.expect("ingest");
    assert_eq!(first[0].decision, IngestDecision::Accepted);
    assert!(!first[0].inbox_hit);
    let again = l
        .ingest(&[pay("e1", "o1", "49.00"), pay("e1", "o1", "49.00")])
        .await
        .expect("ingest");
    for outcome in &again {
        assert!(outcome.inbox_hit);
        assert_eq!(
            outcome.decision,
            IngestDecision::Accepted,
            "the original decision"
        );
        assert_eq!(
            outcome.operation.as_ref().map(|o| o.operation_id),
            first[0].operation.as_ref().map(|o| o.operation_id)
        );
    }
    assert_eq!(ops_count(&h).await, 1);
    assert_eq!(h.count("SELECT COUNT(*) FROM inbox").await, 1);
    assert_eq!(
        h.count("SELECT COUNT(*) FROM result_outbox").await,
        1,
        "a redelivery publishes nothing new"
    );
    // The same event twice inside one fresh batch: decided once, the copy is a hit.
    let twice = l
        .ingest(&[pay("e2", "o2", "1"), pay("e2", "o2", "1")])
        .await
        .expect("ingest");
    assert_eq!((twice[0].inbox_hit, twice[1].inbox_hit), (false, true));
    assert_eq!(twice[1].decision, IngestDecision::Accepted);
    assert_eq!(
        twice[1].operation.as_ref().map(|o| o.operation_id),
        twice[0].operation.as_ref().map(|o| o.operation_id),
        "the copy reports the operation its original created"
    );
    assert_eq!(h.count("SELECT COUNT(*) FROM result_outbox").await, 2);
}

async fn duplicate_key_from_another_event_is_a_dedupe_hit(h: Harness) {
    let l = h.ledger.as_ref();
    let out = l
        .ingest(&[
            pay("e1", "o1", "49.00"),
            pay("e2", "o1", "49"),
            pay("e3", "o1", "50"),
        ])
        .await
        .expect("ingest");
    let id = |i: usize| out[i].operation.as_ref().expect("operation").operation_id;
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(
        out[1].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        }
    );
    assert_eq!(out[2].decision, IngestDecision::Accepted);
    assert_eq!(id(0), id(1));
    assert_ne!(id(0), id(2));
    assert_eq!(ops_count(&h).await, 2);
    let rows = l
        .claim_results(&claim_request("relay", LONG, 10))
        .await
        .expect("results");
    let dedupe = rows
        .iter()
        .find(|r| r.message().expect("result JSON")["event_id"] == "e2")
        .expect("result for e2");
    assert_eq!(
        dedupe.message().expect("result JSON")["dedupe"],
        json!({"hit": true, "reason": "key"})
    );
    assert_eq!(dedupe.operation_id, Some(id(0)));
    assert_eq!(dedupe.seq, 2);
}

/// Ingests each item in its own transaction, all released at once; the outcomes.
async fn race_ingest(
    ledger: &Arc<dyn Ledger>,
    items: Vec<opgate_core::IngestItem>,
) -> Vec<opgate_store::IngestOutcome> {
    let barrier = Arc::new(tokio::sync::Barrier::new(items.len()));
    let mut tasks = tokio::task::JoinSet::new();
    for item in items {
        let ledger = ledger.clone();
        let barrier = barrier.clone();
        tasks.spawn(async move {
            barrier.wait().await;
            ledger.ingest(&[item]).await.expect("ingest").remove(0)
        });
    }
    tasks.join_all().await
}

async fn concurrent_ingest_of_one_key_makes_one_operation(h: Harness) {
    for round in 0..5 {
        let items = (0..8)
            .map(|n| {
                pay(
                    &format!("r{round}-e{n}"),
                    &format!("order-{round}"),
                    "10.00",
                )
            })
            .collect();
        let outcomes = race_ingest(&h.ledger, items).await;
        let accepted = outcomes
            .iter()
            .filter(|o| o.decision == IngestDecision::Accepted)
            .count();
        assert_eq!(
            accepted, 1,
            "round {round}: exactly one proposal creates the operation"
        );
        let ids: HashSet<_> = outcomes
            .iter()
            .map(|o| o.operation.as_ref().expect("operation").operation_id)
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "round {round}: every proposal maps to one operation"
        );
    }
    assert_eq!(ops_count(&h).await, 5);
}

async fn racing_claimers_never_double_claim_an_operation_or_entity(h: Harness) {
    let mut batch = Vec::new();
    for entity in 0..10 {
        for n in 0..5 {
            batch.push(pay(
                &format!("e{entity}-{n}"),
                &format!("o{entity}"),
                &format!("{}", n + 1),
            ));
        }
    }
    h.ledger.ingest(&batch).await.expect("ingest");
    let in_flight = Arc::new(Mutex::new(HashSet::<String>::new()));
    let claimed = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..4 {
        let ledger = h.ledger.clone();
        let in_flight = in_flight.clone();
        let claimed = claimed.clone();
        tasks.spawn(async move {
            let owner = format!("worker-{worker}");
            let mut idle = 0;
            while idle < 20 {
                let claims = ledger
                    .claim(&claim_request(&owner, LONG, 3))
                    .await
                    .expect("claim");
                if claims.is_empty() {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                for c in &claims {
                    let fresh = in_flight
                        .lock()
                        .expect("lock")
                        .insert(c.operation.entity_key.clone());
                    assert!(
                        fresh,
                        "entity {} claimed while in flight",
                        c.operation.entity_key
                    );
                    claimed.lock().expect("lock").push(c.operation.operation_id);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                let recs: Vec<_> = claims
                    .iter()
                    .map(|c| {
                        // Leave the in-flight set before the outcome commits, so the next
                        // claim of this entity can only happen after we left it.
                        in_flight
                            .lock()
                            .expect("lock")
                            .remove(&c.operation.entity_key);
                        Recording::new(
                            c.operation.operation_id,
                            c.epoch(),
                            Event::Succeed,
                            "committed",
                        )
                    })
                    .collect();
                for r in ledger.record(&recs).await.expect("record") {
                    r.expect("accepted");
                }
            }
        });
    }
    tasks.join_all().await;
    let claimed = claimed.lock().expect("lock").clone();
    assert_eq!(claimed.len(), 50, "every operation claimed once");
    assert_eq!(
        claimed.iter().collect::<HashSet<_>>().len(),
        50,
        "no operation claimed twice"
    );
    assert_eq!(h.count("SELECT COUNT(*) FROM operations WHERE status = 'completed_success' AND attempt_count = 1").await, 50);
}

async fn claims_are_fifo_per_entity(h: Harness) {
    let l = h.ledger.as_ref();
    let mut batch: Vec<_> = (1..=5)
        .map(|n| pay(&format!("a{n}"), "A", &n.to_string()))
        .collect();
    batch.push(pay("b1", "B", "1"));
    let ingested = l.ingest(&batch).await.expect("ingest");
    let a_ids: Vec<_> = ingested[..5]
        .iter()
        .map(|o| o.operation.as_ref().expect("op").operation_id)
        .collect();
    let first = l.claim(&claim_request("w", LONG, 10)).await.expect("claim");
    let entities: Vec<_> = first
        .iter()
        .map(|c| c.operation.entity.id.as_str())
        .collect();
    assert_eq!(first.len(), 2, "one head per entity: {entities:?}");
    let mut order = Vec::new();
    let mut current = first
        .into_iter()
        .find(|c| c.operation.entity.id == "A")
        .expect("A head");
    loop {
        order.push(current.operation.operation_id);
        record_ok(
            l,
            Recording::new(
                current.operation.operation_id,
                current.epoch(),
                Event::Succeed,
                "ok",
            ),
        )
        .await;
        let next = l.claim(&claim_request("w", LONG, 10)).await.expect("claim");
        assert!(
            next.len() <= 1,
            "only A remains and only its head is claimable"
        );
        match next.into_iter().next() {
            Some(c) => current = c,
            None => break,
        }
    }
    assert_eq!(order, a_ids, "A's operations ran in ingest order");
}

async fn stale_epoch_is_rejected(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1")]).await.expect("ingest");
    let claim = l
        .claim(&claim_request("w1", Duration::from_millis(1), 1))
        .await
        .expect("claim")
        .remove(0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let reconcile = l
        .claim_reconcile(&claim_request("r1", LONG, 10))
        .await
        .expect("reconcile")
        .remove(0);
    assert!(reconcile.epoch() > claim.epoch());
    let late = l
        .record(&[Recording::new(
            claim.operation.operation_id,
            claim.epoch(),
            Event::Succeed,
            "late",
        )])
        .await
        .expect("batch")
        .remove(0);
    assert!(
        matches!(late, Err(Error::StaleEpoch { presented, current, .. }) if presented == claim.epoch() && current == reconcile.epoch()),
        "{late:?}"
    );
    let op = record_ok(
        l,
        Recording::new(
            reconcile.operation.operation_id,
            reconcile.epoch(),
            Event::Succeed,
            "lookup_found",
        ),
    )
    .await;
    assert_eq!(op.status, Status::CompletedSuccess);
}

async fn lease_expiry_is_visible_to_the_reconciler(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1"), pay("e2", "o2", "1")])
        .await
        .expect("ingest");
    let short = l
        .claim(&claim_request("crashy", Duration::from_millis(1), 1))
        .await
        .expect("claim")
        .remove(0);
    let _long = l
        .claim(&claim_request("healthy", LONG, 1))
        .await
        .expect("claim")
        .remove(0);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let claims = l
        .claim_reconcile(&claim_request("reconciler", LONG, 10))
        .await
        .expect("reconcile");
    assert_eq!(claims.len(), 1, "only the expired lease");
    let op = &claims[0].operation;
    assert_eq!(op.operation_id, short.operation.operation_id);
    assert_eq!(op.status, Status::UnknownOutcome);
    assert_eq!(op.lease_owner.as_deref(), Some("reconciler"));
    assert_eq!(
        op.error.as_ref().map(|e| e.category.as_str()),
        Some("lease_expired")
    );
    let events = l.events(op.operation_id).await.expect("events");
    let last = events.last().expect("events");
    assert_eq!(
        (last.from, last.to, last.reason.as_str()),
        (
            Some(Status::Dispatched),
            Status::UnknownOutcome,
            "lease_expired"
        )
    );
    assert!(
        l.claim_reconcile(&claim_request("other", LONG, 10))
            .await
            .expect("reconcile")
            .is_empty(),
        "leased to the first reconciler"
    );
}

async fn illegal_transition_is_refused(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1")]).await.expect("ingest");
    let c = claim_one(l, "w").await;
    let id = c.operation.operation_id;
    let refused = l
        .record(&[Recording::new(id, c.epoch(), Event::Approve, "nonsense")])
        .await
        .expect("batch")
        .remove(0);
    assert!(
        matches!(refused, Err(Error::IllegalTransition { .. })),
        "{refused:?}"
    );
    assert_eq!(
        l.operation(id).await.expect("read").expect("exists").status,
        Status::Dispatched
    );
    record_ok(l, Recording::new(id, c.epoch(), Event::Succeed, "ok")).await;
    let again = l
        .record(&[Recording::new(id, c.epoch(), Event::Succeed, "twice")])
        .await
        .expect("batch")
        .remove(0);
    assert!(
        matches!(again, Err(Error::IllegalTransition { .. })),
        "{again:?}"
    );
    let cmd = Command {
        operation_id: id,
        event: Event::Cancel,
        actor: "ops".into(),
        reason: "too late".into(),
        result: None,
    };
    assert!(matches!(
        l.apply(&cmd).await,
        Err(Error::IllegalTransition { .. })
    ));
    assert_eq!(
        l.events(id).await.expect("events").len(),
        3,
        "ingested, claimed, succeeded; nothing else"
    );
}

/// A refused proposal (a poison message: an unknown tool) delivered twice in one batch
/// and again in a later one beside a new proposal gets one result row: the refusal is
/// written with its inbox row, and a redelivery only reads that row.
async fn a_refusal_redelivered_is_answered_once(h: Harness) {
    let l = h.ledger.as_ref();
    let refused = || item("r1", "no_such_tool", ("order", "o1"), json!({"x": 1}));
    let first = l.ingest(&[refused(), refused()]).await.expect("ingest");
    assert!(!first[0].inbox_hit && first[1].inbox_hit, "{first:?}");
    let again = l
        .ingest(&[refused(), pay("e1", "o2", "1")])
        .await
        .expect("ingest");
    assert!(again[0].inbox_hit, "{again:?}");
    for outcome in first.iter().chain(&again[..1]) {
        assert!(
            matches!(&outcome.decision, IngestDecision::Rejected { reason } if reason == "unknown_tool"),
            "{outcome:?}"
        );
    }
    let rows = l
        .claim_results(&claim_request("relay", LONG, 100))
        .await
        .expect("results");
    let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
    assert_eq!(statuses, ["rejected", "pending_dispatch"], "{rows:?}");
}

async fn result_outbox_covers_every_decision_and_transition(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[
        pay("e1", "o1", "1"),
        pay("e2", "o1", "1.00"),
        item("e3", "no_such_tool", ("order", "o9"), json!({})),
    ])
    .await
    .expect("ingest");
    let c = claim_one(l, "w").await;
    record_ok(
        l,
        Recording::new(c.operation.operation_id, c.epoch(), Event::Succeed, "ok"),
    )
    .await;
    let rows = l
        .claim_results(&claim_request("relay", LONG, 100))
        .await
        .expect("results");
    let seen: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.message().expect("result JSON")["event_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                r.status.clone(),
                r.seq,
                r.kafka_key.clone(),
            )
        })
        .collect();
    let expected = vec![
        (
            "e1".to_owned(),
            "pending_dispatch".to_owned(),
            1,
            "order:o1".to_owned(),
        ),
        (
            "e2".to_owned(),
            "pending_dispatch".to_owned(),
            2,
            "order:o1".to_owned(),
        ),
        (
            "e3".to_owned(),
            "rejected".to_owned(),
            0,
            "order:o9".to_owned(),
        ),
        (
            "e1".to_owned(),
            "dispatched".to_owned(),
            3,
            "order:o1".to_owned(),
        ),
        (
            "e1".to_owned(),
            "completed_success".to_owned(),
            4,
            "order:o1".to_owned(),
        ),
    ];
    assert_eq!(seen, expected);
    let rejected = &rows[2].message().expect("result JSON");
    assert_eq!(rejected["error"]["category"], "unknown_tool");
    assert_eq!(rejected["operation_id"], json!(null));
    assert_eq!(
        rows[0].message().expect("result JSON")["traceparent"],
        json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    // The relay's header comes with the row, unparsed payload beside it.
    assert_eq!(
        rows[0].traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    for row in &rows {
        let message = row.message().expect("result JSON");
        assert_eq!(
            row.traceparent.as_deref(),
            message["traceparent"].as_str(),
            "{row:?}"
        );
    }
    assert!(
        l.claim_results(&claim_request("relay2", LONG, 100))
            .await
            .expect("results")
            .is_empty(),
        "leased rows are not handed out twice"
    );
    l.mark_published(&rows.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .expect("mark");
    assert_eq!(
        h.count("SELECT COUNT(*) FROM result_outbox WHERE published_at IS NULL")
            .await,
        0
    );
}

async fn reads_never_wait_for_their_entity(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[
        item(
            "w1",
            "email",
            ("user", "u1"),
            json!({"to": "a@b.c", "n": 1}),
        ),
        item(
            "w2",
            "email",
            ("user", "u1"),
            json!({"to": "a@b.c", "n": 2}),
        ),
        item("r1", "lookup", ("user", "u1"), json!({"q": 1})),
    ])
    .await
    .expect("ingest");
    let claims = l.claim(&claim_request("w", LONG, 10)).await.expect("claim");
    let tools: Vec<_> = claims
        .iter()
        .map(|c| (c.operation.tool.as_str(), c.operation.event_id.as_str()))
        .collect();
    assert_eq!(tools.len(), 2, "{tools:?}");
    assert!(
        tools.contains(&("email", "w1")) && tools.contains(&("lookup", "r1")),
        "{tools:?}"
    );
}

async fn approval_parks_until_approved(h: Harness) {
    let l = h.ledger.as_ref();
    let out = l
        .ingest(&[item("e1", "refund", ("order", "o1"), json!({"amount": 5}))])
        .await
        .expect("ingest");
    let op = out[0].operation.clone().expect("op");
    assert_eq!(op.status, Status::AwaitingApproval);
    assert!(
        l.claim(&claim_request("w", LONG, 10))
            .await
            .expect("claim")
            .is_empty()
    );
    let approved = l
        .apply(&Command {
            operation_id: op.operation_id,
            event: Event::Approve,
            actor: "alice".into(),
            reason: "ok".into(),
            result: None,
        })
        .await
        .expect("approve");
    assert_eq!(approved.status, Status::PendingDispatch);
    let c = claim_one(l, "w").await;
    assert_eq!(c.operation.operation_id, op.operation_id);
    let events = l.events(op.operation_id).await.expect("events");
    assert_eq!(events[1].actor.as_deref(), Some("alice"));
}

async fn workflow_step_key_conflict_is_rejected(h: Harness) {
    let l = h.ledger.as_ref();
    let wf = json!({"workflow_id": "wf-1", "step": 2});
    let out = l
        .ingest(&[
            item_with(
                "e1",
                "ticket",
                ("account", "a1"),
                json!({"title": "Refund"}),
                wf.clone(),
            ),
            item_with(
                "e2",
                "ticket",
                ("account", "a1"),
                json!({"title": "Refund"}),
                wf.clone(),
            ),
            item_with(
                "e3",
                "ticket",
                ("account", "a1"),
                json!({"title": "Refund please"}),
                wf,
            ),
        ])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(
        out[1].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        }
    );
    assert_eq!(
        out[2].decision,
        IngestDecision::Rejected {
            reason: "key_conflict".into()
        }
    );
    assert_eq!(ops_count(&h).await, 1);
    assert_eq!(
        h.count(
            "SELECT COUNT(*) FROM inbox WHERE decision = 'rejected' AND reason = 'key_conflict'"
        )
        .await,
        1
    );
}

async fn the_same_key_from_another_tool_is_a_conflict(h: Harness) {
    let l = h.ledger.as_ref();
    let out = l
        .ingest(&[
            pay("e1", "o1", "5"),
            item(
                "e2",
                "pay_twin",
                ("order", "o1"),
                json!({"amount": "5", "currency": "usd"}),
            ),
        ])
        .await
        .expect("ingest");
    assert_eq!(
        out[1].decision,
        IngestDecision::Rejected {
            reason: "key_conflict".into()
        }
    );
    assert_eq!(ops_count(&h).await, 1);
    let rows = l
        .claim_results(&claim_request("relay", LONG, 10))
        .await
        .expect("results");
    let rejected = rows
        .iter()
        .find(|r| r.message().expect("result JSON")["event_id"] == "e2")
        .expect("result for e2");
    assert!(
        rejected.message().expect("result JSON")["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("pay")
    );
}

async fn an_ambiguity_holds_its_entity_until_resolved(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1"), pay("e2", "o1", "2")])
        .await
        .expect("ingest");
    let c = claim_one(l, "w").await;
    record_ok(
        l,
        Recording::new(
            c.operation.operation_id,
            c.epoch(),
            Event::OutcomeUnknown,
            "timeout_after_send",
        ),
    )
    .await;
    assert!(
        l.claim(&claim_request("w", LONG, 10))
            .await
            .expect("claim")
            .is_empty(),
        "the entity is held"
    );
    let r = l
        .claim_reconcile(&claim_request("rec", LONG, 10))
        .await
        .expect("reconcile")
        .remove(0);
    let still = record_ok(
        l,
        Recording {
            next_in: Some(LONG),
            ..Recording::new(
                r.operation.operation_id,
                r.epoch(),
                Event::StillUnknown,
                "lookup_missed",
            )
        },
    )
    .await;
    assert_eq!(still.status, Status::UnknownOutcome);
    assert!(
        l.claim_reconcile(&claim_request("rec", LONG, 10))
            .await
            .expect("reconcile")
            .is_empty(),
        "not due yet"
    );
    let op = l
        .apply(&Command {
            operation_id: r.operation.operation_id,
            event: Event::Resolve(Resolution::Succeeded),
            actor: "bob".into(),
            reason: "checked the provider".into(),
            result: Some(json!({"charge_id": "ch_1"})),
        })
        .await
        .expect("resolve");
    assert_eq!(op.status, Status::CompletedSuccess);
    assert_eq!(op.result, Some(json!({"charge_id": "ch_1"})));
    let events = l.events(op.operation_id).await.expect("events");
    let resolved = events.last().expect("event");
    assert!(
        resolved
            .detail
            .as_ref()
            .and_then(|d| d.get("unknown_for_ms"))
            .is_some(),
        "the ambiguity's duration is recorded: {resolved:?}"
    );
    let next = claim_one(l, "w").await;
    assert_eq!(next.operation.event_id, "e2");
}

async fn retries_are_durable_and_keep_entity_order(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1"), pay("e2", "o1", "2")])
        .await
        .expect("ingest");
    let c = claim_one(l, "w").await;
    let op = record_ok(
        l,
        Recording {
            next_in: Some(LONG),
            ..Recording::new(
                c.operation.operation_id,
                c.epoch(),
                Event::ScheduleRetry,
                "not_sent",
            )
        },
    )
    .await;
    assert_eq!(op.status, Status::FailedRetryable);
    assert!(op.next_attempt_at.is_some());
    assert!(
        l.claim(&claim_request("w", LONG, 10))
            .await
            .expect("claim")
            .is_empty(),
        "not due, and e2 waits behind it"
    );
    h.exec("UPDATE dispatch_queue SET ready_at = '2000-01-01T00:00:00.000Z'")
        .await
        .expect("make due");
    let again = claim_one(l, "w").await;
    assert_eq!(again.operation.operation_id, c.operation.operation_id);
    assert_eq!(again.operation.attempt_count, 2);
    assert_eq!(
        again.first_attempt_at, c.first_attempt_at,
        "the budget counts from the first attempt"
    );
    assert_eq!(
        l.attempts(c.operation.operation_id)
            .await
            .expect("attempts")
            .len(),
        2
    );
}

async fn the_schema_enforces_one_write_in_flight_per_entity(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[
        pay("e1", "o1", "1"),
        pay("e2", "o1", "2"),
        item("r", "lookup", ("order", "o1"), json!({})),
    ])
    .await
    .expect("ingest");
    h.set_status("dispatched", "event_id = 'e1'")
        .await
        .expect("first in flight");
    let second = h.set_status("unknown_outcome", "event_id = 'e2'").await;
    assert!(
        second.is_err(),
        "a second write in flight on one entity must violate the unique index"
    );
    h.set_status("dispatched", "event_id = 'r'")
        .await
        .expect("reads are exempt");
}

async fn the_schema_refuses_unknown_states(h: Harness) {
    h.ledger
        .ingest(&[pay("e1", "o1", "1")])
        .await
        .expect("ingest");
    // Each statement is otherwise valid: the same ones with known values succeed.
    assert_eq!(
        h.set_status("pending_dispatch", "TRUE")
            .await
            .expect("a known state"),
        1
    );
    let class = |class: &str| {
        format!(
            "UPDATE {} SET side_effect_class = '{class}'",
            h.identity_table()
        )
    };
    assert_eq!(
        h.exec(&class("irreversible")).await.expect("a known class"),
        1
    );
    // Refused by the CHECK constraints themselves (on PostgreSQL another class would
    // also break the state row's foreign key, which must not be what refuses it here).
    let by_check = |outcome: Result<u64, sqlx::Error>| {
        matches!(&outcome, Err(sqlx::Error::Database(db))
            if db.kind() == sqlx::error::ErrorKind::CheckViolation)
    };
    assert!(by_check(h.set_status("done", "TRUE").await));
    assert!(by_check(h.exec(&class("risky")).await));
}

async fn schema_version_is_checked(h: Harness) {
    let status = h.ledger.schema_status().await.expect("status");
    assert!(status.is_current(), "{status:?}");
    // Pretend a newer build migrated this database (bytea literals differ by dialect).
    let sqlite = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
                  VALUES (99990101000000, 'future', true, X'00', 0)";
    let postgres = "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
                    VALUES (99990101000000, 'future', true, '\\x00'::bytea, 0)";
    if h.exec(sqlite).await.is_err() {
        h.exec(postgres).await.expect("insert a future migration");
    }
    let status = h.ledger.schema_status().await.expect("status");
    assert!(
        matches!(
            status.require_current(),
            Err(Error::SchemaTooNew {
                found: 99990101000000,
                ..
            })
        ),
        "{status:?}"
    );
}

async fn reaper_deletes_only_past_retention(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1"), pay("e2", "o2", "1")])
        .await
        .expect("ingest");
    let c = claim_one(l, "w").await;
    record_ok(
        l,
        Recording::new(c.operation.operation_id, c.epoch(), Event::Succeed, "ok"),
    )
    .await;
    assert_eq!(
        h.count("SELECT COUNT(*) FROM dispatch_queue").await,
        1,
        "a finished operation leaves the queue at once; the waiting one stays"
    );
    let published = publish_all(l).await;
    assert_eq!(
        l.reap(Duration::from_secs(3600)).await.expect("reap"),
        Default::default()
    );
    tokio::time::sleep(Duration::from_millis(30)).await;
    let stats = l.reap(Duration::from_millis(5)).await.expect("reap");
    assert_eq!((stats.inbox, stats.results), (2, published as u64));
    assert_eq!(ops_count(&h).await, 2, "operations are never reaped");
    assert_eq!(
        h.count("SELECT COUNT(*) FROM dispatch_queue").await,
        1,
        "the waiting row stays"
    );
    let again = l.ingest(&[pay("e9", "o1", "1")]).await.expect("ingest");
    assert_eq!(
        again[0].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        },
        "keys outlive the inbox"
    );
}

async fn list_filters_and_paginates(h: Harness) {
    let l = h.ledger.as_ref();
    let batch: Vec<_> = (0..7)
        .map(|n| {
            pay(
                &format!("e{n}"),
                &format!("o{}", n % 2),
                &format!("{}", n + 1),
            )
        })
        .collect();
    l.ingest(&batch).await.expect("ingest");
    l.ingest(&[item("x", "email", ("user", "u"), json!({"to": "a@b.c"}))])
        .await
        .expect("ingest");
    let mut seen = Vec::new();
    let mut filter = ListFilter {
        tool: Some("pay".into()),
        limit: Some(3),
        ..Default::default()
    };
    loop {
        let page = l.list(&filter).await.expect("list");
        assert!(page.operations.len() <= 3);
        seen.extend(page.operations.iter().map(|o| o.operation_id));
        match page.next_cursor {
            Some(c) => filter.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen.len(), 7);
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "newest first");
    let by_entity = l
        .list(&ListFilter {
            entity: Some("order:o1".into()),
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(by_entity.operations.len(), 3);
    let by_status = l
        .list(&ListFilter {
            status: Some(Status::PendingDispatch),
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(by_status.operations.len(), 8);
    let key = &by_entity.operations[0].idempotency_key;
    let by_key = l
        .list(&ListFilter {
            idempotency_key: Some(key.clone()),
            ..Default::default()
        })
        .await
        .expect("list");
    assert_eq!(by_key.operations.len(), 1);
    assert_eq!(
        l.operation_by_key("acme", key)
            .await
            .expect("read")
            .map(|o| o.idempotency_key),
        Some(key.clone())
    );
}

async fn recording_keeps_attempt_and_result_details(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "49.00")]).await.expect("ingest");
    let c = claim_one(l, "w").await;
    let attempt_id = c.attempt_id.expect("dispatch claims persist an attempt");
    let before = l
        .attempts(c.operation.operation_id)
        .await
        .expect("attempts");
    assert_eq!(
        before.len(),
        1,
        "the attempt exists before the tool is called"
    );
    assert!(before[0].finished_at.is_none());
    let report = opgate_store::AttemptReport {
        outcome: "committed".into(),
        http_status: Some(200),
        error_category: None,
        latency: Some(Duration::from_millis(42)),
        provider_request_id: Some("req_1".into()),
    };
    let op = record_ok(
        l,
        Recording {
            attempt: Some((attempt_id, report.clone())),
            result: Some(json!({"charge_id": "ch_9", "amount": 4900})),
            external_object_id: Some("ch_9".into()),
            external_request_id: Some("req_1".into()),
            ..Recording::new(
                c.operation.operation_id,
                c.epoch(),
                Event::Succeed,
                "committed",
            )
        },
    )
    .await;
    assert_eq!(op.external_object_id.as_deref(), Some("ch_9"));
    assert!(op.lease_owner.is_none(), "the lease is released");
    let attempts = l.attempts(op.operation_id).await.expect("attempts");
    assert_eq!(attempts[0].report.as_ref(), Some(&report));
    assert!(attempts[0].finished_at.is_some());
    let stored = l
        .operation(op.operation_id)
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(
        stored.result,
        Some(json!({"charge_id": "ch_9", "amount": 4900}))
    );
    assert_eq!(
        stored.canonical_args,
        json!({"amount": 4900, "currency": "USD"})
    );
    let statuses: BTreeMap<i64, Status> = l
        .events(op.operation_id)
        .await
        .expect("events")
        .iter()
        .map(|e| (e.event_seq, e.to))
        .collect();
    assert_eq!(
        statuses.into_values().collect::<Vec<_>>(),
        vec![
            Status::PendingDispatch,
            Status::Dispatched,
            Status::CompletedSuccess
        ]
    );
}

fn dedupe_reason(outcome: &opgate_store::IngestOutcome) -> Option<&str> {
    match &outcome.decision {
        IngestDecision::Deduplicated { reason } => Some(reason),
        _ => None,
    }
}

fn notify(event: &str, user: &str, workflow: &str, to: &str) -> opgate_core::IngestItem {
    item_with(
        event,
        "notify",
        ("user", user),
        json!({"to": to}),
        json!({"workflow_id": workflow, "step": 1}),
    )
}

async fn dedupe_window_suppresses_the_same_action_across_keys(h: Harness) {
    let l = h.ledger.as_ref();
    // Two workflows send the same notification in one batch; a third sends another.
    let out = l
        .ingest(&[
            notify("n1", "u1", "wf-1", "a@example.com"),
            notify("n2", "u1", "wf-2", " A@Example.com"),
            notify("n3", "u1", "wf-3", "b@example.com"),
        ])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(dedupe_reason(&out[1]), Some("window"));
    let first = out[0].operation.as_ref().expect("op").operation_id;
    assert_eq!(
        out[1].operation.as_ref().map(|o| o.operation_id),
        Some(first)
    );
    assert_eq!(out[2].decision, IngestDecision::Accepted, "other args");
    // In a later batch, from the ledger; the same workflow step is still a key hit.
    let out = l
        .ingest(&[
            notify("n4", "u1", "wf-4", "a@example.com"),
            notify("n5", "u1", "wf-1", "a@example.com"),
            notify("n6", "u2", "wf-6", "a@example.com"),
        ])
        .await
        .expect("ingest");
    assert_eq!(dedupe_reason(&out[0]), Some("window"));
    assert_eq!(
        out[0].operation.as_ref().map(|o| o.operation_id),
        Some(first)
    );
    assert_eq!(dedupe_reason(&out[1]), Some("key"));
    assert_eq!(out[2].decision, IngestDecision::Accepted, "another user");
    assert_eq!(ops_count(&h).await, 3);
    // Every dedupe is answered on the results outbox with its reason.
    assert_eq!(
        h.count(
            "SELECT COUNT(*) FROM result_outbox WHERE CAST(payload AS TEXT) LIKE '%\"window\"%'"
        )
        .await,
        2
    );
    // Past the window, the same notification acts again.
    h.exec(&format!(
        "UPDATE {} SET created_at = '2000-01-01T00:00:00.000Z'",
        h.identity_table()
    ))
    .await
    .expect("age the operations");
    let out = l
        .ingest(&[notify("n7", "u1", "wf-7", "a@example.com")])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
}

async fn exclusive_group_lets_one_tool_act_per_window(h: Harness) {
    let l = h.ledger.as_ref();
    let make_good = |event: &str, tool: &str, account: &str| {
        item(event, tool, ("account", account), json!({"amount": "25"}))
    };
    // A race inside one batch: the refund wins, the credit is suppressed.
    let out = l
        .ingest(&[
            make_good("m1", "refund_acct", "a1"),
            make_good("m2", "credit_acct", "a1"),
        ])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(dedupe_reason(&out[1]), Some("exclusive_group"));
    assert_eq!(
        out[1].operation.as_ref().map(|o| o.tool.as_str()),
        Some("refund_acct"),
        "the answer names the operation that acted"
    );
    // Across batches, from the ledger; another account is unaffected.
    let out = l
        .ingest(&[
            make_good("m3", "credit_acct", "a2"),
            make_good("m4", "credit_acct", "a1"),
        ])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(dedupe_reason(&out[1]), Some("exclusive_group"));
    // A cancelled member no longer excludes the others.
    let credit = out[0].operation.as_ref().expect("op").operation_id;
    l.apply(&Command {
        operation_id: credit,
        event: Event::Cancel,
        actor: "ops".into(),
        reason: "agent withdrew it".into(),
        result: None,
    })
    .await
    .expect("cancel");
    let out = l
        .ingest(&[make_good("m5", "refund_acct", "a2")])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(ops_count(&h).await, 3);
}

/// Charges an order and completes it with a charge id.
async fn completed_charge(l: &dyn Ledger, event: &str, order: &str) -> opgate_core::Operation {
    l.ingest(&[item(
        event,
        "charge",
        ("order", order),
        json!({"amount": 10}),
    )])
    .await
    .expect("ingest");
    let claim = claim_one(l, "w").await;
    let mut rec = Recording::new(
        claim.operation.operation_id,
        claim.operation.lease_epoch,
        Event::Succeed,
        "ok",
    );
    rec.result = Some(json!({"charge_id": format!("ch_{order}")}));
    record_ok(l, rec).await
}

fn compensation_request(op: &opgate_core::Operation) -> opgate_store::CompensationRequest {
    let registry = support::registry();
    let proposal = opgate_core::compensation::proposal(&registry, op, "ops").expect("compensation");
    let envelope =
        opgate_core::envelope::prepare_for_operator(&registry, &proposal, support::delivery(0))
            .expect("the compensation is a valid proposal");
    opgate_store::CompensationRequest {
        operation_id: op.operation_id,
        envelope,
        actor: "ops".into(),
        reason: "order cancelled".into(),
    }
}

/// Claims the compensation (it must be the one claimable operation), records `event`
/// for it, and returns the original as it stands afterwards.
async fn settle_compensation(
    l: &dyn Ledger,
    compensation: &opgate_core::Operation,
    event: Event,
) -> opgate_core::Operation {
    let claim = claim_one(l, "w").await;
    assert_eq!(claim.operation.operation_id, compensation.operation_id);
    record_ok(
        l,
        Recording::new(
            compensation.operation_id,
            claim.operation.lease_epoch,
            event,
            "provider answered",
        ),
    )
    .await;
    let original = compensation.compensates.expect("a compensation");
    l.operation(original).await.expect("read").expect("exists")
}

async fn compensation_holds_the_original_until_it_settles(h: Harness) {
    let l = h.ledger.as_ref();
    // Only a completed operation can be compensated.
    l.ingest(&[item("c0", "charge", ("order", "o0"), json!({"amount": 1}))])
        .await
        .expect("ingest");
    let mut pending = l
        .list(&ListFilter {
            entity: Some("order:o0".into()),
            ..ListFilter::default()
        })
        .await
        .expect("list")
        .operations
        .remove(0);
    pending.result = Some(json!({"charge_id": "none"}));
    assert!(matches!(
        l.compensate(&compensation_request(&pending)).await,
        Err(Error::IllegalTransition { .. })
    ));
    l.apply(&Command {
        operation_id: pending.operation_id,
        event: Event::Cancel,
        actor: "ops".into(),
        reason: "not needed".into(),
        result: None,
    })
    .await
    .expect("cancel");

    let charged = completed_charge(l, "c1", "o1").await;
    let request = compensation_request(&charged);
    let (original, compensation) = l.compensate(&request).await.expect("compensate");
    assert_eq!(original.status, Status::Compensating);
    assert_eq!(compensation.status, Status::PendingDispatch);
    assert_eq!(compensation.tool, "uncharge");
    assert_eq!(compensation.compensates, Some(charged.operation_id));
    assert_eq!(compensation.canonical_args, json!({"charge_id": "ch_o1"}));
    // Asked again: the same compensation.
    let (_, again) = l.compensate(&request).await.expect("compensate again");
    assert_eq!(again.operation_id, compensation.operation_id);
    // The original holds its entity, yet its compensation runs.
    let original = settle_compensation(l, &compensation, Event::Succeed).await;
    assert_eq!(original.status, Status::Compensated);
    let events = l.events(charged.operation_id).await.expect("events");
    let reasons: Vec<&str> = events.iter().map(|e| e.reason.as_str()).collect();
    assert_eq!(
        reasons[reasons.len() - 2..],
        ["order cancelled", "compensation_succeeded"]
    );
    // Both changes of the original reached the results outbox.
    let id = charged.operation_id;
    assert_eq!(
        h.count(&format!(
            "SELECT COUNT(*) FROM result_outbox WHERE status IN ('compensating', 'compensated') \
             AND CAST(operation_id AS TEXT) = '{id}'"
        ))
        .await,
        2
    );
}

async fn a_failed_compensation_leaves_the_effect_standing_and_can_be_retried(h: Harness) {
    let l = h.ledger.as_ref();
    let charged = completed_charge(l, "c1", "o1").await;
    let request = compensation_request(&charged);
    let (_, compensation) = l.compensate(&request).await.expect("compensate");
    let original = settle_compensation(l, &compensation, Event::FailPermanently).await;
    assert_eq!(original.status, Status::CompletedSuccess);
    // Asked again, a new attempt under a new key; the failed one stays as it ended.
    let (original, retry) = l.compensate(&request).await.expect("compensate again");
    assert_eq!(original.status, Status::Compensating);
    assert_ne!(retry.operation_id, compensation.operation_id);
    assert_eq!(
        retry.idempotency_key,
        format!("{}:retry2", compensation.idempotency_key)
    );
    assert_eq!(retry.key_components["compensation_attempt"], 2);
    let failed = l
        .operation(compensation.operation_id)
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(failed.status, Status::FailedPermanent);
    // Asked again while the retry runs, and after it succeeded: the retry, not the failure.
    let (_, again) = l.compensate(&request).await.expect("compensate, running");
    assert_eq!(again.operation_id, retry.operation_id);
    let original = settle_compensation(l, &retry, Event::Succeed).await;
    assert_eq!(original.status, Status::Compensated);
    let (_, again) = l.compensate(&request).await.expect("compensate, done");
    assert_eq!(again.operation_id, retry.operation_id);
    // A compensation's key taken by an operation that is not a compensation of this
    // one is a conflict, never merged.
    let other = completed_charge(l, "c3", "o3").await;
    let mut clash = compensation_request(&other);
    clash
        .envelope
        .key
        .key
        .clone_from(&compensation.idempotency_key);
    match l.compensate(&clash).await {
        Err(Error::Conflict(message)) => {
            assert!(message.contains("resolve it by hand"), "{message}");
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    // The entity is free again: a new charge on it is claimable.
    l.ingest(&[item("c2", "charge", ("order", "o1"), json!({"amount": 20}))])
        .await
        .expect("ingest");
    let next = claim_one(l, "w").await;
    assert_eq!(next.operation.tool, "charge");
}

async fn stats_show_live_operations_queue_depth_and_relay_backlog(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1"), pay("e2", "o2", "2")])
        .await
        .expect("ingest");
    let claim = claim_one(l, "w").await;
    let stats = l.stats().await.expect("stats");
    let live: BTreeMap<&str, i64> = stats
        .live
        .iter()
        .map(|c| {
            assert_eq!((c.tool.as_str(), c.class.as_str()), ("pay", "irreversible"));
            assert!(c.oldest_change <= stats.now);
            (c.status.as_str(), c.count)
        })
        .collect();
    assert_eq!(
        live,
        BTreeMap::from([("dispatched", 1), ("pending_dispatch", 1)])
    );
    let queue: BTreeMap<&str, i64> = stats.queue.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    assert_eq!(queue, BTreeMap::from([("inflight", 1), ("waiting", 1)]));
    assert_eq!(stats.relay_pending, 3, "two accepted, one dispatched");
    assert!(stats.relay_oldest.is_some_and(|at| at <= stats.now));
    // Completed operations leave the live counts; published results leave the backlog.
    record_ok(
        l,
        Recording::new(
            claim.operation.operation_id,
            claim.operation.lease_epoch,
            Event::Succeed,
            "ok",
        ),
    )
    .await;
    publish_all(l).await;
    let stats = l.stats().await.expect("stats");
    assert_eq!(stats.live.len(), 1);
    assert_eq!(stats.live[0].status, "pending_dispatch");
    assert_eq!(stats.relay_pending, 0);
    assert_eq!(stats.relay_oldest, None);
}

/// Found by `opgate eval` at saturation: in one batch, a credit on an account, a refund
/// the credit suppresses, then the same refund under another event id (same key). The
/// second refund must face the group too: it once saw the first refund's key "taken" by
/// an earlier proposal of the batch, skipped the guards, and acted.
async fn an_exclusive_group_holds_with_a_key_duplicate_between_its_members(h: Harness) {
    let l = h.ledger.as_ref();
    let make_good =
        |event: &str, tool: &str| item(event, tool, ("account", "a9"), json!({"amount": "68.00"}));
    let out = l
        .ingest(&[
            make_good("x1", "credit_acct"),
            make_good("x2", "refund_acct"),
            make_good("x1", "credit_acct"),
            make_good("x3", "refund_acct"),
            make_good("x4", "credit_acct"),
        ])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(dedupe_reason(&out[1]), Some("exclusive_group"));
    assert_eq!(
        dedupe_reason(&out[3]),
        Some("exclusive_group"),
        "{:?}",
        out[3]
    );
    assert_eq!(dedupe_reason(&out[4]), Some("key"));
    let credit = out[0].operation.as_ref().map(|o| o.operation_id);
    for o in [&out[1], &out[3], &out[4]] {
        assert_eq!(o.operation.as_ref().map(|o| o.operation_id), credit);
    }
    let page = l
        .list(&ListFilter {
            entity: Some("account:a9".into()),
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(page.operations.len(), 1, "{:?}", page.operations);
}

async fn racing_members_of_an_exclusive_group_make_one_operation(h: Harness) {
    // Separate transactions, released together: refunds and credits on one account.
    for round in 0..5 {
        let items = (0..8)
            .map(|n| {
                let tool = if n % 2 == 0 {
                    "refund_acct"
                } else {
                    "credit_acct"
                };
                item(
                    &format!("r{round}-m{n}"),
                    tool,
                    ("account", &format!("acct-{round}")),
                    json!({"amount": format!("{}", 10 + n)}),
                )
            })
            .collect();
        let outcomes = race_ingest(&h.ledger, items).await;
        let accepted = outcomes
            .iter()
            .filter(|o| o.decision == IngestDecision::Accepted)
            .count();
        assert_eq!(accepted, 1, "round {round}: one make-good per account");
        assert!(
            outcomes
                .iter()
                .filter(|o| o.decision != IngestDecision::Accepted)
                .all(|o| dedupe_reason(o) == Some("exclusive_group")),
            "round {round}: {outcomes:?}"
        );
    }
    assert_eq!(ops_count(&h).await, 5);
}

async fn the_key_decides_before_the_guards(h: Harness) {
    let l = h.ledger.as_ref();
    let make_good = |event: &str, tool: &str, amount: &str| {
        item(event, tool, ("account", "a1"), json!({ "amount": amount }))
    };
    // A refund that failed for good no longer excludes anything.
    let out = l
        .ingest(&[make_good("m1", "refund_acct", "25")])
        .await
        .expect("ingest");
    let refund = out[0].operation.as_ref().expect("op").operation_id;
    l.apply(&Command {
        operation_id: refund,
        event: Event::Cancel,
        actor: "ops".into(),
        reason: "withdrawn".into(),
        result: None,
    })
    .await
    .expect("cancel");
    // In one batch: the agent retries that refund (its key names the cancelled
    // operation: a key dedupe, no new operation), then proposes a credit. The retry
    // must not count as a member that acted.
    let out = l
        .ingest(&[
            make_good("m2", "refund_acct", "25"),
            make_good("m3", "credit_acct", "25"),
        ])
        .await
        .expect("ingest");
    assert_eq!(dedupe_reason(&out[0]), Some("key"));
    assert_eq!(
        out[0].operation.as_ref().map(|o| o.operation_id),
        Some(refund)
    );
    assert_eq!(out[1].decision, IngestDecision::Accepted, "{:?}", out[1]);
    let credit = out[1].operation.as_ref().expect("op").operation_id;
    // Later, a retry of the credit is a key dedupe of the credit, and another refund is
    // an exclusive-group dedupe naming the credit.
    let out = l
        .ingest(&[
            make_good("m4", "credit_acct", "25"),
            make_good("m5", "refund_acct", "30"),
        ])
        .await
        .expect("ingest");
    assert_eq!(dedupe_reason(&out[0]), Some("key"));
    assert_eq!(dedupe_reason(&out[1]), Some("exclusive_group"));
    assert_eq!(
        out[1].operation.as_ref().map(|o| o.operation_id),
        Some(credit)
    );
    assert_eq!(ops_count(&h).await, 2);
}

async fn a_compensation_passes_writes_queued_behind_its_original(h: Harness) {
    let l = h.ledger.as_ref();
    let charged = completed_charge(l, "c1", "o1").await;
    // Another write on the order waits in the queue, ahead of the compensation.
    l.ingest(&[item("c2", "charge", ("order", "o1"), json!({"amount": 20}))])
        .await
        .expect("ingest");
    let (_, compensation) = l
        .compensate(&compensation_request(&charged))
        .await
        .expect("compensate");
    // The waiting write is blocked by the original (compensating); the compensation runs.
    let original = settle_compensation(l, &compensation, Event::Succeed).await;
    assert_eq!(original.status, Status::Compensated);
    // Then the waiting write.
    let next = claim_one(l, "w").await;
    assert_eq!(next.operation.canonical_args, json!({"amount": 20}));
}

/// A compensation needs its entity; while another write on it is dispatched, asking is
/// a conflict to report (409 over HTTP), not a database outage (it used to be retried as
/// transient, then answered `503 ledger_unavailable`).
async fn compensating_while_another_write_is_in_flight_is_a_conflict(h: Harness) {
    let l = h.ledger.as_ref();
    let charged = completed_charge(l, "c1", "o1").await;
    l.ingest(&[item("c2", "charge", ("order", "o1"), json!({"amount": 20}))])
        .await
        .expect("ingest");
    let in_flight = claim_one(l, "w").await;
    assert_eq!(in_flight.operation.canonical_args, json!({"amount": 20}));
    let started = std::time::Instant::now();
    let refused = l.compensate(&compensation_request(&charged)).await;
    assert!(
        matches!(&refused, Err(Error::Conflict(m)) if m.contains("in flight")),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered at once, not after retries"
    );
    // Nothing changed: the original is still completed, and once the other write has
    // settled the compensation goes through.
    let original = l
        .operation(charged.operation_id)
        .await
        .expect("read")
        .expect("exists");
    assert_eq!(original.status, Status::CompletedSuccess);
    record_ok(
        l,
        Recording::new(
            in_flight.operation.operation_id,
            in_flight.operation.lease_epoch,
            Event::Succeed,
            "ok",
        ),
    )
    .await;
    let (original, _) = l
        .compensate(&compensation_request(&charged))
        .await
        .expect("compensate once the entity is free");
    assert_eq!(original.status, Status::Compensating);
}

/// Issue 9, item 7: the same event id with other content is not a redelivery. It is
/// refused (`event_id_conflict`, answered on the results) and the first decision stands;
/// before, it silently returned the first decision and the new proposal was lost.
async fn an_event_id_reused_with_other_content_is_a_conflict(h: Harness) {
    let l = h.ledger.as_ref();
    let first = l.ingest(&[pay("e1", "o1", "49.00")]).await.expect("ingest");
    let first_op = first[0].operation.clone().expect("operation");
    for other in [
        pay("e1", "o1", "1000.00"),
        pay("e1", "o2", "49.00"),
        item(
            "e1",
            "notify",
            ("user", "u1"),
            json!({"to": "a@example.com"}),
        ),
        // Equivalent spellings are still other content: a redelivery is byte-for-byte
        // the same proposal, re-serialized at most.
        pay("e1", "o1", "49"),
    ] {
        let out = l.ingest(&[other]).await.expect("ingest");
        assert_eq!(
            out[0].decision,
            IngestDecision::Rejected {
                reason: "event_id_conflict".into()
            }
        );
        assert!(!out[0].inbox_hit);
        assert!(out[0].operation.is_none());
    }
    // The redelivery itself is still a plain inbox hit.
    let again = l.ingest(&[pay("e1", "o1", "49.00")]).await.expect("ingest");
    assert!(again[0].inbox_hit);
    assert_eq!(
        again[0].operation.as_ref().map(|o| o.operation_id),
        Some(first_op.operation_id)
    );
    assert_eq!(ops_count(&h).await, 1);
    assert_eq!(
        h.count("SELECT COUNT(*) FROM result_outbox WHERE status = 'rejected'")
            .await,
        4,
        "every refused reuse is answered"
    );
    // Inside one batch too.
    let out = l
        .ingest(&[pay("e9", "o9", "1"), pay("e9", "o9", "2")])
        .await
        .expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(
        out[1].decision,
        IngestDecision::Rejected {
            reason: "event_id_conflict".into()
        }
    );
    assert_eq!(ops_count(&h).await, 2);
}

/// The ingest group commit puts several partitions' batches into one transaction, so an
/// event id or a key reused across partitions meets itself inside one batch: each proposal
/// is decided there as it is when the proposals come one batch at a time — a redelivery,
/// the same id with other content, the same key under another id, a redelivery after the
/// conflict. (One namespace takes them one by one, another all in one batch.)
async fn one_batch_decides_each_proposal_as_one_at_a_time_would(h: Harness) {
    let l = h.ledger.as_ref();
    let sequence = |namespace: &str| {
        let pay = |event_id: &str, order: &str, amount: &str| {
            item_with(
                event_id,
                "pay",
                ("order", order),
                json!({"amount": amount, "currency": "usd"}),
                json!({"namespace": namespace}),
            )
        };
        vec![
            pay("e1", "o1", "5"),
            pay("e1", "o1", "5"),
            pay("e1", "o1", "6"),
            pay("e2", "o1", "5.00"),
            pay("e3", "o2", "7"),
            pay("e1", "o1", "5"),
            pay("e3", "o2", "7.5"),
        ]
    };
    let summary = |outcomes: &[opgate_store::IngestOutcome]| {
        outcomes
            .iter()
            .map(|o| {
                (
                    o.event_id.clone(),
                    o.decision.clone(),
                    o.inbox_hit,
                    o.operation.as_ref().map(|op| op.event_id.clone()),
                )
            })
            .collect::<Vec<_>>()
    };
    let mut one_by_one = Vec::new();
    for item in sequence("one-by-one") {
        one_by_one.extend(l.ingest(&[item]).await.expect("ingest"));
    }
    let together = l.ingest(&sequence("together")).await.expect("ingest");
    assert_eq!(summary(&together), summary(&one_by_one));
    assert_eq!(
        summary(&one_by_one)
            .iter()
            .map(|(_, decision, hit, _)| (decision.as_str(), *hit))
            .collect::<Vec<_>>(),
        [
            ("accepted", false),
            ("accepted", true),
            ("rejected", false),
            ("deduplicated", false),
            ("accepted", false),
            ("accepted", true),
            ("rejected", false),
        ]
    );
    for namespace in ["one-by-one", "together"] {
        let operations = h
            .count(&format!(
                "SELECT COUNT(*) FROM operations WHERE namespace = '{namespace}'"
            ))
            .await;
        assert_eq!(operations, 2, "{namespace}: e1's and e3's");
        let accepted = h
            .count(&format!(
                "SELECT COUNT(*) FROM inbox WHERE source_id LIKE '{namespace}/%' \
                 AND decision = 'accepted'"
            ))
            .await;
        assert_eq!(
            accepted, 2,
            "{namespace}: e1 and e3 keep their first decision"
        );
    }
    // The batch stores as many results for its operations as one by one, and each
    // operation's results in the order of their sequence numbers, none twice (the relay
    // publishes in id order).
    let results = |namespace: &str| {
        format!(
            "SELECT COUNT(*) FROM result_outbox r JOIN operations o \
             ON o.operation_id = r.operation_id WHERE o.namespace = '{namespace}'"
        )
    };
    assert_eq!(
        h.count(&results("together")).await,
        h.count(&results("one-by-one")).await
    );
    let out_of_order = h
        .count(
            "SELECT COUNT(*) FROM result_outbox a JOIN result_outbox b \
             ON a.operation_id = b.operation_id AND a.id < b.id AND a.seq >= b.seq",
        )
        .await;
    assert_eq!(out_of_order, 0);
}

/// Two namespaces' `evt-1` are two events (the inbox is keyed by namespace and event id).
async fn event_ids_are_per_namespace(h: Harness) {
    let l = h.ledger.as_ref();
    let acme = pay("evt-1", "o1", "5");
    let globex = item_with(
        "evt-1",
        "pay",
        ("order", "o1"),
        json!({"amount": "5", "currency": "usd"}),
        json!({"namespace": "globex"}),
    );
    let out = l.ingest(&[acme, globex]).await.expect("ingest");
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(out[1].decision, IngestDecision::Accepted);
    assert!(!out[1].inbox_hit);
    assert_ne!(
        out[0].operation.as_ref().map(|o| o.operation_id),
        out[1].operation.as_ref().map(|o| o.operation_id)
    );
    assert_eq!(ops_count(&h).await, 2);
}

/// Issue 9, item 9: a result row is leased only with every earlier unpublished row of
/// its operation, so no relay can publish a later state before an earlier one — not a
/// second relay, and not a retry of a failed send.
async fn results_of_one_operation_are_leased_in_order(h: Harness) {
    let l = h.ledger.as_ref();
    l.ingest(&[pay("e1", "o1", "1")]).await.expect("ingest");
    let claim = claim_one(l, "w").await;
    record_ok(
        l,
        Recording::new(
            claim.operation.operation_id,
            claim.operation.lease_epoch,
            Event::Succeed,
            "ok",
        ),
    )
    .await;
    // accepted (seq 1), dispatched (seq 2), completed_success (seq 3).
    let first = l
        .claim_results(&claim_request("relay-a", LONG, 1))
        .await
        .expect("claim");
    assert_eq!(first.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![1]);
    let second = l
        .claim_results(&claim_request("relay-b", LONG, 10))
        .await
        .expect("claim");
    assert!(
        second.is_empty(),
        "seq 2 and 3 wait while seq 1 is leased elsewhere: {second:?}"
    );
    // Relay A's send of seq 1 failed: nothing is marked. Its lease is still on; then it
    // publishes and marks it, and the rest follows in order.
    l.mark_published(&[first[0].id]).await.expect("mark");
    let rest = l
        .claim_results(&claim_request("relay-b", LONG, 10))
        .await
        .expect("claim");
    assert_eq!(rest.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3]);
}

/// The (operation, seq) of every result row a test relay was handed.
type Seen = Arc<Mutex<Vec<(Option<uuid::Uuid>, i64)>>>;

/// A relay round's publish that notes the rows it was handed in `seen` and acknowledges
/// them all.
fn ack_all(seen: Seen) -> opgate_store::Publish<'static> {
    Box::new(move |rows| {
        Box::pin(async move {
            let mut seen = seen.lock().expect("seen");
            seen.extend(rows.iter().map(|r| (r.operation_id, r.seq)));
            rows.iter().map(|r| r.id).collect()
        })
    })
}

/// A relay round (`Ledger::relay_round`) holds the rows it took while it publishes: a
/// second relay gets none of them, nor a later row of their operations; the rows it did
/// not mark are taken again by the next round, in order; and a round that hangs loses its
/// rows once its lease runs out (PostgreSQL holds the relay's turn, an advisory lock, and
/// ends the transaction after the lease idle; SQLite writes a lease).
async fn a_relay_round_holds_its_rows_until_it_ends_or_its_lease_runs_out(h: Harness) {
    let l = h.ledger.clone();
    l.ingest(&[pay("e1", "o1", "1")]).await.expect("ingest");
    let claim = claim_one(l.as_ref(), "w").await;
    let op1 = claim.operation.operation_id;
    record_ok(
        l.as_ref(),
        Recording::new(op1, claim.operation.lease_epoch, Event::Succeed, "ok"),
    )
    .await;
    // o1: accepted, dispatched, completed_success (seq 1-3). o2: accepted (seq 1).
    l.ingest(&[pay("e2", "o2", "2")]).await.expect("ingest");

    // Round A takes two rows (o1's seq 1 and 2) for 2 s and stops in its publish.
    let (handed, handed_rx) = tokio::sync::oneshot::channel::<Vec<i64>>();
    let (release, release_rx) = tokio::sync::oneshot::channel::<()>();
    let a = tokio::spawn({
        let l = l.clone();
        async move {
            l.relay_round(
                &claim_request("relay-a", Duration::from_secs(2), 2),
                Box::new(move |rows| {
                    Box::pin(async move {
                        handed
                            .send(rows.iter().map(|r| r.seq).collect())
                            .expect("test waits");
                        release_rx.await.expect("released");
                        // Only seq 1 was acknowledged.
                        vec![rows[0].id]
                    })
                }),
            )
            .await
        }
    });
    assert_eq!(handed_rx.await.expect("round A publishes"), vec![1, 2]);

    // Meanwhile round B gets nothing of o1: its seq 3 waits behind 1 and 2. SQLite's
    // relays lease rows, so B takes o2's row; PostgreSQL's take turns (one relay
    // transaction at a time), so B gets no turn and takes nothing.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let RelayRound {
        taken,
        marked,
        standby,
    } = l
        .relay_round(&claim_request("relay-b", LONG, 10), ack_all(seen.clone()))
        .await
        .expect("round B");
    let b_seen = seen.lock().expect("seen").clone();
    let expected = match h.raw {
        Raw::Sqlite(_) => 1,
        #[cfg(feature = "integration")]
        Raw::Postgres(_) => 0,
    };
    assert_eq!((taken, marked), (expected, expected));
    assert_eq!(standby, expected == 0, "PostgreSQL stands by for the turn");
    assert_eq!(b_seen.len(), expected);
    assert!(
        b_seen.iter().all(|(op, _)| *op != Some(op1)),
        "nothing of o1 while round A holds it: {b_seen:?}"
    );
    // Nor does a leasing claim take any of o1's rows meanwhile.
    let leased = l
        .claim_results(&claim_request("relay-c", LONG, 10))
        .await
        .expect("claim");
    assert!(
        leased.iter().all(|r| r.operation_id != Some(op1)),
        "nothing of o1 while round A holds it: {leased:?}"
    );
    l.mark_published(&leased.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .expect("mark");

    release.send(()).expect("round A waits");
    let RelayRound { taken, marked, .. } = a.await.expect("round A").expect("round A");
    assert_eq!((taken, marked), (2, 1));
    // Seq 2 was not acknowledged: it goes again, before seq 3 (on PostgreSQL at once, the
    // round's turn over; with a written lease once it ran out).
    seen.lock().expect("seen").clear();
    let started = std::time::Instant::now();
    while l
        .relay_round(&claim_request("relay-b", LONG, 10), ack_all(seen.clone()))
        .await
        .expect("round C")
        .taken
        == 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "seq 2 never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // o1's rows in order; o2's too if round B had no turn.
    let c_seen = seen.lock().expect("seen").clone();
    let o1_rows: Vec<_> = c_seen.iter().filter(|(op, _)| *op == Some(op1)).collect();
    assert_eq!(o1_rows, vec![&(Some(op1), 2), &(Some(op1), 3)]);
    assert_eq!(c_seen.len(), 2 + 1 - expected, "{c_seen:?}");
    assert_eq!(
        h.count("SELECT COUNT(*) FROM result_outbox WHERE published_at IS NULL")
            .await,
        0
    );

    // A round that hangs in its publish for longer than its lease loses its rows.
    l.ingest(&[pay("e3", "o3", "3")]).await.expect("ingest");
    let lease = Duration::from_secs(1);
    let (handed, handed_rx) = tokio::sync::oneshot::channel::<()>();
    let hung = tokio::spawn({
        let l = l.clone();
        async move {
            l.relay_round(
                &claim_request("relay-hung", lease, 10),
                Box::new(move |rows| {
                    Box::pin(async move {
                        handed.send(()).expect("test waits");
                        tokio::time::sleep(Duration::from_secs(4)).await;
                        rows.iter().map(|r| r.id).collect()
                    })
                }),
            )
            .await
        }
    });
    handed_rx.await.expect("the hung round took the row");
    let started = std::time::Instant::now();
    seen.lock().expect("seen").clear();
    let taken = loop {
        let RelayRound { taken, .. } = l
            .relay_round(&claim_request("relay-d", LONG, 10), ack_all(seen.clone()))
            .await
            .expect("round D");
        if taken > 0 || started.elapsed() > Duration::from_secs(10) {
            break taken;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(taken, 1, "the row comes back once the lease ran out");
    assert!(
        started.elapsed() >= Duration::from_millis(700),
        "not before the lease ran out ({:?})",
        started.elapsed()
    );
    // The hung round ends one way or the other (on PostgreSQL its session was ended);
    // either way the row stays published, once.
    let _ = hung.await.expect("hung round");
    assert_eq!(
        h.count("SELECT COUNT(*) FROM result_outbox WHERE published_at IS NULL")
            .await,
        0
    );
}

/// The schema's state lists (the per-entity index, the lease and reconcile indexes) say
/// exactly what `Status` says; a state added to one and not the other fails here.
async fn the_schemas_state_lists_are_the_state_machines(h: Harness) {
    let definition = |index: &str| {
        let sql = match h.dialect() {
            "sqlite" => format!("SELECT sql FROM sqlite_master WHERE name = '{index}'"),
            // This test's schema only: another test's schema may be dropped meanwhile,
            // and its index's definition then fails to print.
            _ => format!(
                "SELECT indexdef FROM pg_indexes \
                 WHERE indexname = '{index}' AND schemaname = current_schema()"
            ),
        };
        let h = &h;
        async move { h.text(&sql).await }
    };
    type Listed = fn(Status) -> bool;
    let checks: [(&str, Listed); 3] = [
        ("operations_one_write_in_flight", Status::holds_entity),
        ("operations_reconcile", Status::is_reconcilable),
        ("operations_lease", |s| s == Status::Dispatched),
    ];
    for (index, listed) in checks {
        let def = definition(index).await;
        for status in Status::ALL {
            assert_eq!(
                def.contains(&format!("'{}'", status.as_str())),
                listed(status),
                "{index} and Status disagree on {status}: {def}"
            );
        }
    }
}

/// For every state: a second write on the entity can be dispatched exactly when the
/// first one's state does not hold the entity — the schema itself says so.
async fn two_writes_on_one_entity_conflict_exactly_when_the_first_holds_it(h: Harness) {
    let l = h.ledger.as_ref();
    for (i, status) in Status::ALL.into_iter().enumerate() {
        let order = format!("o{i}");
        let out = l
            .ingest(&[
                pay(&format!("a{i}"), &order, "1"),
                pay(&format!("b{i}"), &order, "2"),
            ])
            .await
            .expect("ingest");
        let ids: Vec<String> = out
            .iter()
            .map(|o| {
                o.operation
                    .as_ref()
                    .expect("operation")
                    .operation_id
                    .to_string()
            })
            .collect();
        h.set_status(status.as_str(), &format!("operation_id = '{}'", ids[0]))
            .await
            .expect("the first write takes any state");
        let second = h
            .set_status("dispatched", &format!("operation_id = '{}'", ids[1]))
            .await;
        assert_eq!(
            second.is_err(),
            status.holds_entity(),
            "{status}: {second:?}"
        );
    }
}

/// Whether `changes` fires within `wait`.
async fn woken(changes: &mut opgate_store::Changes, wait: Duration) -> bool {
    tokio::time::timeout(wait, changes.changed()).await.is_ok()
}

async fn commits_that_make_work_wake_the_workers(h: Harness) {
    let l = h.ledger.as_ref();
    let quiet = Duration::from_millis(150);
    let soon = Duration::from_secs(5);
    let mut here = l.changes();
    // On PostgreSQL a second process's ledger hears this one's commits through NOTIFY.
    let other = h.another_process().await;
    let mut there = other.changes();
    // The listener is up once it hears a commit; wait for that before counting wakes.
    if h.dialect() == "postgres" {
        let mut ready = false;
        for n in 0..50 {
            l.ingest(&[pay(&format!("warm{n}"), "warm", "1")])
                .await
                .expect("ingest");
            if woken(&mut there, Duration::from_millis(100)).await {
                ready = true;
                break;
            }
        }
        assert!(ready, "the other process's listener never heard a commit");
    }
    here.seen();
    there.seen();
    assert!(!woken(&mut here, quiet).await, "nothing committed yet");

    l.ingest(&[pay("e1", "o1", "49.00")]).await.expect("ingest");
    assert!(
        woken(&mut here, soon).await,
        "an ingest commit wakes this process"
    );
    if h.dialect() == "postgres" {
        assert!(woken(&mut there, soon).await, "and the other process");
        // Its own commits do not echo back as a second wake-up.
        assert!(!woken(&mut there, quiet).await, "one commit, one wake-up");
    }
    assert!(!woken(&mut here, quiet).await, "one commit, one wake-up");

    // A claim makes no work for anyone else: no wake-up.
    let claim = claim_one(l, "d1").await;
    assert!(!woken(&mut here, quiet).await, "a claim is not a wake-up");

    // The outcome's commit frees the entity and writes a result: a wake-up.
    record_ok(
        l,
        Recording::new(
            claim.operation.operation_id,
            claim.epoch(),
            Event::Succeed,
            "committed",
        ),
    )
    .await;
    assert!(woken(&mut here, soon).await, "a recorded outcome wakes");

    // A commit by the other process wakes this one (PostgreSQL) — never a lost write:
    // whatever the signal, the work is in the ledger for the next poll.
    other
        .ingest(&[pay("e2", "o2", "49.00")])
        .await
        .expect("ingest");
    if h.dialect() == "postgres" {
        assert!(
            woken(&mut here, soon).await,
            "another process's commit wakes this one"
        );
    }
    let warm = i64::from(h.dialect() == "postgres");
    assert_eq!(ops_count(&h).await, 2 + warm);
}

/// What the operator console reads: ingest decisions and unknown outcomes over a window
/// (`activity`), an operation's result rows (`results`) and the ids an id prefix covers
/// (`ids_between`).
async fn the_console_reads_activity_results_and_id_ranges(h: Harness) {
    let l = h.ledger.as_ref();
    let out = l
        .ingest(&[
            pay("e1", "o1", "1"),
            pay("e2", "o2", "2"),
            pay("e3", "o1", "1.00"),
        ])
        .await
        .expect("ingest");
    assert_eq!(
        out[2].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        }
    );
    let first = out[0].operation.as_ref().expect("op").operation_id;
    let second = out[1].operation.as_ref().expect("op").operation_id;
    let claim = claim_one(l, "w").await;
    let unknown = claim.operation.operation_id;
    record_ok(
        l,
        Recording::new(
            unknown,
            claim.operation.lease_epoch,
            Event::OutcomeUnknown,
            "timeout_after_send",
        ),
    )
    .await;
    l.apply(&Command {
        operation_id: unknown,
        event: Event::Resolve(Resolution::Noop),
        actor: "ops".into(),
        reason: "seen at the provider".into(),
        result: None,
    })
    .await
    .expect("resolve");

    let now = l.stats().await.expect("stats").now;
    let a = l
        .activity(now - time::Duration::hours(1))
        .await
        .expect("activity");
    let decisions: BTreeMap<(String, Option<String>), i64> = a
        .decisions
        .iter()
        .map(|d| ((d.decision.clone(), d.reason.clone()), d.count))
        .collect();
    assert_eq!(
        decisions,
        BTreeMap::from([
            (("accepted".into(), None), 2),
            (("deduplicated".into(), Some("key".into())), 1)
        ])
    );
    assert_eq!(a.unknown_entered, 1);
    assert_eq!(a.unknown_exits.len(), 1);
    let exit = &a.unknown_exits[0];
    assert_eq!((exit.to.as_str(), exit.by_person), ("completed_noop", true));
    assert!(exit.waited_ms.is_some_and(|ms| ms >= 0), "{exit:?}");
    assert!(a.since < a.now);
    // A window that starts after it all holds nothing.
    let later = l
        .activity(now + time::Duration::minutes(1))
        .await
        .expect("activity");
    assert!(later.decisions.is_empty() && later.unknown_exits.is_empty());
    assert_eq!(later.unknown_entered, 0);

    let results = l.results(unknown).await.expect("results");
    let statuses: Vec<&str> = results.iter().map(|r| r.status.as_str()).collect();
    // The operation's own answer, then the duplicate's answer (the same operation), then
    // one per state change.
    assert_eq!(
        statuses,
        [
            "pending_dispatch",
            "pending_dispatch",
            "dispatched",
            "unknown_outcome",
            "completed_noop"
        ]
    );
    assert!(results.windows(2).all(|w| w[0].seq <= w[1].seq));
    assert!(results.iter().all(|r| r.published_at.is_none()));
    publish_all(l).await;
    let results = l.results(unknown).await.expect("results");
    assert!(
        results
            .iter()
            .all(|r| r.published_at.is_some_and(|p| p >= r.created_at))
    );
    assert!(l.results(uuid::Uuid::nil()).await.expect("none").is_empty());

    // Ranges through the primary key, in id order.
    let mut all = vec![first, second];
    all.sort();
    assert_eq!(
        l.ids_between(uuid::Uuid::nil(), uuid::Uuid::max(), 10)
            .await
            .expect("all"),
        all
    );
    assert_eq!(l.ids_between(first, first, 10).await.expect("one"), [first]);
    assert_eq!(
        l.ids_between(uuid::Uuid::nil(), uuid::Uuid::max(), 1)
            .await
            .expect("limit")
            .len(),
        1
    );
    let (low, high) =
        opgate_core::operation::id_prefix_range(&first.to_string()[..13]).expect("prefix");
    assert!(
        l.ids_between(low, high, 10)
            .await
            .expect("prefix")
            .contains(&first)
    );
    assert!(
        l.ids_between(high, low, 10)
            .await
            .expect("empty")
            .is_empty()
    );
}

/// Ingest writes an inbox row with the decision it expects (accepted, naming the operation
/// it creates; a refusal it knows) and rewrites the rows that end otherwise: each row
/// holds the final decision and operation, and a redelivery reads them back.
async fn each_inbox_row_holds_its_proposals_final_decision(h: Harness) {
    let l = h.ledger.as_ref();
    let batch = [
        // New: accepted, with its operation.
        pay("e1", "o1", "49.00"),
        // The same payment re-spelled: the key's duplicate, naming e1's operation.
        pay("e2", "o1", "49.0"),
        // An unknown tool: refused before the ledger.
        item("e3", "no_such_tool", ("order", "o1"), json!({})),
        // A new payment in the same batch as its duplicate below.
        pay("e4", "o2", "5"),
        pay("e5", "o2", "5.00"),
    ];
    let out = l.ingest(&batch).await.expect("ingest");
    let op = |i: usize| {
        out[i]
            .operation
            .as_ref()
            .map(|o| o.operation_id)
            .expect("an operation")
    };
    assert_eq!(out[0].decision, IngestDecision::Accepted);
    assert_eq!(
        out[1].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        }
    );
    assert_eq!(op(1), op(0));
    assert!(matches!(out[2].decision, IngestDecision::Rejected { .. }));
    assert_eq!(out[3].decision, IngestDecision::Accepted);
    assert_eq!(op(4), op(3));
    assert_eq!(ops_count(&h).await, 2);
    let row = |event: &str, decision: &str, reason: &str, operation: Option<uuid::Uuid>| {
        let operation = match operation {
            Some(id) => format!("operation_id = '{id}'"),
            None => "operation_id IS NULL".into(),
        };
        let reason = match reason {
            "" => "reason IS NULL".into(),
            r => format!("reason = '{r}'"),
        };
        format!(
            "SELECT COUNT(*) FROM inbox WHERE source_id LIKE '%/{event}' \
             AND decision = '{decision}' AND {reason} AND {operation}"
        )
    };
    let rejected_reason = match &out[2].decision {
        IngestDecision::Rejected { reason } => reason.clone(),
        other => panic!("refused: {other:?}"),
    };
    for (sql, what) in [
        (row("e1", "accepted", "", Some(op(0))), "e1 accepted"),
        (
            row("e2", "deduplicated", "key", Some(op(0))),
            "e2 a key hit",
        ),
        (row("e3", "rejected", &rejected_reason, None), "e3 refused"),
        (row("e4", "accepted", "", Some(op(3))), "e4 accepted"),
        (
            row("e5", "deduplicated", "key", Some(op(3))),
            "e5 a key hit",
        ),
    ] {
        assert_eq!(h.count(&sql).await, 1, "{what}: {sql}");
    }
    assert_eq!(h.count("SELECT COUNT(*) FROM inbox").await, 5);
    // A redelivery of the whole batch reads every decision back from the inbox.
    let again = l.ingest(&batch).await.expect("redeliver");
    for (first, second) in out.iter().zip(&again) {
        assert!(second.inbox_hit, "{second:?}");
        assert_eq!(second.decision, first.decision);
        assert_eq!(
            second.operation.as_ref().map(|o| o.operation_id),
            first.operation.as_ref().map(|o| o.operation_id)
        );
    }
}

/// Claim at ingest ([`Ledger::ingest_and_claim`]): of the operations a batch creates, it
/// claims those a claim would (ready, head of line on their entity, within the limit and
/// each tool's room), with the same rows a claim writes; everything else waits for a
/// dispatcher's claim, and what already existed is never claimed by an ingest.
async fn an_ingest_claims_what_it_created_as_a_claim_would(h: Harness) {
    let l = h.ledger.as_ref();
    // An operation of entity A in flight already, and one of entity C settled.
    l.ingest(&[pay("a0", "A", "1")]).await.expect("ingest");
    let held = claim_one(l, "elsewhere").await;
    let mut request = claim_request("d1", LONG, 10);
    request.tool_room = BTreeMap::from([
        ("pay".to_owned(), 3),
        ("ticket".to_owned(), 0),
        ("lookup".to_owned(), 5),
        ("refund".to_owned(), 5),
    ]);
    let batch = vec![
        pay("a1", "A", "2"), // A is held: waits
        pay("b1", "B", "1"), // claimed
        pay("b2", "B", "2"), // behind b1: waits
        item_with(
            "t1",
            "ticket",
            ("order", "T"),
            json!({"title": "Refund"}),
            json!({"workflow_id": "wf-t", "step": 1}),
        ), // no room for tickets: waits
        item("r1", "refund", ("order", "R"), json!({"amount": 5})), // parked for approval
        item("l1", "lookup", ("order", "A"), json!({})), // a read: never waits
        pay("c1", "C", "1"), // claimed
        pay("d1", "D", "1"), // claimed (third of pay's room)
        pay("e1", "E", "1"), // pay's room is used up: waits
        pay("a0", "A", "1"), // a redelivery: not claimed
        pay("a0", "Z", "9"), // a reused event id with other content: refused
    ];
    let (outcomes, claims) = l
        .ingest_and_claim(&batch, Duration::from_secs(5), &request)
        .await
        .expect("ingest and claim");
    assert_eq!(outcomes.len(), batch.len());
    let claimed: Vec<&str> = claims
        .iter()
        .map(|c| c.operation.event_id.as_str())
        .collect();
    assert_eq!(claimed, ["b1", "l1", "c1", "d1"], "in queue order");
    for c in &claims {
        let op = &c.operation;
        assert_eq!(op.status, Status::Dispatched);
        assert_eq!(op.lease_owner.as_deref(), Some("d1"));
        assert_eq!(op.attempt_count, 1);
        assert_eq!(op.lease_epoch, 1);
        assert_eq!(
            op.lease_expires_at,
            Some(c.claimed_at + time::Duration::seconds(300)),
            "the lease runs from the ingest's clock read"
        );
        assert_eq!(c.first_attempt_at, Some(op.created_at));
        assert!(c.attempt_id.is_some(), "an attempt row before any send");
        // Each outcome reports its operation as claimed.
        let outcome = outcomes
            .iter()
            .find(|o| o.event_id == op.event_id)
            .expect("outcome");
        assert_eq!(
            outcome.operation.as_ref().map(|o| o.status),
            Some(Status::Dispatched)
        );
        // The history and the results say ingested, then claimed, in order.
        let history = l.events(op.operation_id).await.expect("history");
        let reasons: Vec<&str> = history.iter().map(|e| e.reason.as_str()).collect();
        assert_eq!(reasons, ["ingested", "claimed"], "{}", op.event_id);
    }
    // The reused id is refused and creates nothing to claim.
    assert_eq!(
        outcomes[10].decision,
        IngestDecision::Rejected {
            reason: "event_id_conflict".into()
        }
    );
    assert!(outcomes[10].operation.is_none());
    // The redelivered a0 is an inbox hit, untouched: still leased to "elsewhere".
    let a0 = l
        .operation(held.operation.operation_id)
        .await
        .expect("read")
        .expect("a0");
    assert_eq!(a0.lease_owner.as_deref(), Some("elsewhere"));
    assert_eq!(a0.lease_epoch, held.epoch());
    assert!(outcomes[9].inbox_hit);
    // What waits is a dispatcher's to claim, as before: e1 now (room), t1 with room.
    let mut next = l
        .claim(&claim_request("d2", LONG, 10))
        .await
        .expect("claim");
    next.sort_by(|x, y| x.operation.event_id.cmp(&y.operation.event_id));
    let rest: Vec<&str> = next.iter().map(|c| c.operation.event_id.as_str()).collect();
    assert_eq!(
        rest,
        ["e1", "t1"],
        "b2 waits behind b1, a1 behind a0, r1 for approval"
    );
    let r1 = outcomes[4].operation.as_ref().expect("r1");
    assert_eq!(r1.status, Status::AwaitingApproval);
    // A second ingest with no room at all claims nothing and writes as a plain ingest.
    let mut none = claim_request("d1", LONG, 0);
    none.tool_room = BTreeMap::from([("pay".to_owned(), 5)]);
    let (outcomes, claims) = l
        .ingest_and_claim(&[pay("f1", "F", "1")], Duration::from_secs(5), &none)
        .await
        .expect("ingest");
    assert!(claims.is_empty());
    assert_eq!(
        outcomes[0].operation.as_ref().map(|o| o.status),
        Some(Status::PendingDispatch)
    );
}

/// A claimed operation's duplicate later in the same batch: the operation is written
/// claimed, then the duplicate's answer follows its results (accepted 1, dispatched 2,
/// the dedupe hit 3), and the claim handed to the dispatcher is the operation as the batch
/// left it.
async fn a_duplicate_of_an_operation_claimed_in_its_batch_is_answered_after_the_claim(h: Harness) {
    let l = h.ledger.as_ref();
    let (outcomes, claims) = l
        .ingest_and_claim(
            &[pay("k1", "B", "5"), pay("k2", "B", "5")],
            Duration::from_secs(5),
            &claim_request("d", LONG, 5),
        )
        .await
        .expect("ingest and claim");
    assert_eq!(claims.len(), 1);
    assert_eq!(outcomes[0].decision, IngestDecision::Accepted);
    assert_eq!(
        outcomes[1].decision,
        IngestDecision::Deduplicated {
            reason: "key".into()
        }
    );
    let id = claims[0].operation.operation_id;
    let results: Vec<(i64, String)> = l
        .results(id)
        .await
        .expect("results")
        .into_iter()
        .map(|r| (r.seq, r.status))
        .collect();
    assert_eq!(
        results,
        [
            (1, "pending_dispatch".to_owned()),
            (2, "dispatched".to_owned()),
            (3, "dispatched".to_owned())
        ]
    );
    let stored = l.operation(id).await.expect("read").expect("operation");
    assert_eq!(stored.result_seq, 3);
    assert_eq!(
        claims[0].operation, stored,
        "the claim as the batch left it"
    );
    assert_eq!(outcomes[0].operation.as_ref(), Some(&stored));
    assert_eq!(outcomes[1].operation.as_ref(), Some(&stored));
}

/// A claim at ingest reads which entities are busy before it waits on other transactions'
/// rows: a write of the same entity that another transaction commits meanwhile, waiting,
/// must not be overtaken (the one-write-in-flight index does not see a waiting write).
/// Here the claiming ingest waits for its event's inbox row, which another transaction
/// holds (as a second ingest of the same record would, during a rebalance), while an
/// earlier write of its entity commits without a claim. PostgreSQL only: SQLite runs one
/// writer at a time, so nothing commits while a transaction waits.
#[cfg(feature = "integration")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_an_ingest_claim_never_overtakes_a_write_committed_while_it_waited() {
    let h = support::postgres().await;
    let Raw::Postgres(pool) = &h.raw else {
        panic!("a PostgreSQL harness");
    };
    let w2 = pay("w2", "E", "2");
    let mut holder = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO inbox (source_id, decision, received_at) VALUES ($1, 'accepted', now())",
    )
    .bind(w2.inbox_key())
    .execute(&mut *holder)
    .await
    .expect("hold w2's inbox row");
    let holder_xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut *holder)
        .await
        .expect("the holder's transaction id");
    let ledger = h.ledger.clone();
    let claiming = tokio::spawn(async move {
        ledger
            .ingest_and_claim(&[w2], Duration::from_secs(30), &claim_request("d", LONG, 5))
            .await
    });
    // Until the claiming ingest waits for the holder's transaction (for w2's row; it has
    // read E as free by then). Only a wait on this very transaction counts, not another
    // test's lock wait.
    let waiting = format!(
        "SELECT COUNT(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid' \
         AND transactionid::text = '{holder_xid}'"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.count(&waiting).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the ingest never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // An earlier write of E commits, waiting for a dispatcher's claim.
    h.ledger.ingest(&[pay("w1", "E", "1")]).await.expect("w1");
    holder.rollback().await.expect("release w2's row");
    let (outcomes, claims) = claiming.await.expect("task").expect("ingest and claim");
    assert!(claims.is_empty(), "w2 overtook w1: {claims:?}");
    assert_eq!(
        outcomes[0].operation.as_ref().map(|o| o.status),
        Some(Status::PendingDispatch)
    );
    // The dispatcher takes w1 first; w2 waits behind it.
    let next = h
        .ledger
        .claim(&claim_request("d2", LONG, 10))
        .await
        .expect("claim");
    let taken: Vec<&str> = next.iter().map(|c| c.operation.event_id.as_str()).collect();
    assert_eq!(taken, ["w1"]);
}

/// Two ingests creating writes of one entity at once: at most one of them claims, the
/// other's operation waits behind it (the unique index on writes in flight decides a
/// race the head-of-line read cannot see; the loser's transaction is retried).
async fn racing_ingest_claims_never_put_two_writes_of_one_entity_in_flight(h: Harness) {
    let ledger = h.ledger.clone();
    for round in 0..8 {
        let order = format!("R{round}");
        let mut tasks = tokio::task::JoinSet::new();
        for n in 0..4 {
            let (l, order) = (ledger.clone(), order.clone());
            tasks.spawn(async move {
                let item = pay(&format!("r{round}-{n}"), &order, &n.to_string());
                l.ingest_and_claim(
                    &[item],
                    Duration::from_secs(5),
                    &claim_request(&format!("d{n}"), LONG, 5),
                )
                .await
                .expect("ingest and claim")
                .1
                .len()
            });
        }
        let mut claimed = 0;
        while let Some(n) = tasks.join_next().await {
            claimed += n.expect("task");
        }
        assert_eq!(claimed, 1, "round {round}: one write of {order} in flight");
        let in_flight = h
            .count(&format!(
                "SELECT COUNT(*) FROM operations WHERE entity_id = '{order}' AND status = 'dispatched'"
            ))
            .await;
        assert_eq!(in_flight, 1, "round {round}");
    }
}

/// The dispatcher's wake-up ([`Ledger::claimable_changes`]) comes from commits that may
/// have left something to claim, not from every commit: an ingest that claimed all it
/// created, or one that created nothing, and a recording that freed no waiting write,
/// leave it asleep; the relay's view ([`Ledger::changes`]) hears every one.
async fn only_commits_that_leave_work_claimable_wake_the_dispatcher(h: Harness) {
    let l = h.ledger.as_ref();
    let quiet = Duration::from_millis(150);
    let soon = Duration::from_secs(5);
    let mut dispatcher = l.claimable_changes();
    let mut relay = l.changes();
    let settle = |d: &mut opgate_store::Changes, r: &mut opgate_store::Changes| {
        d.seen();
        r.seen();
    };
    settle(&mut dispatcher, &mut relay);

    // Claimed everything it created: the relay has results to publish, no claim to make.
    let (_, claims) = l
        .ingest_and_claim(
            &[pay("e1", "O", "1")],
            Duration::from_secs(5),
            &claim_request("d", LONG, 5),
        )
        .await
        .expect("ingest");
    assert_eq!(claims.len(), 1);
    assert!(woken(&mut relay, soon).await, "results to publish");
    assert!(
        !woken(&mut dispatcher, quiet).await,
        "nothing left to claim"
    );

    // A second write of the same entity, created behind the first: not claimable yet,
    // but an ingest that left an operation unclaimed wakes the dispatcher.
    settle(&mut dispatcher, &mut relay);
    let (_, claims) = l
        .ingest_and_claim(
            &[pay("e2", "O", "2")],
            Duration::from_secs(5),
            &claim_request("d", LONG, 5),
        )
        .await
        .expect("ingest");
    assert!(claims.is_empty(), "behind the write in flight");
    assert!(
        woken(&mut dispatcher, soon).await,
        "an unclaimed operation wakes"
    );

    // A redelivery only: nothing created, nothing to claim.
    settle(&mut dispatcher, &mut relay);
    l.ingest(&[pay("e1", "O", "1")]).await.expect("redelivery");
    assert!(
        !woken(&mut dispatcher, quiet).await,
        "a redelivery makes no work"
    );

    // The first write settles while the second waits behind it: a wake-up.
    settle(&mut dispatcher, &mut relay);
    let first = &claims_of(l, "e1").await;
    record_ok(
        l,
        Recording::new(
            first.operation_id,
            first.lease_epoch,
            Event::Succeed,
            "committed",
        ),
    )
    .await;
    assert!(
        woken(&mut dispatcher, soon).await,
        "its entity freed a waiting write"
    );

    // The second settles with nothing behind it: the relay hears it, the dispatcher not.
    let second = claim_one(l, "d").await;
    settle(&mut dispatcher, &mut relay);
    record_ok(
        l,
        Recording::new(
            second.operation.operation_id,
            second.epoch(),
            Event::Succeed,
            "committed",
        ),
    )
    .await;
    assert!(woken(&mut relay, soon).await, "a result to publish");
    assert!(!woken(&mut dispatcher, quiet).await, "no write waits on O");

    // A plain ingest that creates a ready operation wakes it.
    settle(&mut dispatcher, &mut relay);
    l.ingest(&[pay("e3", "P", "1")]).await.expect("ingest");
    assert!(woken(&mut dispatcher, soon).await, "a new ready operation");
}

/// The operation an event created, as it stands.
async fn claims_of(l: &dyn Ledger, event_id: &str) -> opgate_core::Operation {
    let page = l
        .list(&ListFilter {
            limit: Some(100),
            ..Default::default()
        })
        .await
        .expect("list");
    page.operations
        .into_iter()
        .find(|op| op.event_id == event_id)
        .expect("operation of the event")
}
