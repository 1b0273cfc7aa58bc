//! The dispatcher's two transactions: claim (lease, attempt row, `dispatched`) and
//! record (the outcomes of calls), each writing every kind of row once per batch.

use super::*;

/// Claims work for a dispatcher (see [`crate::Ledger::claim`]): up to `request.limit`
/// claimable operations, of each tool at most its room: the operation, its attempt row,
/// the history event, the queue row and the `dispatched` result, each kind of row written
/// once for the batch.
pub(crate) async fn claim<T: Tx>(tx: &mut T, request: &ClaimRequest) -> Result<Vec<Claim>> {
    let now = tx.now().await?;
    let full: Vec<String> = request
        .tool_room
        .iter()
        .filter(|(_, free)| **free == 0)
        .map(|(tool, _)| tool.clone())
        .collect();
    let picked = tx.pick_claimable(now, request.limit, &full).await?;
    let chosen = fit_to_room(picked, &request.tool_room, request.limit);
    let mut locked = tx.try_lock_operations(&chosen).await?;
    let mut claims = Vec::with_capacity(chosen.len());
    let mut attempts = Vec::new();
    let mut events = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    for id in chosen {
        let Some(mut op) = locked.remove(&id) else {
            continue;
        };
        let Some((attempt, event)) = take_lease(&mut op, request, now) else {
            // The queue row disagrees with the operation (a bug or a manual edit): repair
            // the row from the operation and keep claiming the others.
            tracing::warn!(operation_id = %id, status = %op.status, "queue row out of step with its operation; repaired");
            tx.put_queue(&op, QueueState::of(op.status), now).await?;
            continue;
        };
        let event_id = op.event_id.clone();
        outbox.push(result_row(&mut op, &event_id, Dedupe::miss(), now)?);
        claims.push(Claim {
            first_attempt_at: op.first_attempt_at,
            operation: op.clone(),
            attempt_id: Some(attempt.attempt_id),
            claimed_at: now,
        });
        attempts.push(attempt);
        events.push(event);
        queue.push(op);
    }
    let queue_rows: Vec<(&Operation, QueueState, OffsetDateTime)> = queue
        .iter()
        .map(|op| (op, QueueState::Inflight, now))
        .collect();
    tx.write_rows(
        &Rows {
            attempts: &attempts,
            events: &events,
            queue: &queue_rows,
            outbox: &outbox,
            operations: &queue,
            finished: &[],
        },
        now,
    )
    .await?;
    Ok(claims)
}

/// Which of the `picked` operations (id and tool, in claim order) a claim takes: at most
/// `limit`, and of each tool listed in `room` at most its free permits (a tool not listed
/// is bounded by `limit` alone). The rest stay queued for the next claim.
pub(super) fn fit_to_room<Id>(
    picked: impl IntoIterator<Item = (Id, String)>,
    room: &std::collections::BTreeMap<String, usize>,
    limit: usize,
) -> Vec<Id> {
    let mut room = room.clone();
    let mut chosen = Vec::new();
    for (id, tool) in picked {
        if chosen.len() == limit {
            break;
        }
        if let Some(free) = room.get_mut(&tool) {
            if *free == 0 {
                continue;
            }
            *free -= 1;
        }
        chosen.push(id);
    }
    chosen
}

/// The claim's transition on `op` (ready -> dispatched under a new lease for
/// `request.owner`, from `now`), with the attempt row written before the tool is called
/// and the history entry; `None` when `op` is not in a claimable state.
pub(super) fn take_lease<'r>(
    op: &mut Operation,
    request: &'r ClaimRequest,
    now: OffsetDateTime,
) -> Option<(NewAttempt<'r>, NewEvent<'r>)> {
    let from = op.status;
    let to = transition(from, Event::Claim).ok()?;
    op.status = to;
    op.attempt_count += 1;
    op.lease_epoch += 1;
    op.lease_owner = Some(request.owner.clone());
    op.lease_expires_at = Some(add(now, request.lease));
    op.first_attempt_at.get_or_insert(now);
    op.next_attempt_at = None;
    op.updated_at = now;
    let attempt_id = Uuid::now_v7();
    let attempt = NewAttempt {
        attempt_id,
        operation_id: op.operation_id,
        number: op.attempt_count,
        epoch: op.lease_epoch,
        worker: &request.owner,
        started_at: now,
    };
    let event = NewEvent {
        operation_id: op.operation_id,
        from: Some(from),
        to,
        reason: "claimed",
        attempt_id: Some(attempt_id),
        epoch: op.lease_epoch,
        actor: Some(&request.owner),
        at: now,
        detail: None,
    };
    Some((attempt, event))
}

