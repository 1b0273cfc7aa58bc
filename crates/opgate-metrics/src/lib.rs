//! opgate's Prometheus metrics (DESIGN.md section 7).
//!
//! Counters and histograms live in one registry per process ([`metrics`]); each role
//! updates its own. Gauges that describe the shared ledger (live operations by state,
//! queue depth, relay backlog) are read from the ledger when `/metrics` is scraped, so
//! every process reports the same numbers for them ([`LedgerGauges`]).
//!
//! Names carry the `opgate_` prefix, counters end in `_total`, and no label ever holds
//! an id (operation, entity, key or event): labels are tools, classes, states, reasons
//! and outcomes, all from closed or configured sets.
#![forbid(unsafe_code)]

use std::sync::OnceLock;

use prometheus::{
    Encoder as _, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Every metric a process updates.
pub struct Metrics {
    registry: Registry,
    /// `opgate_ingest_decisions_total{decision}`: accepted, deduplicated, rejected.
    pub ingest_decisions: IntCounterVec,
    /// `opgate_dedupe_hits_total{reason}`: inbox, key, window, exclusive_group.
    pub dedupe_hits: IntCounterVec,
    /// `opgate_rejections_total{reason}`: proposals refused at ingest.
    pub rejections: IntCounterVec,
    /// `opgate_entity_conflicts_total{kind}`: key_conflict, exclusive_group.
    pub entity_conflicts: IntCounterVec,
    /// `opgate_dlq_total{reason}`: records written to the DLQ.
    pub dlq: IntCounterVec,
    /// `opgate_attempts_total{tool, outcome}`: dispatch attempts by classified outcome.
    pub attempts: IntCounterVec,
    /// `opgate_attempt_duration_seconds{tool}`: time from send to classified answer.
    pub attempt_seconds: HistogramVec,
    /// `opgate_unknown_outcomes_total{tool, category}`: attempts whose effect is unknown.
    pub unknown_outcomes: IntCounterVec,
    /// `opgate_reconciliations_total{tool, result}`: lookups by what they decided.
    pub reconciliations: IntCounterVec,
    /// `opgate_reconciliation_lag_seconds{tool}`: how long an unknown outcome took to resolve.
    pub reconciliation_lag: HistogramVec,
    /// `opgate_compensations_total{tool}`: compensations started (retries included).
    pub compensations: IntCounterVec,
    /// `opgate_results_published_total`: result messages the relay had acknowledged.
    pub results_published: IntCounter,
    /// `opgate_consumer_lag{topic, partition}`: records behind the partition's end, as
    /// librdkafka reports it for the ingest worker's assigned partitions.
    pub consumer_lag: IntGaugeVec,
}

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition");
    registry
        .register(Box::new(c.clone()))
        .expect("metric registered once");
    c
}

fn histogram(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let buckets = vec![
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
    ];
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
        .expect("valid metric definition");
    registry
        .register(Box::new(h.clone()))
        .expect("metric registered once");
    h
}

impl Metrics {
    fn new() -> Self {
        let registry = Registry::new();
        let results_published = IntCounter::new(
            "opgate_results_published_total",
            "Result messages published to opgate.results and acknowledged by the broker.",
        )
        .expect("valid metric definition");
        registry
            .register(Box::new(results_published.clone()))
            .expect("metric registered once");
        let consumer_lag = IntGaugeVec::new(
            Opts::new(
                "opgate_consumer_lag",
                "Records between the ingest worker's position and the partition's end.",
            ),
            &["topic", "partition"],
        )
        .expect("valid metric definition");
        registry
            .register(Box::new(consumer_lag.clone()))
            .expect("metric registered once");
        Self {
            ingest_decisions: counter(
                &registry,
                "opgate_ingest_decisions_total",
                "Proposals decided at ingest (Kafka and HTTP), by decision.",
                &["decision"],
            ),
            dedupe_hits: counter(
                &registry,
                "opgate_dedupe_hits_total",
                "Duplicate proposals suppressed, by reason (inbox, key, window, exclusive_group).",
                &["reason"],
            ),
            rejections: counter(
                &registry,
                "opgate_rejections_total",
                "Proposals refused at ingest, by reason.",
                &["reason"],
            ),
            entity_conflicts: counter(
                &registry,
                "opgate_entity_conflicts_total",
                "Proposals that collided with another operation on their entity or key.",
                &["kind"],
            ),
            dlq: counter(
                &registry,
                "opgate_dlq_total",
                "Records written to opgate.dlq, by reason.",
                &["reason"],
            ),
            attempts: counter(
                &registry,
                "opgate_attempts_total",
                "Dispatch attempts, by tool and classified outcome.",
                &["tool", "outcome"],
            ),
            attempt_seconds: histogram(
                &registry,
                "opgate_attempt_duration_seconds",
                "Time from sending a call to its classified outcome.",
                &["tool"],
            ),
            unknown_outcomes: counter(
                &registry,
                "opgate_unknown_outcomes_total",
                "Attempts whose effect opgate cannot know (they go to the reconciler).",
                &["tool", "category"],
            ),
            reconciliations: counter(
                &registry,
                "opgate_reconciliations_total",
                "Reconciler lookups, by what they decided.",
                &["tool", "result"],
            ),
            reconciliation_lag: histogram(
                &registry,
                "opgate_reconciliation_lag_seconds",
                "How long an unknown outcome stayed unknown before it was resolved.",
                &["tool"],
            ),
            compensations: counter(
                &registry,
                "opgate_compensations_total",
                "Compensations started (a retry after a failed one counts again), by the compensated tool.",
                &["tool"],
            ),
            results_published,
            consumer_lag,
            registry,
        }
    }

