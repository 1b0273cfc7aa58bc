//! `opgate bench e2e` as a real process on the embedded default (SQLite, librdkafka's mock
//! cluster, the simulated provider): every operation reaches its final result on
//! `opgate.results`, the provider takes each one's effect once, and the figures it prints
//! and appends include how long the provider waited for each effect (matched to every
//! dispatched operation by its key, or the command fails).

#![allow(missing_docs)]

use std::process::Command;

/// Runs `opgate bench e2e --operations 40` with `extra` arguments, checks the summary
/// line (`effects` at the provider, each once) and returns the row it appended, as cells.
fn bench_e2e(extra: &[&str], effects: usize) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!("opgate-bench-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).expect("dir");
    let table = dir.join("rows.md");
    let out = Command::new(env!("CARGO_BIN_EXE_opgate"))
        .args(["bench", "e2e", "--operations", "40"])
        .args(extra)
        .arg("--write")
        .arg(&table)
        .output()
        .expect("run opgate bench e2e");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("e2e: "))
        .unwrap_or_else(|| panic!("no summary line in:\n{stdout}"));
    // 40 operations asked for: 57 records, 39 distinct keys.
    assert!(summary.starts_with("e2e: 39 operations"), "{summary}");
    assert!(
        summary.contains("consume->provider effect p50"),
        "{summary}"
    );
    assert!(
        summary.contains(&format!("{effects} effects, 0 duplicates")),
        "{summary}"
    );
    let rows = std::fs::read_to_string(&table).expect("the appended row");
    let row = rows.lines().last().expect("a row").to_owned();
    let _ = std::fs::remove_dir_all(&dir);
    // The row's cells: date, operations, records, ledger, processes, settings, time,
    // ops/s, to first result, ops/s after it, consume->dispatch, consume->effect,
    // consume->settled, publish->dispatch, transactions, statements, row writes, CPU.
    let cells: Vec<String> = row
        .trim_matches('|')
        .split(" | ")
        .map(|c| c.trim().to_owned())
        .collect();
    assert_eq!(cells.len(), 18, "{row}");
    assert_eq!(cells[1], "39", "{row}");
    assert_eq!(cells[3], "SQLite", "{row}");
    cells
}

/// A "p50 / p99" cell in milliseconds, checked to be ordered.
fn p50_p99(cell: &str) -> (f64, f64) {
    let (p50, p99) = cell.split_once(" / ").expect("p50 / p99");
    let (p50, p99): (f64, f64) = (p50.parse().expect("p50"), p99.parse().expect("p99"));
    assert!(p50 >= 0.0 && p50 <= p99, "{cell}");
    (p50, p99)
}

#[test]
fn bench_e2e_on_the_embedded_default_prints_and_appends_its_figures() {
    let cells = bench_e2e(&[], 39);
    let latencies: Vec<(f64, f64)> = cells[10..13].iter().map(|c| p50_p99(c)).collect();
    // Each call reaches the provider before its effect is taken (the provider's work
    // lies between), so every percentile of the first is at most the second's.
    let ((d50, d99), (e50, e99)) = (latencies[0], latencies[1]);
    assert!(d50 <= e50 && d99 <= e99, "{cells:?}");
    // A pre-published load has no send time to measure from.
    assert_eq!(cells[13], "-", "{cells:?}");
}

/// At a fixed rate the row also holds the time from each record's send to the call at
/// the provider, which for every operation is at least its time from consume (the send
/// comes before the ingest's clock read), so each percentile is too.
#[test]
fn bench_e2e_at_a_fixed_rate_measures_from_the_send() {
    // The 39 operations' effects and the warm-up proposal's (sent before the load, to
    // see ingest consuming).
    let cells = bench_e2e(&["--rate", "200"], 40);
    let (d50, d99) = p50_p99(&cells[10]);
    let (s50, s99) = p50_p99(&cells[13]);
    assert!(d50 <= s50 && d99 <= s99, "{cells:?}");
}

/// Too few records for one operation is a clear error before anything starts, not a
/// panic (it was: sampling an empty range) nor a row of zeros.
#[test]
fn a_workload_too_small_for_one_operation_is_refused() {
    for args in [
        ["bench", "e2e", "--operations", "0"],
        ["bench", "e2e", "--operations", "1"],
        ["bench", "ingest", "--proposals", "2"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_opgate"))
            .args(args)
            .output()
            .expect("run opgate bench");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("make no distinct operation: the workload needs at least 3"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
