//! The ledger's algorithms, written once over [`Tx`], a per-backend set of statements.
//!
//! Each function runs inside one transaction the backend opened; the backend commits
//! it and retries the whole function on a transient conflict. Every state change goes
//! through [`opgate_core::transition`], appends a history event, moves the queue row and
//! writes a result-outbox row, in that one transaction.
//!
//! One file per use case: [`tx`] (the statements and rows), [`ingest`] (with [`guards`]
//! for the policies beside the key), [`dispatch`] (claim and record), [`reconcile`],
//! [`admin`] (a person's commands and compensations), and [`change`] (one transition,
//! planned in memory and written) which they share; this file holds the result-row
//! helpers.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use opgate_core::envelope::Envelope;
use opgate_core::policy::{self, Ambiguity};
use opgate_core::registry::KeyStrategy;
use opgate_core::{
    Dedupe, Delivery, ErrorInfo, Event, IngestItem, Operation, RejectedProposal, Rejection,
    ResultMessage, Status, transition,
};
use serde_json::json;
use time::OffsetDateTime;
use uuid::Uuid;

use crate::types::{
    AttemptReport, Claim, ClaimRequest, Command, CompensationRequest, IngestDecision,
    IngestOutcome, QueueState, Recording,
};
use crate::{Error, Result};

mod admin;
mod change;
mod dispatch;
mod guards;
mod ingest;
mod reconcile;
mod tx;

pub(crate) use admin::{apply, compensate};
use change::*;
pub(crate) use dispatch::{claim, record};
use dispatch::{fit_to_room, take_lease};
use guards::*;
pub(crate) use guards::{GUARD_IGNORES, GuardProbe};
pub(crate) use ingest::{ingest, ingest_and_claim};
pub(crate) use reconcile::claim_reconcile;
pub(crate) use tx::{
    InboxRow, NewAttempt, NewEvent, NewInbox, NewOutbox, Rows, Tx, write_rows_in_turn,
};

pub(super) fn add(at: OffsetDateTime, d: Duration) -> OffsetDateTime {
    at + time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

/// The result row for an operation's current state, bumping its sequence number.
pub(super) fn result_row(
    op: &mut Operation,
    event_id: &str,
    dedupe: Dedupe,
    at: OffsetDateTime,
) -> Result<NewOutbox> {
    op.result_seq += 1;
    let message = ResultMessage::for_operation(op, event_id, dedupe, op.result_seq, at);
    Ok(NewOutbox {
        operation_id: Some(op.operation_id),
        seq: op.result_seq,
        status: message.status.clone(),
        kafka_key: format!("{}:{}", op.entity.kind, op.entity.id),
        payload: serde_json::to_string(&message).map_err(|e| Error::Corrupt(e.to_string()))?,
        traceparent: message.traceparent,
        at,
    })
}

/// The result row for a refused proposal.
pub(super) fn rejection_row(rejected: &RejectedProposal, at: OffsetDateTime) -> Result<NewOutbox> {
    let message = ResultMessage::for_rejection(rejected, at);
    Ok(NewOutbox {
        operation_id: None,
        seq: 0,
        status: message.status.clone(),
        kafka_key: rejected.kafka_key(),
        payload: serde_json::to_string(&message).map_err(|e| Error::Corrupt(e.to_string()))?,
        traceparent: message.traceparent,
        at,
    })
}

/// Appends a result-outbox row for the operation's current state (bumping its sequence
/// number); the relay publishes it later.
pub(super) async fn append_result<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    event_id: &str,
    dedupe: Dedupe,
    at: OffsetDateTime,
) -> Result<()> {
    let row = result_row(op, event_id, dedupe, at)?;
    tx.insert_outbox(&row).await
}

pub(super) fn new_operation(env: &Envelope, at: OffsetDateTime) -> Operation {
    Operation::from_envelope(env, Uuid::now_v7(), at)
}