    /// Counts one ingest decision (`decision` and `reason` as the ledger spells them).
    pub fn ingested(&self, decision: &str, reason: Option<&str>, inbox_hit: bool) {
        if inbox_hit {
            self.dedupe_hits.with_label_values(&["inbox"]).inc();
            return;
        }
        self.ingest_decisions.with_label_values(&[decision]).inc();
        let reason = reason.unwrap_or("none");
        match decision {
            "deduplicated" => {
                self.dedupe_hits.with_label_values(&[reason]).inc();
                if reason == "exclusive_group" {
                    self.entity_conflicts.with_label_values(&[reason]).inc();
                }
            }
            "rejected" => {
                self.rejections.with_label_values(&[reason]).inc();
                if reason == "key_conflict" {
                    self.entity_conflicts.with_label_values(&[reason]).inc();
                }
            }
            _ => {}
        }
    }

    /// The Prometheus text exposition of this process's metrics plus the ledger gauges.
    pub fn render(&self, ledger: Option<&LedgerGauges>) -> String {
        let mut families = self.registry.gather();
        if let Some(gauges) = ledger {
            families.extend(gauges.families());
        }
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&families, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

/// The process's metrics.
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// Gauges read from the ledger at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LedgerGauges {
    /// Live (not terminal) operations: (tool, side-effect class, status, count, age of
    /// the oldest in that state in seconds).
    pub live: Vec<(String, String, String, i64, f64)>,
    /// Dispatch-queue rows by queue state (parked, waiting, inflight, held).
    pub queue: Vec<(String, i64)>,
    /// Result rows not yet published.
    pub relay_pending: i64,
    /// Age of the oldest unpublished result, seconds (0 when none).
    pub relay_lag_seconds: f64,
    /// Result rows a relay round reads among (`LedgerStats::relay_window`).
    pub relay_window: i64,
}

impl LedgerGauges {
    fn families(&self) -> Vec<prometheus::proto::MetricFamily> {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = prometheus::GaugeVec::new(Opts::new(name, help), labels)
                .expect("valid metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("metric registered once");
            g
        };
        let operations = gauge(
            "opgate_operations",
            "Live (non-terminal) operations in the ledger, by tool, class and state.",
            &["tool", "class", "status"],
        );
        let oldest = gauge(
            "opgate_oldest_in_state_seconds",
            "Time the longest-waiting live operation has spent in its state.",
            &["status"],
        );
        for (tool, class, status, count, age) in &self.live {
            operations
                .with_label_values(&[tool, class, status])
                .set(*count as f64);
            let g = oldest.with_label_values(&[status]);
            if *age > g.get() {
                g.set(*age);
            }
        }
        let queue = gauge(
            "opgate_queue_depth",
            "Dispatch-queue rows by state.",
            &["state"],
        );
        for (state, count) in &self.queue {
            queue.with_label_values(&[state]).set(*count as f64);
        }
        gauge(
            "opgate_relay_pending",
            "Result messages in the outbox not yet published.",
            &[],
        )
        .with_label_values::<&str>(&[])
        .set(self.relay_pending as f64);
        gauge(
            "opgate_relay_lag_seconds",
            "Age of the oldest unpublished result message.",
            &[],
        )
        .with_label_values::<&str>(&[])
        .set(self.relay_lag_seconds);
        gauge(
            "opgate_relay_window_rows",
            "Result ids from the relay floor to the last one (PostgreSQL; an upper bound on the rows each relay round reads among, published or not): it grows while a transaction held open on the server holds the floor back.",
            &[],
        )
        .with_label_values::<&str>(&[])
        .set(self.relay_window as f64);
        registry.gather()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_decisions_fan_out_to_reason_counters() {
        let m = Metrics::new();
        m.ingested("accepted", None, false);
        m.ingested("deduplicated", Some("key"), false);
        m.ingested("deduplicated", Some("exclusive_group"), false);
        m.ingested("rejected", Some("key_conflict"), false);
        m.ingested("accepted", None, true);
        let text = m.render(None);
        for line in [
            "opgate_ingest_decisions_total{decision=\"accepted\"} 1",
            "opgate_dedupe_hits_total{reason=\"key\"} 1",
            "opgate_dedupe_hits_total{reason=\"inbox\"} 1",
            "opgate_entity_conflicts_total{kind=\"exclusive_group\"} 1",
            "opgate_entity_conflicts_total{kind=\"key_conflict\"} 1",
            "opgate_rejections_total{reason=\"key_conflict\"} 1",
        ] {
            assert!(text.contains(line), "missing `{line}` in\n{text}");
        }
    }

    #[test]
    fn ledger_gauges_render_with_the_oldest_age_per_state() {
        let gauges = LedgerGauges {
            live: vec![
                (
                    "pay".into(),
                    "irreversible".into(),
                    "unknown_outcome".into(),
                    2,
                    30.0,
                ),
                (
                    "mail".into(),
                    "external_non_idempotent".into(),
                    "unknown_outcome".into(),
                    1,
                    90.0,
                ),
            ],
            queue: vec![("waiting".into(), 3)],
            relay_pending: 4,
            relay_lag_seconds: 1.5,
            relay_window: 9,
        };
        let text = Metrics::new().render(Some(&gauges));
        for line in [
            "opgate_operations{class=\"irreversible\",status=\"unknown_outcome\",tool=\"pay\"} 2",
            "opgate_oldest_in_state_seconds{status=\"unknown_outcome\"} 90",
            "opgate_queue_depth{state=\"waiting\"} 3",
            "opgate_relay_pending 4",
            "opgate_relay_lag_seconds 1.5",
            "opgate_relay_window_rows 9",
        ] {
            assert!(text.contains(line), "missing `{line}` in\n{text}");
        }
    }

    /// Every metric name the code exports (vectors touched once so they render).
    fn exported() -> std::collections::BTreeSet<String> {
        let m = Metrics::new();
        for c in [
            &m.ingest_decisions,
            &m.dedupe_hits,
            &m.rejections,
            &m.entity_conflicts,
            &m.dlq,
            &m.compensations,
        ] {
            c.with_label_values(&["x"]).inc();
        }
        for c in [&m.attempts, &m.unknown_outcomes, &m.reconciliations] {
            c.with_label_values(&["x", "y"]).inc();
        }
        for h in [&m.attempt_seconds, &m.reconciliation_lag] {
            h.with_label_values(&["x"]).observe(1.0);
        }
        m.consumer_lag.with_label_values(&["x", "0"]).set(1);
        let gauges = LedgerGauges {
            live: vec![("t".into(), "c".into(), "s".into(), 1, 1.0)],
            queue: vec![("waiting".into(), 1)],
            ..LedgerGauges::default()
        };
        m.render(Some(&gauges))
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_owned)
            .collect()
    }

    /// `opgate_*` identifiers in a text.
    fn names_in(text: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        let mut rest = text;
        while let Some(at) = rest.find("opgate_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            names.insert(base.to_owned());
            rest = &tail[end..];
        }
        names
    }

    #[test]
    fn the_alert_rules_and_dashboard_use_only_exported_metrics() {
        let exported = exported();
        assert!(exported.len() >= 17, "{exported:?}");
        for (file, text) in [
            (
                "deploy/prometheus/opgate-alerts.yml",
                include_str!("../../../deploy/prometheus/opgate-alerts.yml"),
            ),
            (
                "deploy/grafana/opgate-dashboard.json",
                include_str!("../../../deploy/grafana/opgate-dashboard.json"),
            ),
        ] {
            let used = names_in(text);
            assert!(used.len() >= 5, "{file}: {used:?}");
            let unknown: Vec<_> = used.difference(&exported).collect();
            assert!(unknown.is_empty(), "{file} uses unexported {unknown:?}");
        }
    }
}
