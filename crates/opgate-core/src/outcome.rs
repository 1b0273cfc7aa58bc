//! Outcome classification: what an adapter saw x the tool's side-effect class -> the
//! next state, a retry, or reconciliation (DESIGN.md section 3).
//!
//! Adapters decide once, at their edge, which [`AdapterOutcome`] they saw; nothing
//! downstream parses error strings. [`classify`] turns it into a [`Verdict`] and
//! [`decide`] applies the tool's retry budget to give the ledger an [`Event`].

use std::time::Duration;

use rand::Rng;

use crate::registry::{FiveXx, SideEffectClass};
use crate::retry::{OnExhausted, RetryDecision, RetryPolicy, next_retry};
use crate::state::Event;

/// What a dispatch attempt observed, decided once by the adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdapterOutcome {
    /// The request never left (connect refused, DNS, pool timeout before write).
    NotSent,
    /// 429 / 503 with an optional Retry-After.
    Throttled {
        /// The provider's Retry-After.
        retry_after: Option<Duration>,
    },
    /// Timeout or connection drop after the request was written.
    SentNoAnswer,
    /// A 4xx validation or business rejection.
    Rejected {
        /// HTTP status, when there is one.
        status: Option<u16>,
    },
    /// A 5xx answer.
    ServerError {
        /// HTTP status.
        status: u16,
    },
    /// 2xx; `acknowledged` for 202 (accepted, processing asynchronously).
    Committed {
        /// True for 202-style asynchronous acceptance.
        acknowledged: bool,
    },
    /// An answer that could not be read; the provider may have acted.
    Malformed,
    /// opgate refused to send: the request cannot be expressed faithfully (a key that is
    /// not a valid header value). Nothing left the process, and no retry can help.
    Unsendable,
}

impl AdapterOutcome {
    /// The error category carried in results and logs (`None` on success).
    pub fn error_category(&self) -> Option<&'static str> {
        match self {
            Self::NotSent => Some("not_sent"),
            Self::Throttled { .. } => Some("throttled"),
            Self::SentNoAnswer => Some("timeout_after_send"),
            Self::Rejected { .. } => Some("rejected"),
            Self::ServerError { .. } => Some("server_error"),
            Self::Malformed => Some("malformed_response"),
            Self::Unsendable => Some("unsendable"),
            Self::Committed { .. } => None,
        }
    }
}

/// The tool's contract relevant to classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Contract {
    /// Side-effect class.
    pub class: SideEffectClass,
    /// How a 5xx is read.
    pub five_xx: FiveXx,
    /// The provider honours the idempotency key and the key is still inside its
    /// retention window, so a resend with the same key cannot duplicate the effect.
    pub resend_is_safe: bool,
}

/// The classification before the retry budget applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The effect happened.
    Complete,
    /// Accepted asynchronously.
    Acknowledge,
    /// Nothing happened (or a resend is proven safe): retry, no sooner than `floor`.
    Retry {
        /// Retry-After floor.
        floor: Option<Duration>,
        /// The attempt may have taken effect (a resend is safe only thanks to the
        /// provider's idempotency). When the budget runs out, such an operation must be
        /// reconciled, never declared failed.
        ambiguous: bool,
    },
    /// It may have happened: look the key up before anything is resent.
    Reconcile,
    /// Rejected for good.
    FailPermanent,
}

/// Classifies an outcome for a tool.
pub fn classify(outcome: &AdapterOutcome, contract: Contract) -> Verdict {
    // May the call be repeated although it may have taken effect?
    let repeatable = contract.class == SideEffectClass::Read || contract.resend_is_safe;
    match outcome {
        AdapterOutcome::Committed {
            acknowledged: false,
        } => Verdict::Complete,
        AdapterOutcome::Committed { acknowledged: true } => Verdict::Acknowledge,
        AdapterOutcome::Rejected { .. } | AdapterOutcome::Unsendable => Verdict::FailPermanent,
        AdapterOutcome::NotSent => Verdict::Retry {
            floor: None,
            ambiguous: false,
        },
        AdapterOutcome::Throttled { retry_after } => Verdict::Retry {
            floor: *retry_after,
            ambiguous: false,
        },
        AdapterOutcome::ServerError { .. } if contract.five_xx == FiveXx::Retryable => {
            Verdict::Retry {
                floor: None,
                ambiguous: false,
            }
        }
        AdapterOutcome::SentNoAnswer
        | AdapterOutcome::ServerError { .. }
        | AdapterOutcome::Malformed => {
            if repeatable {
                Verdict::Retry {
                    floor: None,
                    ambiguous: contract.class.is_write(),
                }
            } else {
                Verdict::Reconcile
            }
        }
    }
}

/// What the dispatcher records for an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// The event to apply.
    pub event: Event,
    /// For a scheduled retry, how long to wait (on the database clock).
    pub retry_in: Option<Duration>,
    /// Whether the error (if any) is retryable from the agent's point of view.
    pub retryable: bool,
}

