//! A scripted, in-process provider: a [`ToolAdapter`] whose every call follows a script
//! (what happens at the provider, what the caller hears, how long it takes) and which
//! counts the effects per key, so a test can prove "at most one effect" exactly.
//!
//! A call's step has two independent halves, as in production: whether the provider
//! *applied* the effect (a provider that honours keys applies a key once), and what the
//! caller *heard* (a timeout after commit is `applied: true` with `SentNoAnswer`). A step
//! may also *hang*: the caller never hears anything, as when its process dies after the
//! provider answered. Steps come from a queue ([`ScriptedProvider::script`]) or from a
//! schedule, a function of (key, n-th call with that key) — deterministic whatever the
//! interleaving of concurrent callers. Lookups see applied effects, optionally only a
//! while after they were applied (an eventually consistent provider). A provider that
//! honours keys may remember them only for a retention, as real ones do.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    /// The caller never hears back (its process died mid-call).
    pub hang: bool,
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
            hang: false,
        }
    }
}

/// Calls in flight per entity, shared by the providers of several tools, and how often
/// two calls on one entity overlapped.
#[derive(Default)]
pub struct Entities {
    state: Mutex<(HashMap<String, u32>, u64)>,
}

impl Entities {
    fn enter(&self, entity: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let n = s.0.entry(entity.to_owned()).or_default();
        *n += 1;
        if *n > 1 {
            s.1 += 1;
        }
    }

    fn leave(&self, entity: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = s.0.get_mut(entity) {
            *n = n.saturating_sub(1);
        }
    }

    /// Times a call started while another call on its entity was in flight.
    pub fn overlaps(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

type Schedule = Box<dyn Fn(&str, u32) -> Step + Send + Sync>;
type Lag = Box<dyn Fn(&str) -> Duration + Send + Sync>;

#[derive(Default)]
struct State {
    script: VecDeque<Step>,
    /// Applied effects per provider key (beyond the first: duplicates).
    effects: HashMap<String, u32>,
    /// Calls per key so far.
    calls_per_key: HashMap<String, u32>,
    /// When each key's effect was first and last applied.
    applied: HashMap<String, (Instant, Instant)>,
    calls: u64,
    /// Calls in progress now, and the most at once.
    in_flight: u64,
    max_in_flight: u64,
}

/// The scripted provider.
pub struct ScriptedProvider {
    honours_key: bool,
    retention: Option<Duration>,
    schedule: Option<Schedule>,
    lookup_lag: Option<Lag>,
    entities: Arc<Entities>,
    state: Mutex<State>,
    /// Set once hung calls may return (the test is over).
    released: tokio::sync::watch::Sender<bool>,
}

impl ScriptedProvider {
    /// A provider; `honours_key`: a second call with a key it has applied is not applied
    /// again (it answers as if it were).
    pub fn new(honours_key: bool) -> Self {
        Self {
            honours_key,
            retention: None,
            schedule: None,
            lookup_lag: None,
            entities: Arc::default(),
            state: Mutex::new(State::default()),
            released: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Lets every hung call return (its outcome is then refused as stale, or recorded:
    /// call this only after the test's checks), so the tasks end and release the ledger.
    pub fn release_hung_calls(&self) {
        self.released.send_replace(true);
    }

    /// Steps from a schedule of (provider key, call number with that key from 1) once the
    /// queued script is used up.
    pub fn with_schedule(
        mut self,
        schedule: impl Fn(&str, u32) -> Step + Send + Sync + 'static,
    ) -> Self {
        self.schedule = Some(Box::new(schedule));
        self
    }

    /// Lookups of a key miss its applied effect for this long after it was applied.
    pub fn with_lookup_lag(
        mut self,
        lag: impl Fn(&str) -> Duration + Send + Sync + 'static,
    ) -> Self {
        self.lookup_lag = Some(Box::new(lag));
        self
    }

    /// A key is honoured only this long after its last application; later, a call with
    /// it is a new effect.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Tracks calls in flight per entity together with other providers.
    pub fn with_entities(mut self, entities: Arc<Entities>) -> Self {
        self.entities = entities;
        self
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends steps to the script; calls past the script follow the schedule, or succeed.
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

    /// The most calls that were in progress at once.
    pub fn max_in_flight(&self) -> u64 {
        self.state().max_in_flight
    }

    /// Times two calls on one entity overlapped (on the shared tracker).
    pub fn overlaps(&self) -> u64 {
        self.entities.overlaps()
    }
}

#[async_trait::async_trait]
impl ToolAdapter for ScriptedProvider {
    async fn dispatch(&self, request: &DispatchRequest<'_>) -> CallReport {
        let entity = request.operation.entity_key.clone();
        let key = request.provider_key.to_owned();
        let step = {
            let mut s = self.state();
            s.calls += 1;
            s.in_flight += 1;
            s.max_in_flight = s.max_in_flight.max(s.in_flight);
            let n = {
                let n = s.calls_per_key.entry(key.clone()).or_default();
                *n += 1;
                *n
            };
            match s.script.pop_front() {
                Some(step) => step,
                None => self
                    .schedule
                    .as_ref()
                    .map_or_else(Step::ok, |schedule| schedule(&key, n)),
            }
        };
        self.entities.enter(&entity);
        if !step.delay.is_zero() {
            tokio::time::sleep(step.delay).await;
        }
        {
            let mut s = self.state();
            let now = Instant::now();
            let remembered = s.applied.get(&key).is_some_and(|(_, last)| {
                self.retention
                    .is_none_or(|retention| now.duration_since(*last) < retention)
            });
            if step.applied && !(self.honours_key && remembered) {
                *s.effects.entry(key.clone()).or_default() += 1;
                let first = s.applied.get(&key).map_or(now, |(first, _)| *first);
                s.applied.insert(key.clone(), (first, now));
            }
        }
        self.entities.leave(&entity);
        if step.hang {
            // The provider is done; the caller's process is gone (until the test ends).
            let mut released = self.released.subscribe();
            let _ = released.wait_for(|done| *done).await;
        }
        self.state().in_flight -= 1;
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
        let lag = self
            .lookup_lag
            .as_ref()
            .map_or(Duration::ZERO, |lag| lag(provider_key));
        let s = self.state();
        let visible = s
            .applied
            .get(provider_key)
            .is_some_and(|(first, _)| first.elapsed() >= lag);
        Some(if visible {
            Lookup::Found {
                result: Some(json!({"key": provider_key})),
                external_id: Some(format!("obj-{provider_key}")),
            }
        } else {
            Lookup::NotFound
        })
    }
}
