//! A scripted, in-process provider: a [`ToolAdapter`] whose every call follows a script
//! (what happens at the provider, what the caller hears, how long it takes) and which
//! counts the effects per key, so a test can prove "at most one effect" exactly.
//!
//! A call's script step has two independent halves, as in production: whether the
//! provider *applied* the effect (a provider that honours keys applies a key once), and
//! what the caller *heard* (a timeout after commit is `applied: true` with
//! `SentNoAnswer`). Lookups see applied effects, optionally only after a lag.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use opgate_core::Operation;
use opgate_core::outcome::AdapterOutcome;
use opgate_tools::{CallReport, DispatchRequest, Lookup, ToolAdapter};
use serde_json::json;

/// One call's script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Whether the provider applies the effect (`false`: it never saw or refused it).
    pub applied: bool,
    /// What the caller hears.
    pub heard: AdapterOutcome,
    /// How long the call takes.
    pub delay: Duration,
}

impl Step {
    /// The effect happened and the caller heard so.
    pub fn ok() -> Self {
        Self::new(
            true,
            AdapterOutcome::Committed {
                acknowledged: false,
            },
        )
    }

    /// A step.
    pub fn new(applied: bool, heard: AdapterOutcome) -> Self {
        Self {
            applied,
            heard,
            delay: Duration::ZERO,
        }
    }
}

#[derive(Default)]
struct State {
    script: VecDeque<Step>,
    /// Applied effects per provider key (beyond the first: duplicates).
    effects: HashMap<String, u32>,
    /// When each key's first effect was applied (call number), for lookup lag.
    applied_at_call: HashMap<String, u64>,
    calls: u64,
    lookups: u64,
    /// Calls in flight per entity, and the most ever seen at once.
    in_flight: HashMap<String, u32>,
    overlaps: u64,
}

/// The scripted provider.
pub struct ScriptedProvider {
    honours_key: bool,
    /// Lookups miss an effect until this many further calls or lookups happened.
    lookup_lag: u64,
    state: Mutex<State>,
}

impl ScriptedProvider {
    /// A provider; `honours_key`: a second call with a key it has applied is not applied
    /// again (it answers as if it were).
    pub fn new(honours_key: bool) -> Self {
        Self {
            honours_key,
            lookup_lag: 0,
            state: Mutex::new(State::default()),
        }
    }

    /// Lookups miss a fresh effect for this many later calls or lookups (an eventually
    /// consistent provider).
    pub fn with_lookup_lag(mut self, lag: u64) -> Self {
        self.lookup_lag = lag;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends steps to the script; calls past the script succeed.
    pub fn script(&self, steps: impl IntoIterator<Item = Step>) {
        self.state().script.extend(steps);
    }

    /// Effects applied for a provider key.
    pub fn effects(&self, key: &str) -> u32 {
        self.state().effects.get(key).copied().unwrap_or(0)
    }

    /// Every key's effect count.
    pub fn all_effects(&self) -> HashMap<String, u32> {
        self.state().effects.clone()
    }

    /// Calls received.
    pub fn calls(&self) -> u64 {
        self.state().calls
    }

    /// Times two calls on one entity overlapped.
    pub fn overlaps(&self) -> u64 {
        self.state().overlaps
    }
}

#[async_trait::async_trait]
impl ToolAdapter for ScriptedProvider {
    async fn dispatch(&self, request: &DispatchRequest<'_>) -> CallReport {
        let entity = request.operation.entity_key.clone();
        let step = {
            let mut s = self.state();
            s.calls += 1;
            let n = s.in_flight.entry(entity.clone()).or_default();
            *n += 1;
            if *n > 1 {
                s.overlaps += 1;
            }
            s.script.pop_front().unwrap_or_else(Step::ok)
        };
        if !step.delay.is_zero() {
            tokio::time::sleep(step.delay).await;
        }
        let key = request.provider_key.to_owned();
        {
            let mut s = self.state();
            if let Some(n) = s.in_flight.get_mut(&entity) {
                *n = n.saturating_sub(1);
            }
            let known = s.effects.get(&key).copied().unwrap_or(0) > 0;
            if step.applied && !(self.honours_key && known) {
                let calls = s.calls;
                *s.effects.entry(key.clone()).or_default() += 1;
                s.applied_at_call.entry(key.clone()).or_insert(calls);
            }
        }
        let committed = matches!(step.heard, AdapterOutcome::Committed { .. });
        CallReport {
            outcome: step.heard,
            http_status: None,
            result: committed.then(|| json!({"key": key})),
            external_id: committed.then(|| format!("obj-{key}")),
            provider_request_id: None,
            latency: step.delay,
            detail: None,
        }
    }

    async fn lookup(&self, _operation: &Operation, provider_key: &str) -> Option<Lookup> {
        let mut s = self.state();
        s.lookups += 1;
        let seen_after = s
            .applied_at_call
            .get(provider_key)
            .map(|at| at + self.lookup_lag);
        let clock = s.calls + s.lookups;
        Some(match seen_after {
            Some(after) if clock > after => Lookup::Found {
                result: Some(json!({"key": provider_key})),
                external_id: Some(format!("obj-{provider_key}")),
            },
            _ => Lookup::NotFound,
        })
    }
}