/// Applies the retry budget to a verdict.
///
/// `attempts_made` includes the attempt just finished; `elapsed` is the time since the
/// first attempt started.
pub fn decide<R: Rng + ?Sized>(
    verdict: Verdict,
    policy: &RetryPolicy,
    attempts_made: u32,
    elapsed: Duration,
    rng: &mut R,
) -> Decision {
    let done = |event| Decision {
        event,
        retry_in: None,
        retryable: false,
    };
    match verdict {
        Verdict::Complete => done(Event::Succeed),
        Verdict::Acknowledge => done(Event::Acknowledge),
        Verdict::FailPermanent => done(Event::FailPermanently),
        Verdict::Reconcile => done(Event::OutcomeUnknown),
        Verdict::Retry { floor, ambiguous } => {
            match next_retry(policy, attempts_made, elapsed, floor, rng) {
                RetryDecision::After(delay) => Decision {
                    event: Event::ScheduleRetry,
                    retry_in: Some(delay),
                    retryable: true,
                },
                // The last attempt may have taken effect: find out before anyone says "failed".
                RetryDecision::Exhausted(_) if ambiguous => done(Event::OutcomeUnknown),
                RetryDecision::Exhausted(_) => done(match policy.on_exhausted {
                    OnExhausted::NeedsAttention => Event::Escalate,
                    OnExhausted::FailedPermanent => Event::FailPermanently,
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use SideEffectClass as C;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn contract(class: C, five_xx: FiveXx, resend_is_safe: bool) -> Contract {
        Contract {
            class,
            five_xx,
            resend_is_safe,
        }
    }

    /// The DESIGN.md section 3 table, every outcome x every class.
    #[test]
    fn classification_table() {
        let outcomes = [
            AdapterOutcome::NotSent,
            AdapterOutcome::Throttled {
                retry_after: Some(Duration::from_secs(3)),
            },
            AdapterOutcome::SentNoAnswer,
            AdapterOutcome::Rejected { status: Some(422) },
            AdapterOutcome::ServerError { status: 500 },
            AdapterOutcome::Committed {
                acknowledged: false,
            },
            AdapterOutcome::Committed { acknowledged: true },
            AdapterOutcome::Malformed,
        ];
        for class in C::ALL {
            for resend_is_safe in [false, true] {
                for five_xx in [FiveXx::Unknown, FiveXx::Retryable] {
                    let c = contract(class, five_xx, resend_is_safe);
                    let repeatable = class == C::Read || resend_is_safe;
                    for o in &outcomes {
                        let plain = Verdict::Retry {
                            floor: None,
                            ambiguous: false,
                        };
                        let expected = match o {
                            AdapterOutcome::NotSent => plain,
                            AdapterOutcome::Throttled { .. } => Verdict::Retry {
                                floor: Some(Duration::from_secs(3)),
                                ambiguous: false,
                            },
                            AdapterOutcome::Rejected { .. } => Verdict::FailPermanent,
                            AdapterOutcome::Committed { acknowledged: true } => {
                                Verdict::Acknowledge
                            }
                            AdapterOutcome::Committed {
                                acknowledged: false,
                            } => Verdict::Complete,
                            AdapterOutcome::ServerError { .. } if five_xx == FiveXx::Retryable => {
                                plain
                            }
                            _ if repeatable => Verdict::Retry {
                                floor: None,
                                ambiguous: class.is_write(),
                            },
                            _ => Verdict::Reconcile,
                        };
                        assert_eq!(classify(o, c), expected, "{o:?} x {c:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_timeout_on_a_write_is_never_a_blind_resend() {
        for class in [
            C::InternalWrite,
            C::ExternalIdempotent,
            C::ExternalNonIdempotent,
            C::Irreversible,
        ] {
            let v = classify(
                &AdapterOutcome::SentNoAnswer,
                contract(class, FiveXx::Unknown, false),
            );
            assert_eq!(v, Verdict::Reconcile, "{class:?}");
        }
    }

    #[test]
    fn decide_applies_the_budget() {
        let mut rng = StdRng::seed_from_u64(9);
        let policy = RetryPolicy::default_for(C::Irreversible);
        let plain = Verdict::Retry {
            floor: None,
            ambiguous: false,
        };
        let d = decide(plain, &policy, 1, Duration::ZERO, &mut rng);
        assert_eq!(d.event, Event::ScheduleRetry);
        assert!(d.retry_in.is_some_and(|r| r <= policy.base));
        assert_eq!(
            decide(plain, &policy, 5, Duration::ZERO, &mut rng).event,
            Event::Escalate
        );
        let reads = RetryPolicy::default_for(C::Read);
        assert_eq!(
            decide(plain, &reads, 5, Duration::ZERO, &mut rng).event,
            Event::FailPermanently
        );
        assert_eq!(
            decide(Verdict::Reconcile, &policy, 1, Duration::ZERO, &mut rng).event,
            Event::OutcomeUnknown
        );
        // An exhausted budget after an ambiguous attempt is never reported as failed.
        let failing = RetryPolicy {
            on_exhausted: OnExhausted::FailedPermanent,
            ..policy
        };
        let ambiguous = Verdict::Retry {
            floor: None,
            ambiguous: true,
        };
        assert_eq!(
            decide(ambiguous, &failing, 5, Duration::ZERO, &mut rng).event,
            Event::OutcomeUnknown
        );
    }
}
