//! The eval's labelled workload straight into the ledger, batch by batch as the Kafka
//! ingest writes it: every proposal of one intent must land on one operation, and no
//! near-duplicate on its original's. (This is the eval's dedupe scoring without Kafka,
//! processes or providers, so a miss here is the ledger's own.)

#![allow(missing_docs)]

use std::collections::{HashMap, HashSet};

use opgate_core::{Delivery, IngestItem, Limits, Proposal, Registry, Source};
use opgate_fleet::workload::{self, Kind};

const DEV_TOOLS: &str = include_str!("../../opgate/dev-tools.toml");

async fn one_operation_per_intent(batch: usize) {
    // The registry's [[tools]] only (the [worker] table is the binary's).
    let tools = &DEV_TOOLS[DEV_TOOLS.find("[[tools]]").expect("tools")..];
    let registry = Registry::from_toml(tools).expect("dev registry");
    let dir = std::env::temp_dir().join(format!("opgate-workload-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let url = format!("sqlite://{}", dir.join("ledger.db").display());
    opgate_store::migrate(&url).await.expect("migrate");
    let ledger = opgate_store::open(&url).await.expect("ledger");

    let w = workload::generate(4_000, 1);
    // One partition per Kafka key hash bucket, in publishing order, as the lanes see it.
    let mut partitions: HashMap<u64, Vec<&workload::Record>> = HashMap::new();
    for r in &w.records {
        let bucket = r.key.bytes().map(u64::from).sum::<u64>() % 4;
        partitions.entry(bucket).or_default().push(r);
    }
    let mut operation_of: HashMap<String, String> = HashMap::new();
    for records in partitions.values() {
        for chunk in records.chunks(batch) {
            let items: Vec<(String, IngestItem)> = chunk
                .iter()
                .filter_map(|r| {
                    let p = Proposal::decode(&r.value, &Limits::default()).ok()?;
                    let item = IngestItem::from_proposal(
                        &registry,
                        &p,
                        Delivery {
                            principal: None,
                            source: Source::Http,
                            traceparent: None,
                        },
                    );
                    Some((p.event_id.clone(), item))
                })
                .collect();
            let batch: Vec<IngestItem> = items.iter().map(|(_, i)| i.clone()).collect();
            let out = ledger.ingest(&batch).await.expect("ingest");
            for ((event, _), outcome) in items.iter().zip(out) {
                if let Some(op) = outcome.operation {
                    operation_of
                        .entry(event.clone())
                        .or_insert_with(|| op.operation_id.to_string());
                }
            }
        }
    }
    let mut operations_of_intent: HashMap<usize, HashSet<&str>> = HashMap::new();
    for r in &w.records {
        if let (Some(e), Some(i)) = (&r.event_id, r.intent)
            && let Some(op) = operation_of.get(e)
        {
            operations_of_intent.entry(i).or_default().insert(op);
        }
    }
    let split: Vec<_> = operations_of_intent
        .iter()
        .filter(|(_, ops)| ops.len() > 1)
        .collect();
    assert!(
        split.is_empty(),
        "intents with more than one operation: {split:?}"
    );
    for pair in &w.near_pairs {
        assert_ne!(
            operation_of.get(&pair.original),
            operation_of.get(&pair.near),
            "near-duplicate merged ({})",
            pair.differs_in
        );
    }
    assert!(w.count(Kind::Replanned) > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn one_operation_per_intent_in_big_batches() {
    one_operation_per_intent(500).await;
}

#[tokio::test]
async fn one_operation_per_intent_one_by_one() {
    one_operation_per_intent(1).await;
}
