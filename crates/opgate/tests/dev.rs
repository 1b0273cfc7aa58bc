//! `opgate dev` as a real process (no services: embedded broker, SQLite, simulated
//! providers).
//!
//! 1. `opgate dev --demo --ops 2000 --seed 7` runs the scripted incidents and the load
//!    run and exits 0; its table shows every proposal answered, every incident as
//!    expected, and zero duplicate effects.
//! 2. `opgate dev` with `--ready-file`, driven by the CLI (`opgate propose`, `opgate ops
//!    list|show|events|compensate`) and by a Kafka producer: a proposal sent over HTTP
//!    and again over Kafka is one operation; a viewer token cannot propose; SIGTERM ends
//!    the process with status 0; `/metrics` shows the counters and the ledger's gauges.

#![allow(missing_docs)]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use uuid::Uuid;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("opgate-{name}-{}", Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// The number in the table row that starts with `label`.
fn row(table: &str, label: &str) -> u64 {
    let line = table
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no row `{label}` in:\n{table}"));
    line.split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("row `{label}` has no number: {line}"))
}

#[test]
fn the_demo_answers_every_proposal_with_no_duplicate_effect() {
    let dir = temp_dir("demo");
    let ready = dir.join("ready.json");
    let output = Command::new(env!("CARGO_BIN_EXE_opgate"))
        .args(["dev", "--demo", "--ops", "2000", "--seed", "7"])
        .args(["--api-listen", "127.0.0.1:0", "--sim-listen", "127.0.0.1:0"])
        .arg("--ledger")
        .arg(dir.join("demo.db"))
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run opgate dev --demo");
    let table = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "opgate dev --demo failed: {}\n{table}\n{stderr}",
        output.status
    );

    // Every scripted incident held, and there are seven of them.
    let incidents: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("  ok ") || l.starts_with("  FAIL "))
        .collect();
    assert_eq!(incidents.len(), 7, "{table}");
    assert!(incidents.iter().all(|l| l.starts_with("  ok ")), "{table}");

    assert_eq!(row(&table, "duplicate effects"), 0, "{table}");
    assert_eq!(row(&table, "overlapping writes"), 0, "{table}");
    assert_eq!(row(&table, "unsettled operations"), 0, "{table}");
    let distinct = row(&table, "distinct events");
    assert!(distinct > 1_500, "{table}");
    assert_eq!(
        row(&table, "answered on opgate.results"),
        distinct,
        "{table}"
    );
    // 2,000 load proposals plus the incidents' records.
    assert!(row(&table, "proposals published") >= 2_000, "{table}");
    // The load run's duplicates were suppressed by the inbox and the key, the re-run
    // email by the window, the race by the exclusive group.
    for reason in [
        "deduplicated: inbox",
        "deduplicated: key",
        "deduplicated: window",
        "deduplicated: exclusive_group",
    ] {
        assert!(row(&table, reason) > 0, "{reason}: {table}");
    }
    // Every operation the providers saw produced exactly one effect, except the one
    // whose provider refused it (the failed last step) — the refund is an effect too.
    let operations = row(&table, "operations in the ledger");
    assert_eq!(
        row(&table, "effects seen by the providers"),
        operations - 1,
        "{table}"
    );
    assert!(table.contains("all proposals answered, 0 duplicate effects"));

    let ready: Value =
        serde_json::from_slice(&std::fs::read(&ready).expect("ready file")).expect("json");
    for field in ["kafka", "api", "sim", "ledger"] {
        assert!(ready[field].is_string(), "{field}: {ready}");
    }
    assert!(ready["tokens"]["viewer"].is_string() && ready["tokens"]["operator"].is_string());
}

/// Runs the CLI against a dev instance.
fn cli(api: &str, token: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_opgate"))
        .args(args)
        .env("OPGATE_API_URL", api)
        .env("OPGATE_TOKEN", token)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the opgate CLI")
}

fn json_of(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("--json output is JSON")
}

