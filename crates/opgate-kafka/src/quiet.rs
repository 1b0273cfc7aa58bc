//! Repeating client errors, logged once and then summarized: with the broker down,
//! librdkafka reports `AllBrokersDown` (and the consumer returns an error) several times a
//! second per client — ~500 log lines in 15 s before this. Each kind of error is logged
//! when first seen, then at most once per [`SUMMARY_EVERY`] with how many were left out.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::error::KafkaError;

/// How often a repeating error is logged again, with its count.
pub const SUMMARY_EVERY: Duration = Duration::from_secs(30);

/// What to do with one occurrence of an error already seen `seen` times, last logged at
/// `logged` (`None`: never).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Log it, saying how many occurrences since the last line were left out.
    Log {
        /// Occurrences not logged since the last line.
        left_out: u64,
    },
    /// Leave it out (it is counted).
    Skip,
}

/// The policy: the first occurrence is logged; then one line per `every`.
pub fn verdict(logged: Option<Instant>, now: Instant, every: Duration, left_out: u64) -> Verdict {
    match logged {
        Some(at) if now.saturating_duration_since(at) < every => Verdict::Skip,
        _ => Verdict::Log { left_out },
    }
}

/// Per error kind: when it was last logged and how many were left out since.
#[derive(Default)]
pub struct Throttle {
    kinds: Mutex<HashMap<String, (Instant, u64)>>,
}

impl Throttle {
    /// Counts one occurrence of `kind`; returns how many were left out when it should be
    /// logged now, `None` when it should not.
    pub fn admit(&self, kind: &str, now: Instant, every: Duration) -> Option<u64> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        let entry = kinds.get(kind).copied();
        match verdict(
            entry.map(|(at, _)| at),
            now,
            every,
            entry.map_or(0, |(_, n)| n),
        ) {
            Verdict::Log { left_out } => {
                kinds.insert(kind.to_owned(), (now, 0));
                Some(left_out)
            }
            Verdict::Skip => {
                if let Some((_, n)) = kinds.get_mut(kind) {
                    *n += 1;
                }
                None
            }
        }
    }
}

/// The process's throttle for Kafka client errors (every client shares it, so four
/// clients with the broker down still make one line per kind per period).
pub fn throttle() -> &'static Throttle {
    static THROTTLE: OnceLock<Throttle> = OnceLock::new();
    THROTTLE.get_or_init(Throttle::default)
}

/// Logs a Kafka client error through the process's throttle.
pub fn report(source: &str, error: &KafkaError, reason: &str) {
    let kind = format!(
        "{source}: {}",
        error
            .rdkafka_error_code()
            .map_or_else(|| error.to_string(), |c| format!("{c:?}"))
    );
    if let Some(left_out) = throttle().admit(&kind, Instant::now(), SUMMARY_EVERY) {
        if left_out == 0 {
            tracing::warn!(%error, reason, "{source}");
        } else {
            tracing::warn!(
                %error,
                reason,
                repeated = left_out,
                "{source} (again; {left_out} more like it since the last line, at most one line per {}s)",
                SUMMARY_EVERY.as_secs()
            );
        }
    }
}

/// Logs one of librdkafka's own log lines: warnings and errors (a refused connection is
/// `FAIL`, once per broker thread and retry) through the throttle, keyed by facility; the
/// rest, and the warnings that are no news ([`expected`]), at debug level.
pub fn log(level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
    use rdkafka::config::RDKafkaLogLevel as L;
    match level {
        L::Emerg | L::Alert | L::Critical | L::Error | L::Warning if !expected(fac, message) => {
            let kind = format!("librdkafka {fac}: {}", log_kind(message));
            if let Some(left_out) = throttle().admit(&kind, Instant::now(), SUMMARY_EVERY) {
                if left_out == 0 {
                    tracing::warn!(target: "librdkafka", "{fac}: {message}");
                } else {
                    tracing::warn!(
                        target: "librdkafka",
                        repeated = left_out,
                        "{fac}: {message} (again; {left_out} more like it since the last line, at most one line per {}s)",
                        SUMMARY_EVERY.as_secs()
                    );
                }
            }
        }
        _ => tracing::debug!(target: "librdkafka", "{fac}: {message}"),
    }
}

