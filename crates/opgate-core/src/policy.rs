//! The dispatch policy: one pure function per decision the dispatcher and the reconciler
//! make about sending, over the operation's history (`ambiguous_since`), the tool, what
//! the adapter reported, the time now and the lease time left.
//!
//! The rules (issue 9, DESIGN.md section 3):
//! - **Ambiguity is remembered.** Once an attempt may have taken effect (timeout after
//!   send, an unknown 5xx, an unreadable answer, a crash after dispatch), the operation
//!   carries `ambiguous_since` until a lookup settles it. Until then it never ends
//!   `failed_permanent`, `cancelled` or `rejected`: whatever a later attempt sees (not
//!   sent, throttled past the budget, a 4xx such as "idempotency key in use"), it goes to
//!   `unknown_outcome` and the reconciler looks the key up.
//! - **A resend of an ambiguous operation is safe only inside the provider's memory**:
//!   the provider honours the key, and the send happens within `provider_retention` of
//!   the *first* ambiguous attempt (with two tool timeouts of margin). Checked when the
//!   outcome is classified, again when a dispatcher holds the claim, and again right
//!   before the call ([`may_send`]).
//! - **Nothing is sent without the lease to cover it**: less than one tool timeout of
//!   lease left (after any in-process wait) and the claim is given back unsent.

use std::time::Duration;

use rand::Rng;
use time::OffsetDateTime;

use crate::outcome::{AdapterOutcome, Contract, classify, decide};
use crate::registry::{FiveXx, SideEffectClass, Tool};
use crate::state::Event;

/// Whether a resend with the same key cannot duplicate the effect at `now`: the provider
/// honours the key (an idempotency header, or a key body field on a class that promises
/// idempotency), it remembers keys for `provider_retention`, and `now` plus two request
/// timeouts is still inside that retention counted from `since` (the first ambiguous
/// attempt; the first attempt when there is none yet). One timeout covers the call
/// reaching the provider and being applied; the second covers the time between this
/// check and the send in a process slowed by load (the fault-schedule simulator, 1,000
/// seeds at once on two cores, once saw a resend land just past a 1 s retention with a
/// margin of one 100 ms timeout).
pub fn resend_is_safe(tool: &Tool, since: Option<OffsetDateTime>, now: OffsetDateTime) -> bool {
    let Some(adapter) = &tool.adapter else {
        return false;
    };
    let (Some(retention), Some(since)) = (adapter.provider_retention, since) else {
        return false;
    };
    let age = Duration::try_from(now - since).unwrap_or(Duration::MAX);
    honours_key(tool) && age.saturating_add(adapter.timeout.saturating_mul(2)) < retention
}

/// Whether the provider dedupes on the key opgate sends. A key in the body of an
/// `external_non_idempotent` tool is a reference for lookups, not a promise.
pub fn honours_key(tool: &Tool) -> bool {
    let Some(adapter) = &tool.adapter else {
        return false;
    };
    adapter.config.idempotency_header.is_some()
        || (adapter.config.key_body_field.is_some()
            && tool.side_effect_class != SideEffectClass::ExternalNonIdempotent)
}

/// Whether an outcome means the attempt may have taken effect (for a write).
pub fn may_have_taken_effect(outcome: &AdapterOutcome, tool: &Tool) -> bool {
    tool.side_effect_class.is_write()
        && match outcome {
            AdapterOutcome::SentNoAnswer | AdapterOutcome::Malformed => true,
            AdapterOutcome::ServerError { .. } => tool.five_xx() == FiveXx::Unknown,
            AdapterOutcome::NotSent
            | AdapterOutcome::Throttled { .. }
            | AdapterOutcome::Rejected { .. }
            | AdapterOutcome::Committed { .. }
            | AdapterOutcome::Unsendable => false,
        }
}

/// Why a claimed operation must not be sent now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Less than one tool timeout of lease is left: give the claim back unsent.
    LeaseTooShort,
    /// An earlier attempt may have taken effect and the provider's key retention no
    /// longer covers a resend: look the key up instead.
    ResendNotSafe,
}

