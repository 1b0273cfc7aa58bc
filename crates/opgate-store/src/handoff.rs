//! Claim at ingest: when a dispatcher runs in the same process as the ingest worker, the
//! ingest transaction that creates a ready operation also claims it for that dispatcher
//! ([`crate::Ledger::ingest_and_claim`]), and the dispatcher sends it as soon as the
//! transaction committed. A proposal then reaches its call without a second transaction,
//! without waiting for the dispatcher to be woken, and without a claim of its own.
//!
//! Before each ingest transaction the ingest asks the dispatcher ([`Handoff::offer`]) how
//! many operations of each tool it can send at once. The dispatcher holds that room for
//! the offer (its own claims do not promise it twice) until the ingest hands back what it
//! claimed ([`Offer::take`]) or drops the offer (a failed transaction): the room held and
//! not used is given back then. An operation the ingest could not claim (no room, or not
//! head of line on its entity) waits in the queue for a dispatcher's claim, as before.
//!
//! Nothing here weakens a lease: a claim made at ingest is the same claim, with its
//! attempt row, history event and `dispatched` result, committed before anything is sent.
//! Should the process die between the commit and the call, the lease expires and the
//! reconciler settles the operation, as after any claim.

use std::collections::BTreeMap;

use crate::{Claim, ClaimRequest};

/// A dispatcher that takes operations claimed by the ingest transaction that created
/// them.
pub trait Handoff: Send + Sync {
    /// The room to claim in the next ingest transaction, for a batch holding `wanted`
    /// proposals of each tool: `None` when there is none (or the dispatcher is stopping).
    fn offer(&self, wanted: &BTreeMap<String, usize>) -> Option<Offer>;
}

/// Room a dispatcher holds for one ingest transaction's claim.
pub struct Offer {
    /// What the ingest may claim: owner, lease, limit and each tool's room.
    pub request: ClaimRequest,
    take: Box<dyn FnOnce(Vec<Claim>) + Send>,
}

impl Offer {
    /// An offer of `request`'s room; `take` receives the claims once they are committed.
    /// Dropping the offer (and so `take`) untaken must give the room back.
    pub fn new(request: ClaimRequest, take: impl FnOnce(Vec<Claim>) + Send + 'static) -> Self {
        Self {
            request,
            take: Box::new(take),
        }
    }

    /// Hands the committed claims to the dispatcher, which sends them; the room they did
    /// not use is given back.
    pub fn take(self, claims: Vec<Claim>) {
        (self.take)(claims);
    }
}

impl std::fmt::Debug for Offer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offer")
            .field("request", &self.request)
            .finish_non_exhaustive()
    }
}
