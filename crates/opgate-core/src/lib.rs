//! opgate's domain, without I/O.
//!
//! A proposal travels through this crate in one pass:
//! [`proposal::Proposal::decode`] (strict shape) -> [`envelope::prepare`] (registry checks,
//! [`canonical::canonicalize_args`], [`key::derive_key`]) -> an [`envelope::Envelope`] the
//! ledger ingests. Dispatch outcomes come back through [`outcome::classify`] and
//! [`outcome::decide`] (which uses [`retry::next_retry`]) as a [`state::Event`], and
//! [`state::transition`] is the only place that says which state follows.
//!
//! Nothing here reads a clock, a random source or the network: callers pass them in.
#![forbid(unsafe_code)]

pub mod canonical;
pub mod compensation;
pub mod decimal;
pub mod envelope;
pub mod envsubst;
pub mod input;
pub mod key;
pub mod operation;
pub mod outcome;
pub mod policy;
pub mod proposal;
pub mod registry;
pub mod retry;
pub mod schema;
pub mod state;
pub mod template;

pub use envelope::{Delivery, Envelope, Guard, IngestItem, RejectedProposal, Rejection, Source};
pub use operation::{Dedupe, ErrorInfo, Operation, ResultMessage};
pub use proposal::{Entity, Limits, Proposal, ProposalError};
pub use registry::{Registry, RegistryError, SideEffectClass, Tool};
pub use state::{Event, IllegalTransition, Resolution, Status, transition};
