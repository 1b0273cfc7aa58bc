//! The simulated providers' contract: idempotency per provider, lookups, faults, effect
//! and overlap counters, and clear errors for bad requests.

#![allow(missing_docs)]

use std::time::Duration;

use opgate_sim::{EffectsReport, FaultKind, FaultSpec, Sim, SimConfig};
use serde_json::{Value, json};

async fn start(config: SimConfig) -> (Sim, String, reqwest::Client) {
    let sim = Sim::new(config);
    let (addr, _server) = opgate_sim::start("127.0.0.1:0".parse().expect("addr"), sim.clone())
        .await
        .expect("start");
    (sim, format!("http://{addr}"), reqwest::Client::new())
}

async fn effects(client: &reqwest::Client, url: &str) -> EffectsReport {
    client
        .get(format!("{url}/effects"))
        .send()
        .await
        .expect("effects")
        .json()
        .await
        .expect("json")
}

#[tokio::test]
async fn payments_honour_the_idempotency_key_and_can_be_looked_up() {
    let (_sim, url, c) = start(SimConfig::default()).await;
    let pay = || {
        c.post(format!("{url}/payments"))
            .header("Idempotency-Key", "k1")
            .json(&json!({"amount": 4900, "currency": "USD"}))
            .send()
    };
    let first: Value = pay().await.expect("post").json().await.expect("json");
    let again: Value = pay().await.expect("post").json().await.expect("json");
    assert_eq!(first, again, "a repeat returns the stored charge");
    let found = c
        .get(format!("{url}/payments?idempotency_key=k1"))
        .send()
        .await
        .expect("get");
    assert_eq!(found.status(), 200);
    let missing = c
        .get(format!("{url}/payments?idempotency_key=nope"))
        .send()
        .await
        .expect("get");
    assert_eq!(missing.status(), 404);
    let report = effects(&c, &url).await;
    assert_eq!((report.total, report.duplicates), (1, 0));
    let no_key = c
        .post(format!("{url}/payments"))
        .json(&json!({}))
        .send()
        .await
        .expect("post");
    assert_eq!(
        no_key.status(),
        400,
        "a charge without a key is refused with a message"
    );
}

#[tokio::test]
async fn emails_have_no_idempotency_and_count_every_send() {
    let (_sim, url, c) = start(SimConfig::default()).await;
    for _ in 0..2 {
        let r = c
            .post(format!("{url}/emails"))
            .json(&json!({"client_reference": "r1", "to": "a@b.c"}))
            .send()
            .await
            .expect("post");
        assert_eq!(r.status(), 200);
    }
    let report = effects(&c, &url).await;
    assert_eq!(
        (report.total, report.duplicates),
        (2, 1),
        "the second send is a real duplicate"
    );
    assert_eq!(
        c.get(format!("{url}/emails?client_reference=r1"))
            .send()
            .await
            .expect("get")
            .status(),
        200
    );
}

#[tokio::test]
async fn tickets_dedupe_on_the_client_token() {
    let (_sim, url, c) = start(SimConfig::default()).await;
    for _ in 0..3 {
        c.post(format!("{url}/tickets"))
            .json(&json!({"client_token": "t1"}))
            .send()
            .await
            .expect("post");
    }
    assert_eq!(effects(&c, &url).await.total, 1);
}