impl Hold {
    /// The event to record for a claim that was not sent, and its reason.
    pub fn event(self) -> (Event, &'static str) {
        match self {
            Self::LeaseTooShort => (Event::ScheduleRetry, "lease_too_short_to_send"),
            Self::ResendNotSafe => (Event::OutcomeUnknown, "resend_window_passed"),
        }
    }
}

/// Whether a claimed operation may be sent now (checked when the claim is taken and
/// again right before the call, after every in-process wait).
pub fn may_send(
    tool: &Tool,
    ambiguous_since: Option<OffsetDateTime>,
    now: OffsetDateTime,
    lease_left: Duration,
) -> Result<(), Hold> {
    let timeout = tool.adapter.as_ref().map(|a| a.timeout).unwrap_or_default();
    if lease_left < timeout {
        return Err(Hold::LeaseTooShort);
    }
    if ambiguous_since.is_some() && !resend_is_safe(tool, ambiguous_since, now) {
        return Err(Hold::ResendNotSafe);
    }
    Ok(())
}

/// What the operation's ambiguity becomes with a recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ambiguity {
    /// Unchanged.
    #[default]
    Keep,
    /// An attempt that started at this instant may have taken effect (kept if an
    /// earlier ambiguity is already recorded: the first one counts).
    Since(OffsetDateTime),
    /// A lookup (or a person) settled it.
    Clear,
}

impl Ambiguity {
    /// Applies to the stored value.
    pub fn apply(self, current: Option<OffsetDateTime>) -> Option<OffsetDateTime> {
        match self {
            Self::Keep => current,
            Self::Since(at) => current.or(Some(at)),
            Self::Clear => None,
        }
    }
}

/// What the dispatcher records for an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptDecision {
    /// The event to apply.
    pub event: Event,
    /// For a scheduled retry, how long to wait (on the database clock).
    pub retry_in: Option<Duration>,
    /// Whether the error (if any) is retryable from the agent's point of view.
    pub retryable: bool,
    /// The operation's ambiguity after this attempt.
    pub ambiguity: Ambiguity,
}

/// One finished attempt, as the dispatcher saw it.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// What the adapter reported.
    pub outcome: &'a AdapterOutcome,
    /// Attempts made, this one included.
    pub number: u32,
    /// When this attempt was claimed (database clock).
    pub started_at: OffsetDateTime,
    /// When the first attempt started (the budget's `max_elapsed` counts from it).
    pub first_attempt_at: OffsetDateTime,
    /// The operation's ambiguity before this attempt.
    pub ambiguous_since: Option<OffsetDateTime>,
    /// Now (database clock at the claim plus the time the call took).
    pub now: OffsetDateTime,
}

/// Decides what follows an attempt: classification, the retry budget, then the
/// ambiguity rules of this module.
pub fn after_attempt<R: Rng + ?Sized>(
    tool: &Tool,
    attempt: &Attempt<'_>,
    rng: &mut R,
) -> AttemptDecision {
    let this_ambiguous = may_have_taken_effect(attempt.outcome, tool);
    let ambiguity = if this_ambiguous {
        Ambiguity::Since(attempt.started_at)
    } else {
        Ambiguity::Keep
    };
    let ambiguous_since = ambiguity.apply(attempt.ambiguous_since);
    let resend_safe = resend_is_safe(tool, ambiguous_since, attempt.now);
    let contract = Contract {
        class: tool.side_effect_class,
        five_xx: tool.five_xx(),
        resend_is_safe: resend_safe,
    };
    let verdict = classify(attempt.outcome, contract);
    let elapsed = Duration::try_from(attempt.now - attempt.first_attempt_at).unwrap_or_default();
    let base = decide(verdict, &tool.retry, attempt.number, elapsed, rng);
    let mut decision = AttemptDecision {
        event: base.event,
        retry_in: base.retry_in,
        retryable: base.retryable,
        ambiguity,
    };
    if ambiguous_since.is_some() {
        let settles_as_failed = matches!(decision.event, Event::FailPermanently | Event::Escalate);
        let blind_resend = decision.event == Event::ScheduleRetry && !resend_safe;
        if settles_as_failed || blind_resend {
            // An effect may exist: only a lookup (or a person after it) may say otherwise.
            decision.event = Event::OutcomeUnknown;
            decision.retry_in = None;
            decision.retryable = false;
        }
    }
    decision
}

