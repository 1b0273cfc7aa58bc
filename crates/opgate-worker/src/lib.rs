//! The dispatcher and the reconciler.
//!
//! - [`Dispatcher`]: claims ready operations from the ledger in batches (head of line per
//!   entity, lease, fencing epoch; `dispatched` and the attempt row are persisted by the
//!   claim, before any call), calls the tool through its adapter with the idempotency key,
//!   classifies the outcome with the core ([`opgate_core::outcome`]), and records the
//!   next state — a durable retry with full jitter, `unknown_outcome`, a final state.
//! - [`Reconciler`]: takes `unknown_outcome` and `acknowledged` operations (and
//!   `dispatched` ones whose lease expired, i.e. a crashed dispatcher), looks the key up at
//!   the provider, and records completed, a safe re-dispatch, or `needs_attention`.
//!
//! Both log one structured line per operation attempt (DESIGN.md section 7) under the
//! `opgate::attempt` target, and make each provider call and lookup an OpenTelemetry
//! span in the operation's trace ([`trace`]).
#![forbid(unsafe_code)]

mod adapters;
mod claim_loop;
mod dispatcher;
mod reconciler;
mod recorder;
pub mod trace;

use std::time::Duration;

pub use adapters::Adapters;
pub use dispatcher::{Dispatcher, DispatcherConfig, Leased, claim_ahead, waves_in_lease};
pub use reconciler::{Reconciler, ReconcilerConfig};

use time::OffsetDateTime;

/// Elapsed time between two database-clock instants (zero if negative).
pub(crate) fn between(from: OffsetDateTime, to: OffsetDateTime) -> Duration {
    Duration::try_from(to - from).unwrap_or(Duration::ZERO)
}