/// A librdkafka warning that says only what opgate's configuration means to do:
/// `[kafka.client]` configures every client, so each consumer property is "ignored by this
/// producer instance" and each producer property by a consumer, once per client made.
fn expected(fac: &str, message: &str) -> bool {
    fac == "CONFWARN"
        && (message.contains("is a consumer property and will be ignored by this producer")
            || message.contains("is a producer property and will be ignored by this consumer"))
}

/// What a librdkafka log line is about, without what varies between repeats of it:
/// the text after its last `": "` (the cause: `Connection refused (after 0ms in state
/// CONNECT)`, `SSL handshake failed ...`) with digits dropped, so a refused connection to
/// each broker is one kind and a TLS failure another.
fn log_kind(message: &str) -> String {
    let cause = message.rsplit(": ").next().unwrap_or(message);
    cause.chars().filter(|c| !c.is_ascii_digit()).collect()
}

/// A client context that reports librdkafka's errors through the throttle (producers
/// and the broker probe; the ingest consumer's context does the same).
#[derive(Clone, Copy, Default)]
pub struct QuietContext;

impl ClientContext for QuietContext {
    fn error(&self, error: KafkaError, reason: &str) {
        report("kafka client error", &error, reason);
    }

    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        log(level, fac, message);
    }
}

/// The broker probe is a consumer that never joins a group: the defaults suffice.
impl rdkafka::consumer::ConsumerContext for QuietContext {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeating_error_is_logged_once_then_once_per_period_with_its_count() {
        let t = Throttle::default();
        let start = Instant::now();
        let every = Duration::from_secs(30);
        assert_eq!(t.admit("AllBrokersDown", start, every), Some(0));
        // 10 a second for 29 s: none logged.
        for i in 1..290 {
            let at = start + Duration::from_millis(100 * i);
            assert_eq!(t.admit("AllBrokersDown", at, every), None);
        }
        // Another kind is not held back by the first.
        assert_eq!(t.admit("Authentication", start + every / 2, every), Some(0));
        // After the period: one line, counting what was left out.
        assert_eq!(t.admit("AllBrokersDown", start + every, every), Some(289));
        assert_eq!(t.admit("AllBrokersDown", start + every, every), None);
    }

    #[test]
    fn a_shared_property_ignored_by_one_kind_of_client_is_no_warning() {
        let ignored = "[thrd:app]: Configuration property session.timeout.ms is a consumer property and will be ignored by this producer instance";
        assert!(expected("CONFWARN", ignored));
        assert!(expected(
            "CONFWARN",
            "[thrd:app]: Configuration property linger.ms is a producer property and will be ignored by this consumer instance"
        ));
        // Other configuration warnings stay warnings.
        assert!(!expected(
            "CONFWARN",
            "[thrd:app]: Configuration property queue.buffering.max.ms is deprecated"
        ));
        assert!(!expected("FAIL", ignored));
    }

    #[test]
    fn log_lines_are_grouped_by_their_cause_not_their_broker() {
        let refused = |port: u16| {
            log_kind(&format!(
                "[thrd:127.0.0.1:{port}/bootstrap]: 127.0.0.1:{port}/bootstrap: Connect to ipv4#127.0.0.1:{port} failed: Connection refused (after 0ms in state CONNECT)"
            ))
        };
        assert_eq!(refused(9092), refused(9093));
        let tls = log_kind(
            "[thrd:b1:9093/1]: b1:9093/1: SSL handshake failed: error:0A000086: certificate verify failed",
        );
        assert_ne!(tls, refused(9092));
    }

    #[test]
    fn the_policy_logs_the_first_and_after_each_period() {
        let now = Instant::now();
        let every = Duration::from_secs(30);
        assert_eq!(verdict(None, now, every, 0), Verdict::Log { left_out: 0 });
        assert_eq!(
            verdict(Some(now), now + Duration::from_secs(29), every, 5),
            Verdict::Skip
        );
        assert_eq!(
            verdict(Some(now), now + every, every, 5),
            Verdict::Log { left_out: 5 }
        );
    }
}
