//! One transition of one operation: planned in memory ([`plan_change`]) and written
//! ([`change_one`]); [`change`] also settles the original of a compensation that ended.

use super::*;

/// What a transition writes beside the state.
pub(super) struct Change<'a> {
    pub(super) event: Event,
    pub(super) reason: &'a str,
    pub(super) attempt_id: Option<Uuid>,
    pub(super) actor: Option<&'a str>,
    pub(super) next_in: Option<Duration>,
    pub(super) detail: Option<serde_json::Value>,
    pub(super) ambiguity: Ambiguity,
}

/// Applies one transition to a locked operation and writes everything that goes with it.
/// When the operation is a compensation that just settled, the operation it undoes
/// leaves `compensating` in the same transaction: `compensated` if it succeeded, back to
/// `completed_success` (its effect still stands) if it did not.
pub(super) async fn change<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    c: Change<'_>,
    now: OffsetDateTime,
) -> Result<std::result::Result<(), Error>> {
    if let Err(e) = change_one(tx, op, c, now).await? {
        return Ok(Err(e));
    }
    let Some(original_id) = op.compensates else {
        return Ok(Ok(()));
    };
    if !op.status.is_terminal() {
        return Ok(Ok(()));
    }
    let Some(mut original) = tx.lock_operation(original_id).await? else {
        return Err(Error::Corrupt(format!(
            "operation {} compensates {original_id}, which is missing",
            op.operation_id
        )));
    };
    if original.status != Status::Compensating {
        return Ok(Ok(()));
    }
    let succeeded = matches!(op.status, Status::CompletedSuccess | Status::CompletedNoop);
    let (event, reason) = if succeeded {
        (Event::CompensationSucceeded, "compensation_succeeded")
    } else {
        (Event::CompensationFailed, "compensation_failed")
    };
    original.lease_epoch += 1;
    change_one(
        tx,
        &mut original,
        Change {
            event,
            reason,
            attempt_id: None,
            actor: None,
            next_in: None,
            detail: Some(json!({"compensation": op.operation_id, "status": op.status.as_str()})),
            ambiguity: Ambiguity::Keep,
        },
        now,
    )
    .await?
    .map_err(|e| Error::Corrupt(format!("settling the compensated operation: {e}")))?;
    Ok(Ok(()))
}

/// [`change`] without the compensation follow-up.
pub(super) async fn change_one<T: Tx>(
    tx: &mut T,
    op: &mut Operation,
    c: Change<'_>,
    now: OffsetDateTime,
) -> Result<std::result::Result<(), Error>> {
    let planned = match plan_change(op, c, now)? {
        Ok(planned) => planned,
        Err(e) => return Ok(Err(e)),
    };
    tx.insert_event(&planned.event).await?;
    tx.put_queue(op, planned.queue, planned.ready_at).await?;
    if let Some(row) = &planned.outbox {
        tx.insert_outbox(row).await?;
    }
    tx.update_operation(op).await?;
    Ok(Ok(()))
}

/// The writes a transition makes besides the operation row itself.
pub(super) struct Planned<'a> {
    pub(super) event: NewEvent<'a>,
    pub(super) queue: QueueState,
    pub(super) ready_at: OffsetDateTime,
    pub(super) outbox: Option<NewOutbox>,
}

/// Applies one transition to an operation in memory and says what to write: the history
/// event, the queue row, and a result row when the state changed.
pub(super) fn plan_change<'a>(
    op: &mut Operation,
    c: Change<'a>,
    now: OffsetDateTime,
) -> Result<std::result::Result<Planned<'a>, Error>> {
    let from = op.status;
    let to = match transition(from, c.event) {
        Ok(to) => to,
        Err(source) => {
            return Ok(Err(Error::IllegalTransition {
                operation_id: op.operation_id,
                source,
            }));
        }
    };
    let mut detail = c.detail;
    if from == Status::UnknownOutcome
        && to != Status::UnknownOutcome
        && let Some(since) = op.unknown_since.take()
    {
        let waited = (now - since).whole_milliseconds();
        let mut d = detail.unwrap_or_else(|| json!({}));
        d["unknown_for_ms"] = json!(waited);
        detail = Some(d);
    }
    if to == Status::UnknownOutcome && from != Status::UnknownOutcome {
        op.unknown_since = Some(now);
    }
    op.status = to;
    op.ambiguous_since = c.ambiguity.apply(op.ambiguous_since);
    op.lease_owner = None;
    op.lease_expires_at = None;
    op.next_attempt_at = c.next_in.map(|d| add(now, d));
    if matches!(to, Status::CompletedSuccess | Status::CompletedNoop) {
        op.error = None;
    }
    op.updated_at = now;
    let event = NewEvent {
        operation_id: op.operation_id,
        from: Some(from),
        to,
        reason: c.reason,
        attempt_id: c.attempt_id,
        epoch: op.lease_epoch,
        actor: c.actor,
        at: now,
        detail,
    };
    let outbox = if from != to {
        let event_id = op.event_id.clone();
        Some(result_row(op, &event_id, Dedupe::miss(), now)?)
    } else {
        None
    };
    Ok(Ok(Planned {
        event,
        queue: QueueState::of(to),
        ready_at: op.next_attempt_at.unwrap_or(now),
        outbox,
    }))
}