#[tokio::test]
async fn faults_fire_as_scripted() {
    let (sim, url, c) = start(SimConfig {
        hang: Duration::from_millis(300),
        propagation: Duration::from_millis(300),
        ..SimConfig::default()
    })
    .await;
    let post = |key: &'static str| {
        c.post(format!("{url}/payments"))
            .header("Idempotency-Key", key)
            .json(&json!({"amount": 1}))
            .send()
    };

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("a".into()),
        fault: FaultKind::Throttle,
        times: Some(1),
        probability: None,
    });
    let r = post("a1").await.expect("post");
    assert_eq!(r.status(), 429);
    assert_eq!(
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(
        post("a1").await.expect("post").status(),
        200,
        "times = 1 is used up"
    );

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("b".into()),
        fault: FaultKind::ErrorCommitted,
        times: Some(1),
        probability: None,
    });
    assert_eq!(post("b1").await.expect("post").status(), 500);
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=b1"))
            .send()
            .await
            .expect("get")
            .status(),
        200,
        "committed despite the 500"
    );

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("c".into()),
        fault: FaultKind::ErrorNotCommitted,
        times: Some(1),
        probability: None,
    });
    assert_eq!(post("c1").await.expect("post").status(), 500);
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=c1"))
            .send()
            .await
            .expect("get")
            .status(),
        404
    );

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("d".into()),
        fault: FaultKind::Malformed,
        times: Some(1),
        probability: None,
    });
    let r = post("d1").await.expect("post");
    assert_eq!(r.status(), 200);
    assert!(serde_json::from_str::<Value>(&r.text().await.expect("body")).is_err());

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("e".into()),
        fault: FaultKind::SlowPropagation,
        times: Some(1),
        probability: None,
    });
    assert_eq!(post("e1").await.expect("post").status(), 200);
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=e1"))
            .send()
            .await
            .expect("get")
            .status(),
        404,
        "not visible yet"
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=e1"))
            .send()
            .await
            .expect("get")
            .status(),
        200
    );

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("f".into()),
        fault: FaultKind::TimeoutAfterCommit,
        times: Some(1),
        probability: None,
    });
    let timed_out = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .expect("client")
        .post(format!("{url}/payments"))
        .header("Idempotency-Key", "f1")
        .json(&json!({}))
        .send()
        .await;
    assert!(timed_out.is_err(), "the client timed out");
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=f1"))
            .send()
            .await
            .expect("get")
            .status(),
        200,
        "but the charge happened"
    );

    sim.add_fault(FaultSpec {
        provider: "payments".into(),
        match_prefix: Some("g".into()),
        fault: FaultKind::TimeoutBeforeCommit,
        times: Some(1),
        probability: None,
    });
    let r = post("g1").await.expect("post");
    assert_eq!(r.status(), 504);
    assert_eq!(
        c.get(format!("{url}/payments?idempotency_key=g1"))
            .send()
            .await
            .expect("get")
            .status(),
        404
    );

    let cleared = c
        .delete(format!("{url}/faults"))
        .send()
        .await
        .expect("delete");
    assert_eq!(cleared.status(), 204);
    let bad = c
        .post(format!("{url}/faults"))
        .json(&json!({"provider": "sms", "fault": "throttle"}))
        .send()
        .await
        .expect("post");
    assert_eq!(bad.status(), 400);
    let bad = c
        .post(format!("{url}/faults"))
        .json(&json!({"provider": "emails", "fault": "explode"}))
        .send()
        .await
        .expect("post");
    assert_eq!(bad.status(), 422, "an unknown fault is refused");
}

#[tokio::test]
async fn probabilistic_faults_are_reproducible_with_a_seed() {
    let run = |seed| async move {
        let (sim, url, c) = start(SimConfig {
            seed,
            ..SimConfig::default()
        })
        .await;
        sim.add_fault(FaultSpec {
            provider: "tickets".into(),
            match_prefix: None,
            fault: FaultKind::ErrorNotCommitted,
            times: None,
            probability: Some(0.5),
        });
        let mut statuses = Vec::new();
        for i in 0..20 {
            let r = c
                .post(format!("{url}/tickets"))
                .json(&json!({"client_token": format!("t{i}")}))
                .send()
                .await
                .expect("post");
            statuses.push(r.status().as_u16());
        }
        statuses
    };
    let a = run(3).await;
    assert_eq!(a, run(3).await);
    assert!(a.contains(&500) && a.contains(&200), "{a:?}");
}

#[tokio::test]
async fn concurrent_calls_on_one_entity_are_counted_as_overlaps() {
    let (_sim, url, c) = start(SimConfig {
        work: Duration::from_millis(100),
        ..SimConfig::default()
    })
    .await;
    let call = |token: &'static str| {
        c.post(format!("{url}/tickets"))
            .header("x-opgate-entity", "account:1")
            .json(&json!({"client_token": token}))
            .send()
    };
    let (a, b) = tokio::join!(call("x"), call("y"));
    a.expect("a");
    b.expect("b");
    assert_eq!(effects(&c, &url).await.overlaps, 1);
}
