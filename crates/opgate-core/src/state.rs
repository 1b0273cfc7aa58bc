//! The operation state machine: one pure transition function with an explicit event type.
//!
//! ```text
//! awaiting_approval --approve--> pending_dispatch --claim--> dispatched
//!        |reject/cancel                 |cancel                |
//!        v                              v                      +--acknowledged--> acknowledged
//!   rejected / cancelled            cancelled                  +--succeeded/noop--> completed_*
//!                                                              +--retry_scheduled--> failed_retryable --claim--> dispatched
//!                                                              +--failed_permanent--> failed_permanent
//!                                                              +--outcome_unknown--> unknown_outcome
//!                                                              '--escalate--> needs_attention
//! unknown_outcome --succeeded/noop/failed_permanent | redispatch --> pending_dispatch
//!                 | still_unknown (self) | escalate --> needs_attention | resolve(person)
//! needs_attention --resolve(person)--> completed_success | completed_noop | failed_permanent | pending_dispatch
//! acknowledged --still_unknown (self) | resolve(person)
//! completed_success --start_compensation--> compensating --compensation_succeeded--> compensated
//!                                                        '--compensation_failed--> completed_success
//! ```
//!
//! A failed compensation returns the operation to `completed_success` (its effect still
//! stands) and frees the entity; the compensating operation itself carries the failure
//! (`failed_permanent` or `needs_attention`). No path leads from a failed compensation
//! back to dispatching the original again.
//!
//! ```text
//! ```
//!
//! Every pair not listed is an [`IllegalTransition`]; the ledger refuses it too.

use std::fmt;

/// Operation states (DESIGN.md section 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Status {
    /// Waiting for a person's approval.
    AwaitingApproval,
    /// Ready (or waiting its turn) to be dispatched.
    PendingDispatch,
    /// Claimed by a dispatcher; an attempt row exists; the call may be in flight.
    Dispatched,
    /// The provider accepted it for asynchronous processing (202).
    Acknowledged,
    /// Done; the effect happened.
    CompletedSuccess,
    /// Done; nothing needed doing.
    CompletedNoop,
    /// An attempt failed without effect; a retry is scheduled.
    FailedRetryable,
    /// Failed for good; a new operation version is needed to try again.
    FailedPermanent,
    /// The call may or may not have happened; the reconciler must look it up.
    UnknownOutcome,
    /// A person must decide.
    NeedsAttention,
    /// A person rejected it.
    Rejected,
    /// Cancelled before dispatch.
    Cancelled,
    /// Its compensation is running.
    Compensating,
    /// Its effect was undone.
    Compensated,
}

impl Status {
    /// Every state.
    pub const ALL: [Self; 14] = [
        Self::AwaitingApproval,
        Self::PendingDispatch,
        Self::Dispatched,
        Self::Acknowledged,
        Self::CompletedSuccess,
        Self::CompletedNoop,
        Self::FailedRetryable,
        Self::FailedPermanent,
        Self::UnknownOutcome,
        Self::NeedsAttention,
        Self::Rejected,
        Self::Cancelled,
        Self::Compensating,
        Self::Compensated,
    ];

