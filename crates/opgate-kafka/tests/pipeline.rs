//! The Kafka path end to end: proposals topic -> ingest worker -> ledger -> results relay
//! -> results topic, with duplicates, poison messages, killed consumers, broker faults,
//! a relay crash and a rebalance. Plain `cargo test` runs it on librdkafka's mock cluster
//! and SQLite; `--features integration` runs it on a real broker and PostgreSQL.

#![allow(missing_docs)]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use opgate_core::Limits;
use opgate_kafka::config::PROPOSALS;
use opgate_kafka::ingest::{AGENT_HEADER, SIGNATURE_HEADER, TRACEPARENT, sign};
use opgate_kafka::{IngestStats, ResultsRelay};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdkafka::message::Message;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

/// 8000 distinct events over 7000 distinct keys (1000 are the same payment spelled
/// differently) plus 2000 redeliveries: 10,000 records on 8 partitions.
fn ten_thousand(seed: u64) -> (Vec<Out>, usize, usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut originals = Vec::new();
    for i in 0..7000 {
        originals.push(proposal(
            &format!("e{i}"),
            &format!("o{}", i % 700),
            &format!("{}.00", i / 700 + 1),
        ));
    }
    for i in 0..1000 {
        let j = rng.random_range(0..7000);
        originals.push(proposal(
            &format!("d{i}"),
            &format!("o{}", j % 700),
            &format!("{}", j / 700 + 1),
        ));
    }
    let mut redeliveries = Vec::new();
    for _ in 0..2000 {
        let pick = &originals[rng.random_range(0..originals.len())];
        redeliveries.push(raw(&pick.key, &pick.value));
    }
    redeliveries.shuffle(&mut rng);
    let distinct_events = originals.len();
    originals.extend(redeliveries);
    (originals, distinct_events, 7000)
}

fn total(stats: &IngestStats) -> u64 {
    IngestStats::get(&stats.accepted)
        + IngestStats::get(&stats.deduplicated_key)
        + IngestStats::get(&stats.deduplicated_inbox)
        + IngestStats::get(&stats.rejected)
}