/// The event for an operation claimed past its attempt budget (it is not sent).
pub fn over_budget(tool: &Tool, ambiguous_since: Option<OffsetDateTime>) -> Event {
    if ambiguous_since.is_some() {
        return Event::OutcomeUnknown;
    }
    match tool.retry.on_exhausted {
        crate::retry::OnExhausted::NeedsAttention => Event::Escalate,
        crate::retry::OnExhausted::FailedPermanent => Event::FailPermanently,
    }
}

/// Whether a person's command may apply: an operation that may have taken effect cannot
/// be cancelled or rejected (its effect would stand while the ledger says it never
/// happened); a person resolves it instead, after checking the provider.
pub fn command_refusal(event: Event, ambiguous_since: Option<OffsetDateTime>) -> Option<String> {
    let verb = match event {
        Event::Cancel => "cancelled",
        Event::Reject => "rejected",
        _ => return None,
    };
    ambiguous_since.map(|since| {
        format!(
            "an attempt made at {} may have taken effect, so it cannot be {verb}; check the provider and resolve it instead",
            crate::canonical::format_utc(since)
        )
    })
}

/// What a lookup by key at the provider found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The tool has no lookup: a person must check.
    NoLookup,
    /// The provider has the effect.
    Found,
    /// The provider does not know the key (yet).
    NotFound,
    /// The lookup itself failed.
    Failed,
}

/// What the reconciler knows when it decides.
#[derive(Debug, Clone, Copy)]
pub struct Lookup {
    /// What the lookup found.
    pub seen: Seen,
    /// The operation was acknowledged (202) rather than ambiguous.
    pub acknowledged: bool,
    /// How long the operation has been unknown (or, acknowledged, since its first attempt).
    pub waited: Duration,
    /// Attempts made so far.
    pub attempts_made: u32,
    /// The operation's ambiguity.
    pub ambiguous_since: Option<OffsetDateTime>,
    /// Its first attempt.
    pub first_attempt_at: Option<OffsetDateTime>,
    /// The database clock.
    pub now: OffsetDateTime,
}

/// What follows a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LookupDecision {
    /// The event.
    pub event: Event,
    /// Why, for the history and metrics.
    pub reason: &'static str,
    /// What the ambiguity becomes.
    pub ambiguity: Ambiguity,
    /// When to look again (`StillUnknown`): at least this long.
    pub look_again_in: Option<Duration>,
}

