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
//! `opgate::attempt` target.

mod adapters;
mod claim_loop;
mod dispatcher;
mod reconciler;

use std::time::Duration;

pub use adapters::Adapters;
pub use dispatcher::{Dispatcher, DispatcherConfig};
pub use reconciler::{Reconciler, ReconcilerConfig};

use opgate_core::registry::Tool;
use opgate_core::{Operation, SideEffectClass};
use time::OffsetDateTime;

/// Whether a resend with the same key cannot duplicate the effect: the provider honours
/// the key (an idempotency header or body field is configured) and the key is still
/// inside the provider's retention window, counted from the first attempt, with a margin
/// of one request timeout.
pub fn resend_is_safe(tool: &Tool, op: &Operation, now: OffsetDateTime) -> bool {
    let Some(adapter) = &tool.adapter else {
        return false;
    };
    let honours_key = adapter.config.idempotency_header.is_some()
        || (adapter.config.key_body_field.is_some()
            && tool.side_effect_class != SideEffectClass::ExternalNonIdempotent);
    let (Some(retention), Some(first)) = (adapter.provider_retention, op.first_attempt_at) else {
        return false;
    };
    let age = Duration::try_from(now - first).unwrap_or(Duration::MAX);
    honours_key && age.saturating_add(adapter.timeout) < retention
}

/// Elapsed time between two database-clock instants (zero if negative).
pub(crate) fn between(from: OffsetDateTime, to: OffsetDateTime) -> Duration {
    Duration::try_from(to - from).unwrap_or(Duration::ZERO)
}
