//! A person's commands: approve, reject, cancel, resolve, and starting a compensation.

use super::*;

/// Applies a command (see [`crate::Ledger::apply`]).
pub(crate) async fn apply<T: Tx>(tx: &mut T, command: &Command) -> Result<Operation> {
    let now = tx.now().await?;
    let mut op = tx
        .lock_operation(command.operation_id)
        .await?
        .ok_or(Error::NotFound(command.operation_id))?;
    if let Some(message) = policy::command_refusal(command.event, op.ambiguous_since) {
        return Err(Error::Conflict(message));
    }
    // Fence whoever holds a lease: their late recording must not overwrite a person.
    op.lease_epoch += 1;
    if let Some(result) = &command.result {
        op.result = Some(result.clone());
    }
    change(
        tx,
        &mut op,
        Change {
            event: command.event,
            reason: &command.reason,
            attempt_id: None,
            actor: Some(&command.actor),
            next_in: None,
            detail: None,
            // A person's resolution settles the ambiguity (they checked the provider).
            ambiguity: match command.event {
                Event::Resolve(_) => Ambiguity::Clear,
                _ => Ambiguity::Keep,
            },
        },
        now,
    )
    .await??;
    Ok(op)
}

/// Starts a compensation (see [`crate::Ledger::compensate`]).
pub(crate) async fn compensate<T: Tx>(
    tx: &mut T,
    request: &CompensationRequest,
) -> Result<(Operation, Operation)> {
    let now = tx.now().await?;
    let mut original = tx
        .lock_operation(request.operation_id)
        .await?
        .ok_or(Error::NotFound(request.operation_id))?;
    // The compensation's key: the tool's own, or — when an earlier compensation of this
    // operation failed — the same with `:retry{n}`, a new identity for a deliberate new
    // attempt (the failed one stays in the ledger as it ended).
    let mut envelope = request.envelope.clone();
    let base = envelope.key.key.clone();
    for attempt in 1.. {
        let Some(existing) = tx
            .lock_operation_by_key(&envelope.key.namespace, &envelope.key.key)
            .await?
        else {
            break;
        };
        let ours = existing.compensates == Some(original.operation_id);
        let failed = matches!(
            existing.status,
            Status::FailedPermanent | Status::Cancelled | Status::Rejected
        );
        if ours && !failed {
            // Asked again while (or after) the compensation runs: the same compensation.
            return Ok((original, existing));
        }
        if !ours || attempt >= 100 {
            return Err(Error::Conflict(format!(
                "the compensation's key `{}` already names operation {} ({}); resolve it by hand",
                envelope.key.key,
                existing.operation_id,
                existing.status.as_str()
            )));
        }
        envelope.key.key = format!("{base}:retry{}", attempt + 1);
        if let Some(components) = envelope.key.components.as_object_mut() {
            components.insert("compensation_attempt".into(), json!(attempt + 1));
        }
    }
    let key = &envelope.key;
    original.lease_epoch += 1;
    change(
        tx,
        &mut original,
        Change {
            event: Event::StartCompensation,
            reason: &request.reason,
            attempt_id: None,
            actor: Some(&request.actor),
            next_in: None,
            detail: None,
            ambiguity: Ambiguity::Keep,
        },
        now,
    )
    .await??;
    let mut compensation = new_operation(&envelope, now);
    compensation.compensates = Some(original.operation_id);
    compensation.result_seq = 1;
    let created = tx
        .insert_operations_batch(std::slice::from_ref(&compensation))
        .await?;
    if created.first() != Some(&true) {
        return Err(Error::Conflict(format!(
            "the compensation's key `{}` was taken concurrently",
            key.key
        )));
    }
    tx.insert_event(&NewEvent {
        operation_id: compensation.operation_id,
        from: None,
        to: compensation.status,
        reason: "compensation",
        attempt_id: None,
        epoch: 0,
        actor: Some(&request.actor),
        at: now,
        detail: Some(json!({"compensates": original.operation_id})),
    })
    .await?;
    tx.put_queue(&compensation, QueueState::of(compensation.status), now)
        .await?;
    compensation.result_seq = 0;
    let event_id = compensation.event_id.clone();
    append_result(tx, &mut compensation, &event_id, Dedupe::miss(), now).await?;
    tx.update_operation(&compensation).await?;
    Ok((original, compensation))
}