    /// The wire and database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AwaitingApproval => "awaiting_approval",
            Self::PendingDispatch => "pending_dispatch",
            Self::Dispatched => "dispatched",
            Self::Acknowledged => "acknowledged",
            Self::CompletedSuccess => "completed_success",
            Self::CompletedNoop => "completed_noop",
            Self::FailedRetryable => "failed_retryable",
            Self::FailedPermanent => "failed_permanent",
            Self::UnknownOutcome => "unknown_outcome",
            Self::NeedsAttention => "needs_attention",
            Self::Rejected => "rejected",
            Self::Cancelled => "cancelled",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
        }
    }

    /// Parses the wire spelling.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }

    /// Terminal states never change again (except a person-started compensation of
    /// `completed_success`).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::CompletedSuccess
                | Self::CompletedNoop
                | Self::FailedPermanent
                | Self::Rejected
                | Self::Cancelled
                | Self::Compensated
        )
    }

    /// States in which a write holds its entity: no other write on the entity may be
    /// dispatched. The ledger's unique partial index lists the same states.
    pub fn holds_entity(self) -> bool {
        matches!(
            self,
            Self::Dispatched
                | Self::Acknowledged
                | Self::UnknownOutcome
                | Self::NeedsAttention
                | Self::Compensating
        )
    }

    /// States a dispatcher may claim.
    pub fn is_claimable(self) -> bool {
        matches!(self, Self::PendingDispatch | Self::FailedRetryable)
    }

    /// States the reconciler looks up.
    pub fn is_reconcilable(self) -> bool {
        matches!(self, Self::UnknownOutcome | Self::Acknowledged)
    }

    /// States in which the operation did not act and never will (refused, cancelled,
    /// failed without effect, undone): they no longer count for a dedupe window or an
    /// exclusive group.
    pub fn never_acts(self) -> bool {
        matches!(
            self,
            Self::Rejected | Self::Cancelled | Self::FailedPermanent | Self::Compensated
        )
    }

    /// The states for which `pick` holds, as an SQL list of quoted names
    /// (`'dispatched', 'acknowledged'`): the ledger's queries are written from these
    /// functions, never from hand-kept lists.
    pub fn sql_list(pick: impl Fn(Self) -> bool) -> String {
        Self::ALL
            .into_iter()
            .filter(|s| pick(*s))
            .map(|s| format!("'{}'", s.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a person resolves an operation that needs attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Resolution {
    /// The effect happened.
    Succeeded,
    /// Nothing needed doing.
    Noop,
    /// It failed and must not be retried.
    Failed,
    /// It did not happen; dispatch it again.
    Redispatch,
}

/// Everything that can happen to an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    /// A person approved it.
    Approve,
    /// A person rejected it.
    Reject,
    /// It was cancelled before dispatch.
    Cancel,
    /// A dispatcher claimed it and persisted an attempt before calling the tool.
    Claim,
    /// The provider accepted it asynchronously.
    Acknowledge,
    /// The effect is confirmed (by the answer or by a lookup).
    Succeed,
    /// Confirmed that nothing needed doing.
    Noop,
    /// The attempt failed without effect; a retry is scheduled.
    ScheduleRetry,
    /// It failed for good.
    FailPermanently,
    /// The outcome is unknown (timeout after send, crash after dispatch, ambiguous 5xx).
    OutcomeUnknown,
    /// A lookup proved it did not happen (or the provider's key retention covers a resend).
    Redispatch,
    /// A lookup was inconclusive (or an acknowledged operation is still processing);
    /// look again later.
    StillUnknown,
    /// Hand it to a person.
    Escalate,
    /// A person's decision.
    Resolve(Resolution),
    /// Its compensation started.
    StartCompensation,
    /// Its compensation finished.
    CompensationSucceeded,
    /// Its compensation failed.
    CompensationFailed,
}

impl Event {
    /// Every event, for exhaustive tests.
    pub const ALL: [Self; 20] = [
        Self::Approve,
        Self::Reject,
        Self::Cancel,
        Self::Claim,
        Self::Acknowledge,
        Self::Succeed,
        Self::Noop,
        Self::ScheduleRetry,
        Self::FailPermanently,
        Self::OutcomeUnknown,
        Self::Redispatch,
        Self::StillUnknown,
        Self::Escalate,
        Self::Resolve(Resolution::Succeeded),
        Self::Resolve(Resolution::Noop),
        Self::Resolve(Resolution::Failed),
        Self::Resolve(Resolution::Redispatch),
        Self::StartCompensation,
        Self::CompensationSucceeded,
        Self::CompensationFailed,
    ];

    /// A stable name for logs and the event history.
    pub fn name(self) -> &'static str {
        match self {
            Self::Approve => "approve",
            Self::Reject => "reject",
            Self::Cancel => "cancel",
            Self::Claim => "claim",
            Self::Acknowledge => "acknowledge",
            Self::Succeed => "succeed",
            Self::Noop => "noop",
            Self::ScheduleRetry => "schedule_retry",
            Self::FailPermanently => "fail_permanently",
            Self::OutcomeUnknown => "outcome_unknown",
            Self::Redispatch => "redispatch",
            Self::StillUnknown => "still_unknown",
            Self::Escalate => "escalate",
            Self::Resolve(Resolution::Succeeded) => "resolve_succeeded",
            Self::Resolve(Resolution::Noop) => "resolve_noop",
            Self::Resolve(Resolution::Failed) => "resolve_failed",
            Self::Resolve(Resolution::Redispatch) => "resolve_redispatch",
            Self::StartCompensation => "start_compensation",
            Self::CompensationSucceeded => "compensation_succeeded",
            Self::CompensationFailed => "compensation_failed",
        }
    }
}

/// An event that the current state does not accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("illegal transition: `{}` does not accept `{}`", from, event.name())]
pub struct IllegalTransition {
    /// The current state.
    pub from: Status,
    /// The refused event.
    pub event: Event,
}

/// The state a new operation starts in.
pub fn initial_status(approval_required: bool) -> Status {
    if approval_required {
        Status::AwaitingApproval
    } else {
        Status::PendingDispatch
    }
}

/// The one transition function.
pub fn transition(from: Status, event: Event) -> Result<Status, IllegalTransition> {
    use Event as E;
    use Status as S;
    let to = match (from, event) {
        (S::AwaitingApproval, E::Approve) => S::PendingDispatch,
        (S::AwaitingApproval, E::Reject) => S::Rejected,
        (S::AwaitingApproval | S::PendingDispatch | S::FailedRetryable, E::Cancel) => S::Cancelled,

        (S::PendingDispatch | S::FailedRetryable, E::Claim) => S::Dispatched,

        (S::Dispatched, E::Acknowledge) => S::Acknowledged,
        (S::Dispatched, E::ScheduleRetry) => S::FailedRetryable,
        (S::Dispatched | S::Acknowledged | S::UnknownOutcome, E::Succeed) => S::CompletedSuccess,
        (S::Dispatched | S::Acknowledged | S::UnknownOutcome, E::Noop) => S::CompletedNoop,
        (S::Dispatched | S::Acknowledged | S::UnknownOutcome, E::FailPermanently) => {
            S::FailedPermanent
        }
        (S::Dispatched | S::Acknowledged, E::OutcomeUnknown) => S::UnknownOutcome,
        (S::Dispatched | S::Acknowledged | S::UnknownOutcome, E::Escalate) => S::NeedsAttention,

        (S::UnknownOutcome, E::Redispatch) => S::PendingDispatch,
        (S::UnknownOutcome, E::StillUnknown) => S::UnknownOutcome,
        (S::Acknowledged, E::StillUnknown) => S::Acknowledged,

        (S::UnknownOutcome | S::Acknowledged | S::NeedsAttention, E::Resolve(r)) => match r {
            Resolution::Succeeded => S::CompletedSuccess,
            Resolution::Noop => S::CompletedNoop,
            Resolution::Failed => S::FailedPermanent,
            Resolution::Redispatch => S::PendingDispatch,
        },

        (S::CompletedSuccess, E::StartCompensation) => S::Compensating,
        (S::Compensating, E::CompensationSucceeded) => S::Compensated,
        (S::Compensating, E::CompensationFailed) => S::CompletedSuccess,

        _ => return Err(IllegalTransition { from, event }),
    };
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// The legal transitions, written out independently of `transition` from the
    /// DESIGN.md section 3 state list, as (from, event name, to).
    const TABLE: &[(&str, &str, &str)] = &[
        ("awaiting_approval", "approve", "pending_dispatch"),
        ("awaiting_approval", "reject", "rejected"),
        ("awaiting_approval", "cancel", "cancelled"),
        ("pending_dispatch", "cancel", "cancelled"),
        ("pending_dispatch", "claim", "dispatched"),
        ("failed_retryable", "cancel", "cancelled"),
        ("failed_retryable", "claim", "dispatched"),
        ("dispatched", "acknowledge", "acknowledged"),
        ("dispatched", "schedule_retry", "failed_retryable"),
        ("dispatched", "succeed", "completed_success"),
        ("dispatched", "noop", "completed_noop"),
        ("dispatched", "fail_permanently", "failed_permanent"),
        ("dispatched", "outcome_unknown", "unknown_outcome"),
        ("dispatched", "escalate", "needs_attention"),
        ("acknowledged", "succeed", "completed_success"),
        ("acknowledged", "noop", "completed_noop"),
        ("acknowledged", "fail_permanently", "failed_permanent"),
        ("acknowledged", "outcome_unknown", "unknown_outcome"),
        ("acknowledged", "escalate", "needs_attention"),
        ("acknowledged", "still_unknown", "acknowledged"),
        ("acknowledged", "resolve_succeeded", "completed_success"),
        ("acknowledged", "resolve_noop", "completed_noop"),
        ("acknowledged", "resolve_failed", "failed_permanent"),
        ("acknowledged", "resolve_redispatch", "pending_dispatch"),
        ("unknown_outcome", "succeed", "completed_success"),
        ("unknown_outcome", "noop", "completed_noop"),
        ("unknown_outcome", "fail_permanently", "failed_permanent"),
        ("unknown_outcome", "redispatch", "pending_dispatch"),
        ("unknown_outcome", "still_unknown", "unknown_outcome"),
        ("unknown_outcome", "escalate", "needs_attention"),
        ("unknown_outcome", "resolve_succeeded", "completed_success"),
        ("unknown_outcome", "resolve_noop", "completed_noop"),
        ("unknown_outcome", "resolve_failed", "failed_permanent"),
        ("unknown_outcome", "resolve_redispatch", "pending_dispatch"),
        ("needs_attention", "resolve_succeeded", "completed_success"),
        ("needs_attention", "resolve_noop", "completed_noop"),
        ("needs_attention", "resolve_failed", "failed_permanent"),
        ("needs_attention", "resolve_redispatch", "pending_dispatch"),
        ("completed_success", "start_compensation", "compensating"),
        ("compensating", "compensation_succeeded", "compensated"),
        ("compensating", "compensation_failed", "completed_success"),
    ];

    #[test]
    fn transition_matches_the_table_exhaustively() {
        let table: BTreeSet<(&str, &str, &str)> = TABLE.iter().copied().collect();
        let mut seen = BTreeSet::new();
        for from in Status::ALL {
            for event in Event::ALL {
                match transition(from, event) {
                    Ok(to) => {
                        let row = (from.as_str(), event.name(), to.as_str());
                        assert!(table.contains(&row), "not in the table: {row:?}");
                        seen.insert(row);
                    }
                    Err(e) => {
                        assert_eq!((e.from, e.event), (from, event));
                        assert!(
                            !table
                                .iter()
                                .any(|(f, ev, _)| *f == from.as_str() && *ev == event.name()),
                            "table allows {} + {} but transition refuses",
                            from,
                            event.name()
                        );
                    }
                }
            }
        }
        assert_eq!(seen, table, "every table row is produced");
    }

    #[test]
    fn spellings_round_trip() {
        for s in Status::ALL {
            assert_eq!(Status::parse(s.as_str()), Some(s));
        }
        assert_eq!(Status::parse("done"), None);
    }

    fn event() -> impl Strategy<Value = Event> {
        proptest::sample::select(Event::ALL.to_vec())
    }

    proptest! {
        /// Whatever events arrive, in whatever order, the machine only ever reaches
        /// states allowed by the invariants below.
        #[test]
        fn no_event_sequence_reaches_an_illegal_state(
            approval in any::<bool>(),
            events in proptest::collection::vec(event(), 0..60),
        ) {
            let mut state = initial_status(approval);
            let mut dispatched_ever = false;
            for e in events {
                let before = state;
                let Ok(after) = transition(before, e) else { continue };
                // Terminal states are absorbing, except the person-started compensation.
                if before.is_terminal() {
                    prop_assert_eq!((before, e), (Status::CompletedSuccess, Event::StartCompensation));
                }
                // Nothing is dispatched without a claim.
                if after == Status::Dispatched {
                    prop_assert_eq!(e, Event::Claim);
                    prop_assert!(before.is_claimable());
                    dispatched_ever = true;
                }
                // Nothing completes, fails after sending or turns ambiguous without a dispatch.
                if matches!(after, Status::CompletedSuccess | Status::CompletedNoop | Status::UnknownOutcome
                    | Status::NeedsAttention | Status::Acknowledged | Status::FailedRetryable
                    | Status::FailedPermanent | Status::Compensating | Status::Compensated) {
                    prop_assert!(dispatched_ever, "{} reached without a dispatch", after);
                }
                // Approval gates dispatch.
                if before == Status::AwaitingApproval {
                    prop_assert!(matches!(after, Status::PendingDispatch | Status::Rejected | Status::Cancelled));
                }
                // An ambiguous operation is never blindly re-claimed.
                if before == Status::UnknownOutcome {
                    prop_assert!(after != Status::Dispatched);
                }
                // Nothing that went through compensation is dispatched again.
                if before == Status::Compensating {
                    prop_assert!(matches!(after, Status::Compensated | Status::CompletedSuccess));
                }
                state = after;
            }
        }
    }
}