/// Records outcomes (see [`crate::Ledger::record`]) with a fixed number of statements
/// per batch: the operations are locked in one statement, each transition is planned in
/// memory, and events, queue rows, result rows, operations and attempts are written by
/// [`Tx::write_rows`]. A compensation
/// settles its original in the same transaction, so a batch holding one takes the
/// one-by-one path.
pub(crate) async fn record<T: Tx>(
    tx: &mut T,
    recordings: &[Recording],
) -> Result<Vec<Result<Operation>>> {
    let now = tx.now().await?;
    let ids: Vec<Uuid> = recordings.iter().map(|r| r.operation_id).collect();
    let distinct: std::collections::HashSet<&Uuid> = ids.iter().collect();
    let mut locked = tx.lock_operations(&ids).await?;
    if distinct.len() != ids.len() || locked.values().any(|op| op.compensates.is_some()) {
        return record_one_by_one(tx, recordings, locked, now).await;
    }
    let mut results = Vec::with_capacity(recordings.len());
    let mut events = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    let mut finished = Vec::new();
    let mut changed = Vec::new();
    for rec in recordings {
        let Some(mut op) = locked.remove(&rec.operation_id) else {
            results.push(Err(Error::NotFound(rec.operation_id)));
            continue;
        };
        if let Err(e) = fence_and_fill(&mut op, rec) {
            results.push(Err(e));
            continue;
        }
        match plan_change(&mut op, recording_change(rec), now)? {
            Err(e) => results.push(Err(e)),
            Ok(planned) => {
                events.push(planned.event);
                queue.push((op.clone(), planned.queue, planned.ready_at));
                outbox.extend(planned.outbox);
                if let Some((attempt_id, report)) = &rec.attempt {
                    finished.push((op.operation_id, *attempt_id, report));
                }
                changed.push(op.clone());
                results.push(Ok(op));
            }
        }
    }
    let queue_rows: Vec<(&Operation, QueueState, OffsetDateTime)> =
        queue.iter().map(|(op, q, r)| (op, *q, *r)).collect();
    tx.write_rows(
        &Rows {
            attempts: &[],
            events: &events,
            queue: &queue_rows,
            outbox: &outbox,
            operations: &changed,
            finished: &finished,
        },
        now,
    )
    .await?;
    if !leaves_claimable(tx, &queue_rows, now).await? {
        tx.leaves_nothing_claimable();
    }
    Ok(results)
}

/// Whether these queue rows, just written, may have left an operation claimable now: one
/// of them is ready now, or one left its entity (finished) while another write of that
/// entity waits behind it. A retry due later is found by the dispatcher's poll.
async fn leaves_claimable<T: Tx>(
    tx: &mut T,
    rows: &[(&Operation, QueueState, OffsetDateTime)],
    now: OffsetDateTime,
) -> Result<bool> {
    if rows
        .iter()
        .any(|(_, state, ready_at)| *state == QueueState::Waiting && *ready_at <= now)
    {
        return Ok(true);
    }
    let freed: Vec<&str> = rows
        .iter()
        .filter(|(op, state, _)| *state == QueueState::Done && op.side_effect_class.is_write())
        .map(|(op, ..)| op.entity_key.as_str())
        .collect();
    Ok(!freed.is_empty() && tx.waiting_on_entities(&freed).await?)
}

/// The epoch check and the fields a recording carries besides the transition.
pub(super) fn fence_and_fill(op: &mut Operation, rec: &Recording) -> Result<()> {
    if op.lease_epoch != rec.epoch {
        return Err(Error::StaleEpoch {
            operation_id: rec.operation_id,
            presented: rec.epoch,
            current: op.lease_epoch,
        });
    }
    if let Some(result) = &rec.result {
        op.result = Some(result.clone());
    }
    if rec.external_object_id.is_some() {
        op.external_object_id.clone_from(&rec.external_object_id);
    }
    if rec.external_request_id.is_some() {
        op.external_request_id.clone_from(&rec.external_request_id);
    }
    if rec.error.is_some() {
        op.error.clone_from(&rec.error);
    }
    Ok(())
}

pub(super) fn recording_change(rec: &Recording) -> Change<'_> {
    Change {
        event: rec.event,
        reason: &rec.reason,
        attempt_id: rec.attempt.as_ref().map(|(id, _)| *id),
        actor: None,
        next_in: rec.next_in,
        detail: None,
        ambiguity: rec.ambiguity,
    }
}

/// [`record`] one recording at a time (a compensation among them, or an operation
/// twice): each change goes through [`change`], which settles a compensation's original.
pub(super) async fn record_one_by_one<T: Tx>(
    tx: &mut T,
    recordings: &[Recording],
    mut locked: HashMap<Uuid, Operation>,
    now: OffsetDateTime,
) -> Result<Vec<Result<Operation>>> {
    let mut results = Vec::with_capacity(recordings.len());
    for rec in recordings {
        // An operation recorded twice in one batch: its second recording sees the first.
        let op = match locked.remove(&rec.operation_id) {
            Some(op) => Some(op),
            None => tx.read_operation(rec.operation_id).await?,
        };
        let Some(mut op) = op else {
            results.push(Err(Error::NotFound(rec.operation_id)));
            continue;
        };
        if let Err(e) = fence_and_fill(&mut op, rec) {
            results.push(Err(e));
            continue;
        }
        if let Err(e) = change(tx, &mut op, recording_change(rec), now).await? {
            results.push(Err(e));
            continue;
        }
        if let Some((attempt_id, report)) = &rec.attempt {
            tx.finish_attempt(op.operation_id, *attempt_id, report, now)
                .await?;
        }
        results.push(Ok(op));
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::fit_to_room;

    #[test]
    fn a_claim_takes_each_tool_up_to_its_room_and_all_up_to_the_limit() {
        let picked = || {
            [
                (1, "pay"),
                (2, "ticket"),
                (3, "pay"),
                (4, "lookup"),
                (5, "pay"),
                (6, "lookup"),
            ]
            .map(|(id, tool)| (id, tool.to_owned()))
        };
        let room = BTreeMap::from([("pay".to_owned(), 2), ("ticket".to_owned(), 0)]);
        // pay's third waits for room, a ticket has none; lookup is not listed: only the
        // limit bounds it.
        assert_eq!(fit_to_room(picked(), &room, 10), [1, 3, 4, 6]);
        assert_eq!(fit_to_room(picked(), &room, 3), [1, 3, 4]);
        assert_eq!(fit_to_room(picked(), &room, 0), Vec::<i32>::new());
        assert_eq!(
            fit_to_room(picked(), &BTreeMap::new(), 10),
            [1, 2, 3, 4, 5, 6]
        );
    }
}