/// `opgate dev --fresh` on ephemeral ports in `dir`, once its ready file is written.
fn spawn_dev(dir: &Path, extra: &[&std::ffi::OsStr]) -> (support::Reaped, Value) {
    let ready_file = dir.join("ready.json");
    let child = support::Reaped::spawn(
        Command::new(env!("CARGO_BIN_EXE_opgate"))
            .args(["dev", "--fresh"])
            .args(extra)
            .args(["--api-listen", "127.0.0.1:0", "--sim-listen", "127.0.0.1:0"])
            .arg("--ledger")
            .arg(dir.join("dev.db"))
            .arg("--ready-file")
            .arg(&ready_file)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    (child, wait_for(&ready_file))
}

fn wait_for(path: &Path) -> Value {
    let started = Instant::now();
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return serde_json::from_slice(&bytes).expect("ready file is JSON");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "opgate dev never wrote its ready file"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_serves_the_cli_and_one_proposal_sent_both_ways_is_one_operation() {
    let dir = temp_dir("dev");
    let (mut child, ready) = spawn_dev(&dir, &[]);
    let api = ready["api"].as_str().expect("api").to_owned();
    let operator = ready["tokens"]["operator"].as_str().expect("operator");
    let viewer = ready["tokens"]["viewer"].as_str().expect("viewer");

    // Over HTTP, through the CLI, waiting for the result.
    let answer = json_of(&cli(
        &api,
        operator,
        &[
            "propose",
            "--tool",
            "capture_payment",
            "--entity",
            "order:order_77",
            "--args",
            r#"{"amount": "12.00", "currency": "usd"}"#,
            "--event-id",
            "evt-http-1",
            "--wait",
            "20s",
            "--json",
        ],
    ));
    assert_eq!(answer["decision"], "accepted", "{answer}");
    let op = &answer["operation"];
    assert_eq!(op["status"], "completed_success", "{answer}");
    let id = op["operation_id"].as_str().expect("id").to_owned();

    // The same proposal over Kafka, spelled differently, under a new event id.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", ready["kafka"].as_str().expect("kafka"))
        .create()
        .expect("producer");
    let payload = json!({"event_id": "evt-kafka-1", "tool": "capture_payment",
        "entity": {"type": "order", "id": "order_77"}, "args": {"amount": 12, "currency": " USD"}})
    .to_string();
    producer
        .send(
            FutureRecord::to("opgate.proposals")
                .key("order:order_77")
                .payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .expect("produce");
    // Its answer on opgate.results: a key dedupe of the same operation.
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", ready["kafka"].as_str().expect("kafka"))
        .set("group.id", "dev-test-results")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    consumer.subscribe(&["opgate.results"]).expect("subscribe");
    let answer = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let message = consumer.recv().await.expect("results");
            let value: Value =
                serde_json::from_slice(message.payload().unwrap_or_default()).expect("json");
            if value["event_id"] == "evt-kafka-1" {
                return value;
            }
        }
    })
    .await
    .expect("the Kafka proposal is answered on opgate.results");
    assert_eq!(answer["operation_id"], id.as_str(), "{answer}");
    assert_eq!(answer["dedupe"]["hit"], true, "{answer}");
    assert_eq!(answer["dedupe"]["reason"], "key", "{answer}");
    let list = json_of(&cli(
        &api,
        viewer,
        &["ops", "list", "--entity", "order:order_77", "--json"],
    ));
    let ops = list["operations"].as_array().expect("operations");
    assert_eq!(ops.len(), 1, "one operation for both channels: {list}");
    assert_eq!(ops[0]["attempt_count"], 1, "dispatched once: {list}");
    let events = json_of(&cli(&api, viewer, &["ops", "events", &id, "--json"]));
    assert!(
        events["events"].as_array().expect("events").len() >= 3,
        "{events}"
    );
    // The whole id is not needed: the start of it that only this operation's id has
    // (the only operation in this ledger, so 8 digits are enough).
    let short = json_of(&cli(&api, viewer, &["ops", "show", &id[..8], "--json"]));
    assert_eq!(short["operation_id"], json!(id), "{short}");

    // A viewer may read but not propose.
    let denied = cli(
        &api,
        viewer,
        &[
            "propose",
            "--tool",
            "capture_payment",
            "--entity",
            "order:order_78",
            "--args",
            r#"{"amount": "1.00", "currency": "usd"}"#,
        ],
    );
    assert!(!denied.status.success());
    assert!(
        String::from_utf8_lossy(&denied.stderr).contains("403"),
        "{}",
        String::from_utf8_lossy(&denied.stderr)
    );

    // The readable table names the operation.
    let table = cli(&api, viewer, &["ops", "list"]);
    assert!(table.status.success());
    assert!(String::from_utf8_lossy(&table.stdout).contains(&id));

    // Compensate the payment: a refund operation, then `compensated`.
    let comp = json_of(&cli(
        &api,
        operator,
        &[
            "ops",
            "compensate",
            &id,
            "--reason",
            "order cancelled",
            "--json",
        ],
    ));
    assert_eq!(comp["operation"]["status"], "compensating", "{comp}");
    assert_eq!(comp["compensation"]["tool"], "refund_payment", "{comp}");
    assert_eq!(comp["compensation"]["compensates"], id.as_str(), "{comp}");
    let settled = json_of(&cli(
        &api,
        viewer,
        &["ops", "show", &id, "--wait", "20s", "--json"],
    ));
    assert_eq!(settled["status"], "compensated", "{settled}");

    // Ready: the ledger and the embedded broker answer.
    let http = reqwest::Client::new();
    let ready_answer: Value = http
        .get(format!("{api}/readyz"))
        .send()
        .await
        .expect("GET /readyz")
        .json()
        .await
        .expect("json");
    assert_eq!(ready_answer["ledger"], "ok", "{ready_answer}");
    assert_eq!(ready_answer["broker"], "ok", "{ready_answer}");

    // Metrics: this process's counters and the ledger's gauges, for a viewer token only.
    let unauthenticated = http
        .get(format!("{api}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(unauthenticated.status(), 401);
    let started = Instant::now();
    loop {
        let text = http
            .get(format!("{api}/metrics"))
            .bearer_auth(viewer)
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("body");
        // Whole lines, so `... 1` cannot match `... 10`.
        let lines = [
            "opgate_ingest_decisions_total{decision=\"accepted\"} 1",
            "opgate_dedupe_hits_total{reason=\"key\"} 1",
            "opgate_attempts_total{outcome=\"committed\",tool=\"capture_payment\"} 1",
            "opgate_attempts_total{outcome=\"committed\",tool=\"refund_payment\"} 1",
            "opgate_compensations_total{tool=\"capture_payment\"} 1",
            "opgate_relay_pending 0",
        ];
        // Lines whose values vary: only their start.
        let starts = [
            "opgate_attempt_duration_seconds_bucket{tool=\"capture_payment\"",
            // librdkafka's statistics arrive every 5 s.
            "opgate_consumer_lag{partition=",
        ];
        let missing: Vec<&str> = lines
            .iter()
            .filter(|want| !text.lines().any(|l| l == **want))
            .chain(
                starts
                    .iter()
                    .filter(|want| !text.lines().any(|l| l.starts_with(**want))),
            )
            .copied()
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "missing {missing:?} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Close this test's Kafka clients while the broker still answers (a consumer closing
    // against a vanished broker waits out its session timeout).
    drop(consumer);
    drop(producer);

    // SIGTERM: drain and exit 0.
    let status = support::terminate(&mut child, "opgate dev");
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_takes_a_users_config_with_adapters_on_the_embedded_providers() {
    let dir = temp_dir("dev-config");
    let config = dir.join("tools.toml");
    std::fs::write(
        &config,
        r#"
[[tools]]
name = "open_case"
side_effect_class = "external_idempotent"
entity = "customer"
key = "case:{entity}:{args.topic}"
[tools.args]
topic = ["trim", "lower"]
[tools.adapter]
kind = "http"
url = "${OPGATE_SIM_URL}/tickets"
timeout_ms = 1000
key_body_field = "client_token"
external_id_pointer = "/ticket_id"
"#,
    )
    .expect("config");
    let (mut child, ready) = spawn_dev(&dir, &["--config".as_ref(), config.as_os_str()]);
    let api = ready["api"].as_str().expect("api");
    let operator = ready["tokens"]["operator"].as_str().expect("operator");
    let answer = json_of(&cli(
        api,
        operator,
        &[
            "propose",
            "--tool",
            "open_case",
            "--entity",
            "customer:c9",
            "--args",
            r#"{"topic": " Billing "}"#,
            "--wait",
            "20s",
            "--json",
        ],
    ));
    assert_eq!(
        answer["operation"]["status"], "completed_success",
        "{answer}"
    );
    assert_eq!(answer["operation"]["idempotency_key"], "case:c9:billing:v1");
    assert!(
        answer["operation"]["external_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("tk_")),
        "the embedded ticket provider answered: {answer}"
    );
    // A tool the file does not declare is refused.
    let refused = cli(
        api,
        operator,
        &[
            "propose",
            "--tool",
            "capture_payment",
            "--entity",
            "order:o1",
            "--args",
            "{}",
        ],
    );
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stdout).contains("unknown_tool"),
        "{}",
        String::from_utf8_lossy(&refused.stdout)
    );
    // Bad input to the CLI: a clear error and a non-zero exit, never a crash.
    for (args, says) in [
        (
            vec![
                "propose",
                "--tool",
                "open_case",
                "--entity",
                "c9",
                "--args",
                "{}",
            ],
            "--entity must be `type:id`",
        ),
        (
            vec![
                "propose",
                "--tool",
                "open_case",
                "--entity",
                "customer:c9",
                "--args",
                "{",
            ],
            "--args is not JSON",
        ),
        (
            vec![
                "propose",
                "--tool",
                "open_case",
                "--entity",
                "customer:c9",
                "--args",
                "[1]",
            ],
            "--args must be a JSON object",
        ),
        (vec!["ops", "show", "not-an-id"], "invalid_id"),
        (
            vec![
                "ops",
                "resolve",
                "01a22a67-018e-721a-9ae6-51b3ab48b013",
                "--resolution",
                "succeeded",
            ],
            "not_found",
        ),
    ] {
        let out = cli(api, operator, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    child.kill().expect("kill");
    let _ = child.wait();
}

/// `opgate ARGS` to completion: (success, stdout, stderr).
fn opgate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_opgate"))
        .args(args)
        .output()
        .expect("run opgate");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn version_migrate_config_and_a_foreign_database_url() {
    let (ok, out, _) = opgate(&["--version"]);
    assert!(
        ok && out.trim() == format!("opgate {}", env!("CARGO_PKG_VERSION")),
        "{out}"
    );
    assert_ne!(env!("CARGO_PKG_VERSION"), "0.0.0");
    let dir = temp_dir("migrate");
    let config = dir.join("opgate.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\n",
            dir.join("m.db").display()
        ),
    )
    .expect("config");
    let (ok, out, err) = opgate(&["migrate", "--config", config.to_str().expect("utf-8")]);
    assert!(ok, "{err}");
    assert!(out.contains("ledger schema at version"), "{out}");
    let (ok, _, err) = opgate(&["migrate", "--database-url", "mysql://root@127.0.0.1/test"]);
    assert!(!ok);
    assert!(
        err.contains("unsupported database URL scheme `mysql://`"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "one line per failure: {err}");
    // A port nothing listens on: the refusal, at once, once (not the pool's timeout).
    let started = Instant::now();
    let (ok, _, err) = opgate(&[
        "migrate",
        "--database-url",
        "postgres://postgres@127.0.0.1:1/x",
    ]);
    assert!(!ok);
    assert!(err.contains("Connection refused"), "{err}");
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
    // A SQLite file that cannot be created: its cause printed once.
    let (ok, _, err) = opgate(&[
        "migrate",
        "--database-url",
        "sqlite:///nonexistent/dir/x.db",
    ]);
    assert!(!ok);
    assert_eq!(
        err.matches("unable to open database file").count(),
        1,
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn propose_wait_fails_when_nothing_settles_the_operation() {
    let dir = temp_dir("nowait");
    // No dispatcher: the operation stays pending_dispatch.
    let (_child, ready) = spawn_dev(&dir, &["--roles".as_ref(), "ingest,relay,api".as_ref()]);
    let api = ready["api"].as_str().expect("api");
    let operator = ready["tokens"]["operator"].as_str().expect("operator");
    let (ok, _, err) = opgate(&[
        "propose",
        "--api-url",
        api,
        "--token",
        operator,
        "--tool",
        "capture_payment",
        "--entity",
        "order:o1",
        "--args",
        r#"{"amount": "1.00", "currency": "usd"}"#,
        "--wait",
        "1s",
    ]);
    assert!(!ok, "an unsettled operation after --wait is a failure");
    assert!(
        err.contains("still pending_dispatch after --wait 1s"),
        "{err}"
    );
}

#[test]
fn logs_written_to_a_file_carry_no_colour_codes_and_json_logs_are_json() {
    for format in ["text", "json"] {
        let dir = temp_dir(&format!("logs-{format}"));
        let log = dir.join("stderr.log");
        let ready_file = dir.join("ready.json");
        let mut child = support::Reaped::spawn(
            Command::new(env!("CARGO_BIN_EXE_opgate"))
                .args(["--log-format", format, "dev", "--fresh"])
                .args(["--api-listen", "127.0.0.1:0", "--sim-listen", "127.0.0.1:0"])
                .arg("--ledger")
                .arg(dir.join("dev.db"))
                .arg("--ready-file")
                .arg(&ready_file)
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("log")),
        );
        wait_for(&ready_file);
        support::terminate(&mut child, "opgate dev");
        let text = std::fs::read_to_string(&log).expect("log");
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(lines.len() >= 3, "some log lines: {text}");
        assert!(
            !text.contains('\u{1b}'),
            "no ANSI escape in a file ({format}): {text}"
        );
        if format == "json" {
            for line in lines {
                let v: Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                assert!(
                    v.get("level").is_some() && v.get("fields").is_some(),
                    "{line}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ops_events_follow_prints_each_event_until_the_operation_settles() {
    let dir = temp_dir("follow");
    let (_child, ready) = spawn_dev(&dir, &[]);
    let api = ready["api"].as_str().expect("api").to_owned();
    let sim = ready["sim"].as_str().expect("sim").to_owned();
    let operator = ready["tokens"]["operator"]
        .as_str()
        .expect("operator")
        .to_owned();
    // The provider commits, then hangs past the 1 s timeout: the operation takes a retry
    // to settle, so --follow has events to wait for.
    let status = reqwest::Client::new()
        .post(format!("{sim}/faults"))
        .json(&json!({"provider": "payments", "fault": "timeout_after_commit", "times": 1}))
        .send()
        .await
        .expect("fault")
        .status();
    assert!(status.is_success());
    let (ok, out, err) = opgate(&[
        "propose",
        "--api-url",
        &api,
        "--token",
        &operator,
        "--json",
        "--tool",
        "capture_payment",
        "--entity",
        "order:follow",
        "--args",
        r#"{"amount": "3.00", "currency": "usd"}"#,
    ]);
    assert!(ok, "{err}");
    let answer: Value = serde_json::from_str(&out).expect("json");
    let id = answer["operation"]["operation_id"]
        .as_str()
        .expect("id")
        .to_owned();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        opgate(&[
            "ops",
            "events",
            "--follow",
            &id,
            "--api-url",
            &api,
            "--token",
            &operator,
        ])
    })
    .await
    .expect("follow");
    assert!(ok, "{err}");
    let transitions: Vec<&str> = out.lines().skip(1).collect();
    assert!(
        transitions
            .iter()
            .any(|l| l.contains("-> failed_retryable")),
        "the timeout was followed: {out}"
    );
    assert!(
        transitions
            .last()
            .is_some_and(|l| l.contains("-> completed_success")),
        "ends when settled: {out}"
    );
    let seqs: Vec<&str> = transitions
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut unique = seqs.clone();
    unique.dedup();
    assert_eq!(seqs, unique, "each event once: {out}");
}

/// With no broker, `run --roles ingest,relay` used to log ~500 lines in 15 s and run on:
/// now it says once that it waits, and exits non-zero at `kafka.startup_timeout_ms`
/// with one error line naming the brokers.
#[test]
fn run_without_a_broker_gives_up_at_the_startup_deadline_and_logs_little() {
    let dir = temp_dir("no-broker");
    let config = dir.join("opgate.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\n[kafka]\nbrokers = \"127.0.0.1:1\"\nstartup_timeout_ms = 3000\n",
            dir.join("ledger.db").display()
        ),
    )
    .expect("config");
    let config = config.to_str().expect("path");
    let (ok, _, err) = opgate(&["migrate", "--config", config]);
    assert!(ok, "{err}");
    let started = Instant::now();
    let (ok, _, err) = opgate(&["run", "--config", config, "--roles", "ingest,relay"]);
    let took = started.elapsed();
    assert!(!ok, "run succeeded without a broker: {err}");
    assert!(
        err.contains("no Kafka broker answered at 127.0.0.1:1 within 3s"),
        "{err}"
    );
    assert!(
        (Duration::from_secs(3)..Duration::from_secs(20)).contains(&took),
        "gave up after {took:?}"
    );
    assert!(
        err.lines().count() <= 8,
        "{} lines:\n{err}",
        err.lines().count()
    );
}