/// Decides what follows a lookup:
/// - found -> `completed_success`;
/// - not found, and a resend is safe (the provider remembers the key) with attempts left
///   -> re-dispatch, the ambiguity kept (the dispatcher checks the window again);
/// - not found past the tool's `lookup_grace` (eventual consistency cannot explain the
///   miss: proof of absence) -> the ambiguity is settled: re-dispatch with attempts
///   left, else the tool's `on_exhausted`;
/// - a miss inside the grace, a failing lookup, an acknowledged operation still in
///   progress -> look again later; past the budget's `max_elapsed` -> a person;
/// - no lookup -> a person.
pub fn after_lookup(tool: &Tool, l: &Lookup) -> LookupDecision {
    let decision = |event, reason, ambiguity| LookupDecision {
        event,
        reason,
        ambiguity,
        look_again_in: None,
    };
    let again = |reason, wait: Duration| LookupDecision {
        event: Event::StillUnknown,
        reason,
        ambiguity: Ambiguity::Keep,
        look_again_in: Some(wait),
    };
    let budget = tool.retry.max_elapsed;
    let grace = tool
        .adapter
        .as_ref()
        .map(|a| a.lookup_grace)
        .unwrap_or_default();
    let backoff = l.waited / 2;
    match l.seen {
        Seen::NoLookup => decision(Event::Escalate, "no_lookup", Ambiguity::Keep),
        Seen::Found => decision(Event::Succeed, "lookup_found", Ambiguity::Clear),
        Seen::NotFound if l.acknowledged => {
            if l.waited > budget {
                decision(
                    Event::Escalate,
                    "acknowledged_never_completed",
                    Ambiguity::Keep,
                )
            } else {
                again("still_processing", backoff)
            }
        }
        Seen::NotFound => {
            let attempts_left = l.attempts_made < tool.retry.max_attempts;
            let since = l.ambiguous_since.or(l.first_attempt_at);
            if attempts_left && resend_is_safe(tool, since, l.now) {
                decision(
                    Event::Redispatch,
                    "lookup_missed_resend_safe",
                    Ambiguity::Keep,
                )
            } else if l.waited >= grace && attempts_left {
                decision(Event::Redispatch, "lookup_proved_absent", Ambiguity::Clear)
            } else if l.waited >= grace {
                let event = match tool.retry.on_exhausted {
                    crate::retry::OnExhausted::NeedsAttention => Event::Escalate,
                    crate::retry::OnExhausted::FailedPermanent => Event::FailPermanently,
                };
                decision(event, "lookup_proved_absent_budget_spent", Ambiguity::Clear)
            } else {
                again(
                    "lookup_missed_within_grace",
                    grace
                        .saturating_sub(l.waited)
                        .max(Duration::from_millis(100)),
                )
            }
        }
        Seen::Failed if l.waited > budget => {
            decision(Event::Escalate, "lookup_failing", Ambiguity::Keep)
        }
        Seen::Failed => again("lookup_failed", backoff),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::Registry;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use time::macros::datetime;

    /// One tool per (class, provider keying, five_xx, on_exhausted) that the registry
    /// accepts.
    fn tools() -> Vec<Tool> {
        let mut toml = String::new();
        let mut n = 0;
        for class in [
            "read",
            "internal_write",
            "external_idempotent",
            "external_non_idempotent",
            "irreversible",
        ] {
            for keyed in [true, false] {
                for five_xx in ["unknown", "retryable"] {
                    for exhausted in ["needs_attention", "failed_permanent"] {
                        if class == "external_non_idempotent" && (keyed || five_xx == "retryable") {
                            continue; // refused by the registry (item 6)
                        }
                        let header = if keyed {
                            "idempotency_header = \"Idempotency-Key\"\nprovider_retention = \"1h\"\n"
                        } else {
                            ""
                        };
                        toml.push_str(&format!(
                            "[[tools]]\nname = \"t{n}\"\nside_effect_class = \"{class}\"\n\
                             [tools.adapter]\nkind = \"http\"\nurl = \"http://x\"\ntimeout_ms = 1000\n\
                             five_xx = \"{five_xx}\"\n{header}[tools.retry]\nmax_attempts = 6\n\
                             base_ms = 100\nmax_ms = 1000\nmax_elapsed = \"10m\"\non_exhausted = \"{exhausted}\"\n"
                        ));
                        n += 1;
                    }
                }
            }
        }
        let registry = Registry::from_toml(&toml).expect("every generated tool is valid");
        registry.tools().cloned().collect()
    }

    fn outcomes() -> Vec<AdapterOutcome> {
        vec![
            AdapterOutcome::NotSent,
            AdapterOutcome::Throttled {
                retry_after: Some(Duration::from_secs(2)),
            },
            AdapterOutcome::Throttled { retry_after: None },
            AdapterOutcome::SentNoAnswer,
            AdapterOutcome::Rejected { status: Some(409) },
            AdapterOutcome::Rejected { status: Some(422) },
            AdapterOutcome::ServerError { status: 500 },
            AdapterOutcome::Committed {
                acknowledged: false,
            },
            AdapterOutcome::Committed { acknowledged: true },
            AdapterOutcome::Malformed,
            AdapterOutcome::Unsendable,
        ]
    }

    const T0: OffsetDateTime = datetime!(2026-01-01 0:00 UTC);

    /// Plays a sequence of attempt outcomes (with the gap before each) through the
    /// policy as the dispatcher would, until a non-retry event. Returns every decision.
    fn play(
        tool: &Tool,
        steps: &[(usize, u64)],
        seed: u64,
    ) -> Vec<(AdapterOutcome, AttemptDecision, Option<OffsetDateTime>)> {
        let all = outcomes();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ambiguous_since = None;
        let mut now = T0;
        let mut out = Vec::new();
        for (number, (pick, gap_s)) in steps.iter().enumerate() {
            let started_at = now;
            // The dispatcher re-checks before every resend.
            if may_send(tool, ambiguous_since, started_at, Duration::from_secs(60)).is_err() {
                break;
            }
            now += time::Duration::milliseconds(300);
            let outcome = all[pick % all.len()].clone();
            let d = after_attempt(
                tool,
                &Attempt {
                    outcome: &outcome,
                    number: number as u32 + 1,
                    started_at,
                    first_attempt_at: T0,
                    ambiguous_since,
                    now,
                },
                &mut rng,
            );
            let before = ambiguous_since;
            ambiguous_since = d.ambiguity.apply(ambiguous_since);
            out.push((outcome, d, before));
            if d.event != Event::ScheduleRetry {
                break;
            }
            now += time::Duration::seconds(*gap_s as i64);
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// Over generated attempt sequences for every kind of tool: an operation that had
        /// an ambiguous attempt never settles failed, and is only ever resent while the
        /// provider's key retention covers it; ambiguity is never forgotten by the
        /// dispatcher.
        #[test]
        fn ambiguity_is_never_forgotten(
            tool_pick in 0usize..64,
            steps in prop::collection::vec((0usize..64, prop_oneof![0u64..5, 3000u64..4000]), 1..10),
            seed in any::<u64>(),
        ) {
            let tools = tools();
            let tool = &tools[tool_pick % tools.len()];
            let played = play(tool, &steps, seed);
            let mut first_ambiguous: Option<OffsetDateTime> = None;
            for (outcome, d, before) in &played {
                // Monotonic: once set, kept; the first ambiguity counts.
                if let Some(b) = before {
                    prop_assert_eq!(d.ambiguity.apply(Some(*b)), Some(*b));
                }
                if first_ambiguous.is_some() || may_have_taken_effect(outcome, tool) {
                    first_ambiguous = first_ambiguous.or(Some(T0));
                    prop_assert!(
                        !matches!(d.event, Event::FailPermanently | Event::Escalate),
                        "{:?} after an ambiguous attempt on {}: {:?}", outcome, tool.name, d
                    );
                }
            }
            // A resend after an ambiguous attempt only inside the retention window.
            let mut ambiguous: Option<OffsetDateTime> = None;
            let mut t = T0;
            for (i, (_, d, before)) in played.iter().enumerate() {
                if i > 0
                    && let Some(since) = before.or(ambiguous) {
                        prop_assert!(resend_is_safe(tool, Some(since), t), "blind resend on {}", tool.name);
                    }
                ambiguous = d.ambiguity.apply(ambiguous);
                t += time::Duration::milliseconds(300) + time::Duration::seconds(steps[i].1 as i64);
            }
        }
    }

    fn tool(name: &str) -> Tool {
        tools().into_iter().find(|t| t.name == name).expect("tool")
    }

    /// Issue 9, item 3: attempt 1 times out after send, attempt 2 hears "idempotency
    /// key in use" (409) — the operation must not end failed while attempt 1 may land.
    #[test]
    fn a_4xx_after_a_timeout_is_not_a_failure() {
        let keyed_irreversible = tools()
            .into_iter()
            .find(|t| t.side_effect_class == SideEffectClass::Irreversible && honours_key(t))
            .expect("tool");
        let steps = [(3, 0), (4, 0)]; // SentNoAnswer, then Rejected 409
        let played = play(&keyed_irreversible, &steps, 1);
        assert_eq!(played.len(), 2);
        assert_eq!(
            played[0].1.event,
            Event::ScheduleRetry,
            "resend is safe: same key"
        );
        assert_eq!(played[1].1.event, Event::OutcomeUnknown);
        // Not sent, over and over, past the budget: still unknown, never failed.
        let steps = [(3, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0)];
        let played = play(&keyed_irreversible, &steps, 1);
        assert_eq!(
            played.last().map(|p| p.1.event),
            Some(Event::OutcomeUnknown)
        );
        let _ = tool;
    }

    /// Item 4: resend safety is decided when the resend is sent, from the first
    /// ambiguous attempt.
    #[test]
    fn a_resend_after_the_retention_window_is_held() {
        let keyed = tools()
            .into_iter()
            .find(|t| t.side_effect_class == SideEffectClass::Irreversible && honours_key(t))
            .expect("tool");
        let since = T0;
        let lease = Duration::from_secs(60);
        assert_eq!(
            may_send(&keyed, Some(since), T0 + time::Duration::minutes(30), lease),
            Ok(())
        );
        assert_eq!(
            may_send(&keyed, Some(since), T0 + time::Duration::minutes(61), lease),
            Err(Hold::ResendNotSafe),
            "an outage longer than the retention makes a resend blind"
        );
        assert_eq!(
            may_send(&keyed, None, T0 + time::Duration::days(9), lease),
            Ok(())
        );
        // Item 5: less than one tool timeout of lease left.
        assert_eq!(
            may_send(&keyed, None, T0, Duration::from_millis(999)),
            Err(Hold::LeaseTooShort)
        );
    }

    /// A spent budget never turns into an endless dispatch/lookup loop: a miss that is
    /// proof of absence ends as the tool says; a miss inside the grace looks again.
    #[test]
    fn lookups_after_the_budget_end_the_loop() {
        let keyed = tools()
            .into_iter()
            .find(|t| {
                t.side_effect_class == SideEffectClass::Irreversible
                    && honours_key(t)
                    && t.retry.on_exhausted == crate::retry::OnExhausted::NeedsAttention
            })
            .expect("tool");
        let grace = keyed
            .adapter
            .as_ref()
            .map(|a| a.lookup_grace)
            .unwrap_or_default();
        let lookup = |attempts_made, waited| Lookup {
            seen: Seen::NotFound,
            acknowledged: false,
            waited,
            attempts_made,
            ambiguous_since: Some(T0),
            first_attempt_at: Some(T0),
            now: T0 + time::Duration::seconds(10),
        };
        let d = after_lookup(&keyed, &lookup(2, Duration::ZERO));
        assert_eq!((d.event, d.ambiguity), (Event::Redispatch, Ambiguity::Keep));
        let d = after_lookup(&keyed, &lookup(6, Duration::ZERO));
        assert_eq!(d.event, Event::StillUnknown, "inside the grace: look again");
        let d = after_lookup(&keyed, &lookup(6, grace));
        assert_eq!((d.event, d.ambiguity), (Event::Escalate, Ambiguity::Clear));
        let found = Lookup {
            seen: Seen::Found,
            ..lookup(6, grace)
        };
        assert_eq!(after_lookup(&keyed, &found).event, Event::Succeed);
    }

    #[test]
    fn cancel_and_reject_wait_for_a_lookup() {
        assert!(command_refusal(Event::Cancel, Some(T0)).is_some_and(|m| m.contains("cancelled")));
        assert!(command_refusal(Event::Reject, Some(T0)).is_some());
        assert_eq!(command_refusal(Event::Cancel, None), None);
        assert_eq!(
            command_refusal(Event::Resolve(crate::Resolution::Failed), Some(T0)),
            None
        );
    }
}
