//! Durable retry schedules as a pure function.
//!
//! The dispatcher does not sleep between attempts: it records `next_attempt_at` in the
//! ledger and lets the operation go. This module decides that delay from the tool's
//! budget, the number of attempts made, the time already spent, a provider's
//! `Retry-After` and a random source. In-process retry loops (a reconnect, a serialization
//! failure) use the `backon` crate instead; nothing here sleeps.

use std::time::Duration;

use rand::Rng;
use serde::Deserialize;

use crate::registry::SideEffectClass;

/// Where an operation goes when its retry budget is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExhausted {
    /// A person decides (`opgate ops resolve`).
    NeedsAttention,
    /// Give up; a new operation version is needed to try again.
    FailedPermanent,
}

/// A tool's retry budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts allowed, the first included.
    pub max_attempts: u32,
    /// Delay cap before the first retry; doubled per attempt.
    pub base: Duration,
    /// Largest delay drawn from the schedule.
    pub max_delay: Duration,
    /// Longest time from the first attempt to giving up.
    pub max_elapsed: Duration,
    /// Final state when the budget is spent.
    pub on_exhausted: OnExhausted,
}

impl RetryPolicy {
    /// The defaults for a class: 5 attempts, 200 ms base, 30 s cap, 10 min budget;
    /// reads end in `failed_permanent`, writes in `needs_attention`.
    pub fn default_for(class: SideEffectClass) -> Self {
        Self {
            max_attempts: 5,
            base: Duration::from_millis(200),
            max_delay: Duration::from_secs(30),
            max_elapsed: Duration::from_secs(600),
            on_exhausted: if class.is_write() {
                OnExhausted::NeedsAttention
            } else {
                OnExhausted::FailedPermanent
            },
        }
    }
}

/// Why a budget ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exhausted {
    /// `max_attempts` were made.
    MaxAttempts,
    /// The next attempt would start after `max_elapsed`.
    MaxElapsed,
}

/// The schedule's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDecision {
    /// Try again after this delay.
    After(Duration),
    /// Stop; the policy's `on_exhausted` state applies.
    Exhausted(Exhausted),
}

/// The delay before the next attempt, or the end of the budget.
///
/// `attempts_made` counts attempts already made (1 after the first failure);
/// `elapsed` is the time since the first attempt started. The delay is drawn with full
/// jitter from `[0, min(max_delay, base * 2^(attempts_made - 1))]`, then raised to
/// `retry_after` when the provider asked for more (a provider's floor beats our cap).
pub fn next_retry<R: Rng + ?Sized>(
    policy: &RetryPolicy,
    attempts_made: u32,
    elapsed: Duration,
    retry_after: Option<Duration>,
    rng: &mut R,
) -> RetryDecision {
    if attempts_made >= policy.max_attempts {
        return RetryDecision::Exhausted(Exhausted::MaxAttempts);
    }
    let cap = backoff_cap(policy, attempts_made);
    let jittered = if cap.is_zero() {
        Duration::ZERO
    } else {
        Duration::from_nanos(rng.random_range(0..=cap.as_nanos().min(u64::MAX as u128) as u64))
    };
    let delay = retry_after.map_or(jittered, |floor| jittered.max(floor));
    if elapsed.saturating_add(delay) > policy.max_elapsed {
        return RetryDecision::Exhausted(Exhausted::MaxElapsed);
    }
    RetryDecision::After(delay)
}

/// The upper bound of the jitter window after `attempts_made` attempts.
pub fn backoff_cap(policy: &RetryPolicy, attempts_made: u32) -> Duration {
    let doublings = attempts_made.saturating_sub(1).min(32);
    policy
        .base
        .saturating_mul(1u32 << doublings.min(31))
        .min(policy.max_delay)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 6,
            base: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            max_elapsed: Duration::from_secs(60),
            on_exhausted: OnExhausted::NeedsAttention,
        }
    }

    #[test]
    fn cap_doubles_then_saturates() {
        let p = policy();
        let caps: Vec<_> = (1..=6).map(|n| backoff_cap(&p, n).as_millis()).collect();
        assert_eq!(caps, vec![100, 200, 400, 800, 1600, 2000]);
        assert_eq!(backoff_cap(&p, 200), Duration::from_secs(2));
    }

    #[test]
    fn budget_ends_the_loop() {
        let mut rng = StdRng::seed_from_u64(1);
        let p = policy();
        assert_eq!(
            next_retry(&p, 6, Duration::ZERO, None, &mut rng),
            RetryDecision::Exhausted(Exhausted::MaxAttempts)
        );
        assert_eq!(
            next_retry(
                &p,
                1,
                Duration::from_secs(59),
                Some(Duration::from_secs(5)),
                &mut rng
            ),
            RetryDecision::Exhausted(Exhausted::MaxElapsed)
        );
    }

    #[test]
    fn retry_after_is_a_floor_even_above_the_cap() {
        let mut rng = StdRng::seed_from_u64(2);
        let d = next_retry(
            &policy(),
            1,
            Duration::ZERO,
            Some(Duration::from_secs(7)),
            &mut rng,
        );
        assert_eq!(d, RetryDecision::After(Duration::from_secs(7)));
    }

    proptest! {
        #[test]
        fn delays_stay_in_the_full_jitter_window(
            seed in any::<u64>(),
            attempts in 1u32..6,
            retry_after_ms in proptest::option::of(0u64..5_000),
        ) {
            let p = policy();
            let mut rng = StdRng::seed_from_u64(seed);
            let retry_after = retry_after_ms.map(Duration::from_millis);
            match next_retry(&p, attempts, Duration::ZERO, retry_after, &mut rng) {
                RetryDecision::After(d) => {
                    let cap = backoff_cap(&p, attempts);
                    let floor = retry_after.unwrap_or(Duration::ZERO);
                    prop_assert!(d >= floor);
                    prop_assert!(d <= cap.max(floor));
                }
                RetryDecision::Exhausted(e) => prop_assert!(false, "unexpected {e:?}"),
            }
        }

        #[test]
        fn a_schedule_always_terminates(seed in any::<u64>()) {
            let p = policy();
            let mut rng = StdRng::seed_from_u64(seed);
            let mut elapsed = Duration::ZERO;
            let mut attempts = 1;
            while let RetryDecision::After(d) = next_retry(&p, attempts, elapsed, None, &mut rng) {
                elapsed += d;
                attempts += 1;
                prop_assert!(attempts <= p.max_attempts);
            }
        }
    }
}