async fn assert_exact(env: &Env, events: usize, keys: usize) {
    assert_eq!(
        env.count("SELECT COUNT(*) FROM operations").await,
        keys as i64,
        "one operation per distinct key"
    );
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox").await,
        events as i64,
        "one inbox row per event"
    );
    assert_eq!(
        env.count("SELECT COUNT(*) FROM result_outbox").await,
        events as i64,
        "one result per event"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_proposals_with_duplicates_make_one_operation_per_key() {
    let env = env(8).await;
    let (messages, events, keys) = ten_thousand(7);
    produce(&env, &messages).await;
    let started = Instant::now();
    let worker = start_worker(&env, Limits::default(), 500);
    let stats = worker.stats.clone();
    eventually("all 10,000 records ingested", WAIT, || async {
        total(&stats) >= 10_000
    })
    .await;
    let elapsed = started.elapsed();
    worker.stop().await;
    eprintln!(
        "ingest: 10000 records in {:.2}s = {:.0} proposals/s ({} batches)",
        elapsed.as_secs_f64(),
        10_000.0 / elapsed.as_secs_f64(),
        IngestStats::get(&stats.batches)
    );
    assert_eq!(IngestStats::get(&stats.accepted), keys as u64);
    assert_eq!(
        IngestStats::get(&stats.deduplicated_key),
        (events - keys) as u64
    );
    assert_eq!(IngestStats::get(&stats.deduplicated_inbox), 2000);
    assert_exact(&env, events, keys).await;

    assert_eq!(relay_all(&env).await, events);
    let results = read_topic(&env, RESULTS_TOPIC, events, WAIT).await;
    assert_eq!(
        results.len(),
        events,
        "one result message per proposal event"
    );
    let ids: HashSet<String> = results
        .iter()
        .map(|m| {
            json_of(m)["event_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), events);
    for m in &results {
        let v = json_of(m);
        let entity = format!(
            "{}:{}",
            v["entity"]["type"].as_str().unwrap_or_default(),
            v["entity"]["id"].as_str().unwrap_or_default()
        );
        assert_eq!(
            m.key(),
            Some(entity.as_bytes()),
            "results are keyed by entity"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_messages_are_dead_lettered_and_the_partition_continues() {
    let env = env(2).await;
    let big = json!({"event_id": "big", "tool": "pay", "entity": {"type": "order", "id": "o1"},
        "args": {"amount": "1", "currency": "usd", "note": "x".repeat(2000)}});
    let messages = vec![
        proposal("v1", "o1", "1"),
        raw("order:o1", b"{not json"),
        raw("order:o1", br#"{"event_id": "s1", "entity": {"type": "order", "id": "o1"}, "args": {}}"#),
        raw("order:o1", big.to_string().as_bytes()),
        raw("order:o1", br#"{"event_id": "u1", "tool": "teleport", "entity": {"type": "order", "id": "o1"}, "args": {}}"#),
        proposal("v2", "o1", "2"),
    ];
    produce(&env, &messages).await;
    let limits = Limits {
        max_args_bytes: 1024,
        ..Limits::default()
    };
    let worker = start_worker(&env, limits, 100);
    let stats = worker.stats.clone();
    eventually("six records ingested", WAIT, || async {
        total(&stats) >= 6
    })
    .await;
    worker.stop().await;
    assert_eq!(
        IngestStats::get(&stats.accepted),
        2,
        "the records after the poison were processed"
    );
    assert_eq!(IngestStats::get(&stats.dead_lettered), 4);
    assert_eq!(IngestStats::get(&stats.rejected), 4);

    let letters = read_topic(&env, DLQ_TOPIC, 4, WAIT).await;
    assert_eq!(letters.len(), 4);
    let by_reason: BTreeMap<String, _> = letters
        .iter()
        .map(|m| (headers_of(m)["opgate.dlq.reason"].clone(), m))
        .collect();
    let expected = [
        ("not_json", 1, &messages[1]),
        ("schema_violation", 2, &messages[2]),
        ("oversize", 3, &messages[3]),
        ("unknown_tool", 4, &messages[4]),
    ];
    for (reason, offset, original) in expected {
        let m = by_reason
            .get(reason)
            .unwrap_or_else(|| panic!("no dead letter for {reason}"));
        let h = headers_of(m);
        assert_eq!(
            m.payload(),
            Some(original.value.as_slice()),
            "{reason}: original bytes kept"
        );
        assert_eq!(m.key(), Some(original.key.as_bytes()));
        assert_eq!(h["opgate.dlq.source.topic"], env.topic(PROPOSALS));
        assert_eq!(
            h["opgate.dlq.source.offset"],
            offset.to_string(),
            "{reason}"
        );
        assert!(!h["opgate.dlq.message"].is_empty());
    }
    assert_eq!(
        headers_of(by_reason["schema_violation"])["opgate.dlq.field"],
        "tool"
    );
    assert_eq!(
        headers_of(by_reason["oversize"])["opgate.dlq.field"],
        "args"
    );

    // Every poison record got a result too, so an agent that sent one hears back.
    assert_eq!(
        env.count("SELECT COUNT(*) FROM result_outbox WHERE status = 'rejected'")
            .await,
        4
    );
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE decision = 'rejected'")
            .await,
        4,
        "recorded, never re-processed"
    );
}

#[cfg(not(feature = "integration"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dlq_write_failure_stops_the_partition_until_it_succeeds() {
    use rdkafka::types::RDKafkaRespErr;
    let mut env = env(1).await;
    env.config
        .client
        .insert("message.timeout.ms".into(), "1500".into());
    let dlq = env.topic(DLQ_TOPIC);
    env.mock()
        .topic_error(
            &dlq,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        )
        .expect("inject");
    produce(
        &env,
        &[
            proposal("v1", "o1", "1"),
            raw("order:o1", b"garbage"),
            proposal("v2", "o1", "2"),
        ],
    )
    .await;
    let worker = start_worker(&env, Limits::default(), 1);
    let stats = worker.stats.clone();
    eventually("the first record", WAIT, || async {
        IngestStats::get(&stats.accepted) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        IngestStats::get(&stats.accepted),
        1,
        "nothing after the poison is processed while the DLQ is failing"
    );
    assert_eq!(IngestStats::get(&stats.dead_lettered), 0);
    env.mock()
        .topic_error(&dlq, RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR)
        .expect("heal");
    eventually("the partition resumes", WAIT, || async {
        IngestStats::get(&stats.accepted) == 2
    })
    .await;
    worker.stop().await;
    assert_eq!(IngestStats::get(&stats.dead_lettered), 1);
    assert_eq!(read_topic(&env, DLQ_TOPIC, 1, WAIT).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_mid_batch_loses_and_duplicates_nothing() {
    let env = env(4).await;
    let messages: Vec<Out> = (0..3000)
        .map(|i| {
            proposal(
                &format!("e{i}"),
                &format!("o{}", i % 300),
                &format!("{}", i / 300 + 1),
            )
        })
        .collect();
    produce(&env, &messages).await;
    // First kill: exactly between a ledger commit and the offset commit.
    let crashing = start_worker_with(&env, Limits::default(), 50, Some(3));
    let crashed = crashing.handle.await.expect("join");
    assert!(
        matches!(crashed, Err(opgate_kafka::Error::Crashed)),
        "{crashed:?}"
    );
    // Then kills at arbitrary points: the task is dropped wherever it is, mid-transaction
    // or mid-poll, without leaving the group.
    let mut kills = 1;
    let mut all_stats = Vec::new();
    for _ in 0..2 {
        let worker = start_worker(&env, Limits::default(), 50);
        let stats = worker.stats.clone();
        all_stats.push(stats.clone());
        eventually("some batches", WAIT, || async {
            IngestStats::get(&stats.batches) >= 3
        })
        .await;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..20))).await;
        worker.handle.abort();
        let _ = worker.handle.await;
        kills += 1;
    }
    let survivor = start_worker(&env, Limits::default(), 500);
    eventually("every event in the ledger", WAIT, || async {
        env.count("SELECT COUNT(*) FROM inbox").await == 3000
    })
    .await;
    all_stats.push(survivor.stats.clone());
    survivor.stop().await;
    let redelivered: u64 = all_stats
        .iter()
        .map(|s| IngestStats::get(&s.deduplicated_inbox))
        .sum();
    assert_eq!(kills, 3);
    assert!(
        redelivered > 0,
        "the crash point left committed-but-unacknowledged records to redeliver"
    );
    eprintln!("after 3 kills the later workers saw {redelivered} redelivered records");
    assert_exact(&env, 3000, 3000).await;
}

#[cfg(not(feature = "integration"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_faults_are_survived_without_loss_or_duplicates() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let env = env(4).await;
    let messages: Vec<Out> = (0..2000)
        .map(|i| {
            proposal(
                &format!("e{i}"),
                &format!("o{}", i % 200),
                &format!("{}", i / 200 + 1),
            )
        })
        .collect();
    produce(&env, &messages[..1000]).await;
    let worker = start_worker(&env, Limits::default(), 100);
    let stats = worker.stats.clone();
    eventually("ingest under way", WAIT, || async {
        IngestStats::get(&stats.batches) >= 2
    })
    .await;
    let mock = env.mock();
    mock.request_errors(
        RDKafkaApiKey::Fetch,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION; 5],
    )
    .expect("fetch errors");
    mock.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT; 3],
    )
    .expect("commit errors");
    mock.broker_down(1).expect("down");
    tokio::time::sleep(Duration::from_secs(2)).await;
    mock.broker_up(1).expect("up");
    produce(&env, &messages[1000..]).await;
    eventually("every event in the ledger", WAIT, || async {
        env.count("SELECT COUNT(*) FROM inbox").await == 2000
    })
    .await;
    worker.stop().await;
    assert_exact(&env, 2000, 2000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_crash_between_publish_and_mark_only_repeats_identical_results() {
    let env = env(2).await;
    let messages: Vec<Out> = (0..100)
        .map(|i| proposal(&format!("e{i}"), &format!("o{i}"), "1"))
        .collect();
    produce(&env, &messages).await;
    let worker = start_worker(&env, Limits::default(), 500);
    let stats = worker.stats.clone();
    eventually("ingest", WAIT, || async { total(&stats) >= 100 }).await;
    worker.stop().await;

    // Relay A leases (for 300 ms) and publishes, then dies before marking.
    let crashed = ResultsRelay::new(
        &env.config,
        env.ledger.clone(),
        "relay-a",
        500,
        ResultsRelay::default_lease(&env.config).expect("lease"),
    )
    .expect("relay");
    let rows = env
        .ledger
        .claim_results(&opgate_store::ClaimRequest {
            owner: "relay-a".into(),
            lease: Duration::from_millis(300),
            limit: 500,
            ..Default::default()
        })
        .await
        .expect("lease");
    let lease_ends = tokio::time::Instant::now() + Duration::from_secs(60);
    assert_eq!(crashed.publish(rows, lease_ends).await.len(), 100);
    drop(crashed);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Relay B takes over once the lease has expired.
    assert_eq!(relay_all(&env).await, 100);

    let results = read_topic(&env, RESULTS_TOPIC, 200, WAIT).await;
    assert_eq!(results.len(), 200, "every result published twice");
    let mut copies: BTreeMap<(String, String, i64), Vec<serde_json::Value>> = BTreeMap::new();
    for m in &results {
        let v = json_of(m);
        let key = (
            v["operation_id"].as_str().unwrap_or_default().to_owned(),
            v["status"].as_str().unwrap_or_default().to_owned(),
            v["seq"].as_i64().unwrap_or(-1),
        );
        copies.entry(key).or_default().push(v);
    }
    assert_eq!(
        copies.len(),
        100,
        "consumers deduping on (operation_id, status, seq) see each result once"
    );
    for (key, versions) in copies {
        assert_eq!(versions.len(), 2, "{key:?}");
        assert_eq!(versions[0], versions[1], "copies are identical");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_keeps_the_totals_exact() {
    let env = env(6).await;
    let messages: Vec<Out> = (0..4000)
        .map(|i| {
            proposal(
                &format!("e{i}"),
                &format!("o{}", i % 400),
                &format!("{}", i / 400 + 1),
            )
        })
        .collect();
    let first = start_worker(&env, Limits::default(), 100);
    let second = start_worker(&env, Limits::default(), 100);
    produce(&env, &messages[..2000]).await;
    let (s1, s2) = (first.stats.clone(), second.stats.clone());
    eventually("both workers busy", WAIT, || async {
        total(&s1) + total(&s2) >= 1000
    })
    .await;
    first.stop().await; // leaves the group mid-stream; its partitions move to the second
    produce(&env, &messages[2000..]).await;
    eventually("every event in the ledger", WAIT, || async {
        env.count("SELECT COUNT(*) FROM inbox").await == 4000
    })
    .await;
    second.stop().await;
    assert_exact(&env, 4000, 4000).await;
    assert_eq!(
        IngestStats::get(&s1.accepted) + IngestStats::get(&s2.accepted),
        4000
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_are_carried_into_the_operation() {
    let env = env(1).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut traced = proposal("t1", "o1", "1");
    traced.headers = vec![
        (TRACEPARENT.into(), traceparent.into()),
        (AGENT_HEADER.into(), "billing-bot".into()),
    ];
    let mut mismatch = raw(
        "order:o2",
        json!({"event_id": "t2", "agent_id": "support-bot", "tool": "pay",
        "entity": {"type": "order", "id": "o2"}, "args": {"amount": "1", "currency": "usd"}})
        .to_string()
        .as_bytes(),
    );
    mismatch.headers = vec![(AGENT_HEADER.into(), "billing-bot".into())];
    produce(&env, &[traced, mismatch]).await;
    let worker = start_worker(&env, Limits::default(), 10);
    let stats = worker.stats.clone();
    eventually("both ingested", WAIT, || async { total(&stats) >= 2 }).await;
    worker.stop().await;
    let page = env
        .ledger
        .list(&opgate_store::ListFilter::default())
        .await
        .expect("list");
    assert_eq!(page.operations.len(), 1);
    let op = &page.operations[0];
    assert_eq!(op.traceparent.as_deref(), Some(traceparent));
    assert_eq!(op.agent_id.as_deref(), Some("billing-bot"));
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE reason = 'agent_mismatch'")
            .await,
        1
    );
    relay_all(&env).await;
    let results = read_topic(&env, RESULTS_TOPIC, 2, WAIT).await;
    let traced = results
        .iter()
        .find(|m| json_of(m)["event_id"] == "t1")
        .expect("result");
    assert_eq!(
        headers_of(traced)[TRACEPARENT],
        traceparent,
        "the trace continues on the result"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_signing_agent_s_unsigned_or_wrongly_signed_proposals_are_dead_lettered() {
    let mut env = env(1).await;
    let secret = "billing-signing-secret-0123";
    env.registry = std::sync::Arc::new(
        opgate_core::Registry::from_toml(&format!(
            "{TOOLS}\n[[agents]]\nid = \"billing-bot\"\ntools = [\"pay\"]\nsigning_secret = \"{secret}\"\n"
        ))
        .expect("registry"),
    );
    let signed = |event: &str, order: &str, signature: Option<String>| {
        let mut out = raw(
            &format!("order:{order}"),
            json!({"event_id": event, "namespace": "acme", "agent_id": "billing-bot", "tool": "pay",
                "entity": {"type": "order", "id": order}, "args": {"amount": "1", "currency": "usd"}})
            .to_string()
            .as_bytes(),
        );
        let signature = signature.unwrap_or_else(|| sign(secret.as_bytes(), &out.value));
        out.headers = vec![(SIGNATURE_HEADER.into(), signature)];
        out
    };
    let good = signed("s1", "o1", None);
    let mut unsigned = signed("s2", "o2", None);
    unsigned.headers.clear();
    let wrong_key = signed("s3", "o3", Some(sign(b"another-secret-0123456", b"x")));
    // A signature of another value (a replayed header on edited content).
    let replayed = signed("s4", "o4", Some(good.headers[0].1.clone()));
    // The agent header names the signing agent though the body does not.
    let mut by_header = proposal("s5", "o5", "1");
    by_header.headers = vec![(AGENT_HEADER.into(), "billing-bot".into())];
    produce(&env, &[good, unsigned, wrong_key, replayed, by_header]).await;
    let worker = start_worker(&env, Limits::default(), 10);
    let stats = worker.stats.clone();
    eventually("five records decided", WAIT, || async {
        total(&stats) >= 5
    })
    .await;
    worker.stop().await;
    assert_eq!(
        IngestStats::get(&stats.accepted),
        1,
        "only the signed proposal"
    );
    assert_eq!(IngestStats::get(&stats.dead_lettered), 4);
    let letters = read_topic(&env, DLQ_TOPIC, 4, WAIT).await;
    let reasons: Vec<String> = letters
        .iter()
        .map(|m| headers_of(m)["opgate.dlq.reason"].clone())
        .collect();
    assert_eq!(reasons, vec!["bad_signature"; 4], "{reasons:?}");
    assert_eq!(
        env.count("SELECT COUNT(*) FROM inbox WHERE reason = 'bad_signature'")
            .await,
        4,
        "each refusal is decided once in the inbox, so a redelivery is not re-examined"
    );
    let page = env
        .ledger
        .list(&opgate_store::ListFilter::default())
        .await
        .expect("list");
    assert_eq!(page.operations.len(), 1);
    assert_eq!(page.operations[0].event_id, "s1");
}
