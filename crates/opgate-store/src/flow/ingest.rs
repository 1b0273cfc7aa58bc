//! Ingest: a batch of proposals -> inbox, operations, history, queue and results, with a
//! fixed number of statements per batch on the hot path; and, for a dispatcher in the
//! same process, the claim of the ready operations it created, in the same transaction.

use super::*;

/// Ingests a batch (see [`crate::Ledger::ingest`]) with a fixed number of statements per
/// batch on the hot path: inbox rows, new operations, the planned rows ([`Tx::write_rows`]:
/// history, queue, results, operations hit by duplicates) and inbox decisions. Duplicates (a minority) are resolved row
/// by row against the operations they hit.
pub(crate) async fn ingest<T: Tx>(tx: &mut T, batch: &[IngestItem]) -> Result<Vec<IngestOutcome>> {
    let now = tx.now().await?;
    let (outcomes, _) = ingest_at(tx, batch, now, None).await?;
    Ok(outcomes)
}

/// [`ingest`], claiming for a dispatcher, in the same transaction, the operations the
/// batch creates that are ready and at the head of their entity's line, as far as the
/// request's room goes (see [`crate::Ledger::ingest_and_claim`]). A claimed operation is
/// written once, already claimed ([`plan_claims`]); its outcome reports it so.
pub(crate) async fn ingest_and_claim<T: Tx>(
    tx: &mut T,
    batch: &[IngestItem],
    request: &ClaimRequest,
) -> Result<(Vec<IngestOutcome>, Vec<Claim>)> {
    let now = tx.now().await?;
    // The entities the batch's writes are of, which may be busy already: read before
    // anything is written.
    let mut writes: Vec<&str> = batch
        .iter()
        .filter_map(|item| match item {
            IngestItem::Accepted(env) if env.side_effect_class.is_write() => {
                Some(env.entity_key.as_str())
            }
            _ => None,
        })
        .collect();
    writes.sort_unstable();
    writes.dedup();
    let busy = tx.busy_entities(&writes).await?;
    ingest_at(tx, batch, now, Some((request, busy))).await
}

/// The operations a batch created that wait in the queue for a claim (not those parked
/// for approval, nor those it claimed).
fn created_waiting(outcomes: &[IngestOutcome]) -> impl Iterator<Item = Uuid> + '_ {
    outcomes
        .iter()
        .filter(|o| !o.inbox_hit && o.decision == IngestDecision::Accepted)
        .filter_map(|o| o.operation.as_ref())
        .filter(|op| QueueState::of(op.status) == QueueState::Waiting)
        .map(|op| op.operation_id)
}

/// Which of an ingest's candidate operations it claims (indices into `candidates`, in
/// order): those that will wait in the queue once written and are at the head of their
/// entity's line — a read, or the first write of the batch on an entity not `busy` (a
/// write waits, is in flight or is held on it: [`Tx::busy_entities`]) — within the
/// request's limit and room ([`fit_to_room`]). The ledger is read before the operations
/// are written, so each is written once, as claimed; a write on the same entity that
/// another transaction commits meanwhile is held off by the one-write-in-flight index (one
/// in flight or held) or by [`overtakes_nothing`] (one waiting).
fn plan_claims(
    candidates: &[Operation],
    request: &ClaimRequest,
    mut busy: std::collections::HashSet<String>,
) -> Vec<usize> {
    let heads = candidates
        .iter()
        .enumerate()
        .filter(|(_, op)| QueueState::of(op.status) == QueueState::Waiting)
        // As the queue row's `is_read`: only writes wait their turn on an entity, and a
        // write makes its entity busy for the writes after it in the batch.
        .filter(|(_, op)| !op.side_effect_class.is_write() || busy.insert(op.entity_key.clone()))
        .map(|(c, op)| (c, op.tool.clone()));
    fit_to_room(heads, &request.tool_room, request.limit)
}

/// The check after an ingest's claimed writes are inserted: the busy entities were read
/// before this transaction waited on other transactions' rows and locks (an event id or a
/// key another transaction was writing, a guard's entity lock), and a write of a claimed
/// write's entity that one of them committed meanwhile, waiting, comes first: the claim
/// would overtake it (one in flight or held would have hit the one-write-in-flight index
/// instead). This batch's own queue rows are not written yet, so a waiting write found on
/// those entities is another's: [`Error::ClaimOvertakes`], and the transaction is retried.
async fn overtakes_nothing<T: Tx>(
    tx: &mut T,
    candidates: &[Operation],
    created: &[bool],
    leases: &[Option<(Operation, NewAttempt<'_>, NewEvent<'_>)>],
) -> Result<()> {
    let claimed_writes: Vec<&str> = candidates
        .iter()
        .zip(created.iter().zip(leases))
        .filter(|(op, (created, lease))| {
            **created && lease.is_some() && op.side_effect_class.is_write()
        })
        .map(|(op, _)| op.entity_key.as_str())
        .collect();
    if !claimed_writes.is_empty() && tx.waiting_on_entities(&claimed_writes).await? {
        // Named by count and the first: a batch may claim hundreds of entities.
        return Err(Error::ClaimOvertakes(format!(
            "{} of {} claimed",
            claimed_writes[0],
            claimed_writes.len()
        )));
    }
    Ok(())
}

/// Ingests `batch` at `now`; with a claim request (and the entities busy at `now`),
/// claims what [`plan_claims`] picks of what it creates. Returns each proposal's outcome and the claims.
async fn ingest_at<T: Tx>(
    tx: &mut T,
    batch: &[IngestItem],
    now: OffsetDateTime,
    claim: Option<(&ClaimRequest, std::collections::HashSet<String>)>,
) -> Result<(Vec<IngestOutcome>, Vec<Claim>)> {
    let keys: Vec<String> = batch.iter().map(IngestItem::inbox_key).collect();
    // What each proposal is expected to become, written into its inbox row: most are new
    // (accepted, naming the operation id drawn here) or refused already, and their inbox
    // row is then written once; the others are rewritten at the end.
    let op_ids: Vec<Option<Uuid>> = batch
        .iter()
        .map(|item| match item {
            IngestItem::Accepted(_) => Some(Uuid::now_v7()),
            IngestItem::Rejected(_) => None,
        })
        .collect();
    let expected: Vec<IngestDecision> = batch
        .iter()
        .map(|item| match item {
            IngestItem::Accepted(_) => IngestDecision::Accepted,
            IngestItem::Rejected(rej) => IngestDecision::Rejected {
                reason: rej.rejection.reason.to_owned(),
            },
        })
        .collect();
    let deliveries: Vec<NewInbox<'_>> = batch
        .iter()
        .enumerate()
        .map(|(i, item)| NewInbox {
            key: &keys[i],
            delivery: match item {
                IngestItem::Accepted(env) => &env.delivery,
                IngestItem::Rejected(rej) => &rej.delivery,
            },
            fingerprint: item.content_fingerprint(),
            decision: &expected[i],
            operation_id: op_ids[i],
        })
        .collect();
    // The inbox row is claimed first: a concurrent transaction ingesting the same event
    // waits here and then finds it, so an event is decided exactly once.
    let fresh = tx.insert_inbox_batch(&deliveries, now).await?;
    // Policies beside the key (dedupe window, exclusive group) decide before the key.
    let guarded = guard_hits(tx, batch, &fresh, now).await?;

    // Every other fresh, accepted proposal is a candidate operation; the unique key decides.
    let mut candidates = Vec::new();
    let mut candidate_of = vec![None; batch.len()];
    for (i, item) in batch.iter().enumerate() {
        if guarded[i].is_some() || !fresh[i] {
            continue;
        }
        if let (IngestItem::Accepted(env), Some(id)) = (item, op_ids[i]) {
            let mut op = Operation::from_envelope(env, id, now);
            op.result_seq = 1;
            candidate_of[i] = Some(candidates.len());
            candidates.push(op);
        }
    }
    // The candidates a claim takes are written claimed (with their `accepted` and
    // `dispatched` results); each keeps its state before the claim for the first.
    let mut leases: Vec<Option<(Operation, NewAttempt<'_>, NewEvent<'_>)>> =
        (0..candidates.len()).map(|_| None).collect();
    let claiming = claim.is_some();
    if let Some((request, busy)) = claim {
        for c in plan_claims(&candidates, request, busy) {
            let before = candidates[c].clone();
            if let Some((attempt, event)) = take_lease(&mut candidates[c], request, now) {
                candidates[c].result_seq = 2;
                leases[c] = Some((before, attempt, event));
            }
        }
    }
    let created = tx.insert_operations_batch(&candidates).await?;
    if claiming {
        overtakes_nothing(tx, &candidates, &created, &leases).await?;
    }

    let mut events = Vec::new();
    let mut attempts = Vec::new();
    let mut claims = Vec::new();
    let mut queue = Vec::new();
    let mut outbox = Vec::new();
    let mut decisions: Vec<(usize, IngestDecision, Option<Uuid>)> = Vec::new();
    // What the duplicates need, read in a few statements rather than one or two per row:
    // the inbox rows (and operations) of redelivered events, the operations named by
    // keys that already existed.
    let redelivered: Vec<&str> = (0..batch.len())
        .filter(|&i| !fresh[i])
        .map(|i| deliveries[i].key)
        .collect();
    let inbox_rows = tx.inbox_batch(&redelivered).await?;
    let prior_ids: Vec<Uuid> = inbox_rows.values().filter_map(|r| r.operation_id).collect();
    let prior = tx.read_operations(&prior_ids).await?;
    let mut dup_keys: Vec<(String, String)> = candidates
        .iter()
        .zip(&created)
        .filter(|(_, created)| !**created)
        .map(|(op, _)| (op.namespace.clone(), op.idempotency_key.clone()))
        .collect();
    dup_keys.sort();
    dup_keys.dedup();
    let mut existing_by_key = tx.lock_operations_by_keys(&dup_keys).await?;
    // Existing operations hit by duplicates in this batch, by key, as they stand now.
    let mut hit: HashMap<(String, String), Operation> = HashMap::new();
    let mut decided: HashMap<&str, (IngestDecision, Option<Operation>, Option<&str>)> =
        HashMap::new();
    let mut outcomes = Vec::with_capacity(batch.len());
    for (i, item) in batch.iter().enumerate() {
        let inbox_key = deliveries[i].key;
        let event_id = item.event_id();
        if !fresh[i] {
            // A redelivery: of an event decided earlier in this batch, or in an earlier one.
            let (decision, operation, first) = match decided.get(inbox_key) {
                Some((decision, op, fingerprint)) => {
                    (decision.clone(), op.clone(), fingerprint.map(str::to_owned))
                }
                None => {
                    let row = inbox_rows
                        .get(inbox_key)
                        .ok_or_else(|| Error::Corrupt(format!("inbox row {inbox_key} vanished")))?;
                    let operation = row.operation_id.and_then(|id| prior.get(&id).cloned());
                    (
                        IngestDecision::from_row(&row.decision, row.reason.clone()),
                        operation,
                        row.fingerprint.clone(),
                    )
                }
            };
            if let (Some(first), Some(this)) = (first.as_deref(), item.content_fingerprint())
                && first != this
            {
                // The same event id with other content: not a redelivery. Answered
                // as refused; the first decision stands.
                outbox.push(rejection_row(&event_id_conflict(item, &decision), now)?);
                outcomes.push(IngestOutcome {
                    event_id: event_id.to_owned(),
                    decision: IngestDecision::Rejected {
                        reason: "event_id_conflict".into(),
                    },
                    inbox_hit: false,
                    operation: None,
                });
                continue;
            }
            outcomes.push(IngestOutcome {
                event_id: event_id.to_owned(),
                decision,
                inbox_hit: true,
                operation,
            });
            continue;
        }
        let (decision, operation) = match item {
            IngestItem::Rejected(rejected) => {
                outbox.push(rejection_row(rejected, now)?);
                let reason = rejected.rejection.reason.to_owned();
                (IngestDecision::Rejected { reason }, None)
            }
            IngestItem::Accepted(env) if guarded[i].is_some() => {
                let Some((reason, key)) = guarded[i].clone() else {
                    return Err(Error::Corrupt("guard lost".into()));
                };
                let mut existing = match hit.remove(&key) {
                    Some(op) => op,
                    None => tx
                        .lock_operation_by_key(&key.0, &key.1)
                        .await?
                        .ok_or_else(|| {
                            Error::Corrupt(format!("operation for key {} vanished", key.1))
                        })?,
                };
                outbox.push(result_row(
                    &mut existing,
                    &env.event_id,
                    Dedupe::hit(reason),
                    now,
                )?);
                hit.insert(key, existing.clone());
                let reason = reason.to_owned();
                (IngestDecision::Deduplicated { reason }, Some(existing))
            }
            IngestItem::Accepted(env) => {
                let c = candidate_of[i].ok_or_else(|| Error::Corrupt("candidate lost".into()))?;
                if created[c] {
                    let lease = leases[c].take();
                    let mut op = match &lease {
                        Some((before, ..)) => before.clone(),
                        None => candidates[c].clone(),
                    };
                    op.result_seq = 0;
                    outbox.push(result_row(&mut op, &env.event_id, Dedupe::miss(), now)?);
                    events.push(NewEvent {
                        operation_id: op.operation_id,
                        from: None,
                        to: op.status,
                        reason: "ingested",
                        attempt_id: None,
                        epoch: 0,
                        // Who proposed it, when it came through an authenticated interface.
                        actor: env.delivery.principal.as_deref(),
                        at: now,
                        detail: None,
                    });
                    if let Some((_, attempt, claimed_event)) = lease {
                        let mut claimed = candidates[c].clone();
                        claimed.result_seq = op.result_seq;
                        outbox.push(result_row(
                            &mut claimed,
                            &env.event_id,
                            Dedupe::miss(),
                            now,
                        )?);
                        claims.push(Claim {
                            first_attempt_at: claimed.first_attempt_at,
                            operation: claimed.clone(),
                            attempt_id: Some(attempt.attempt_id),
                            claimed_at: now,
                        });
                        events.push(claimed_event);
                        attempts.push(attempt);
                        op = claimed;
                    }
                    queue.push(c);
                    (IngestDecision::Accepted, Some(op))
                } else {
                    let key = (env.key.namespace.clone(), env.key.key.clone());
                    let existing = match hit.remove(&key) {
                        Some(op) => op,
                        None => existing_by_key.remove(&key).ok_or_else(|| {
                            Error::Corrupt(format!("operation for key {} vanished", key.1))
                        })?,
                    };
                    let (decision, existing) = duplicate(env, existing, now, &mut outbox)?;
                    hit.insert(key, existing.clone());
                    (decision, Some(existing))
                }
            }
        };
        decisions.push((
            i,
            decision.clone(),
            operation.as_ref().map(|o| o.operation_id),
        ));
        decided.insert(
            inbox_key,
            (
                decision.clone(),
                operation.clone(),
                item.content_fingerprint(),
            ),
        );
        outcomes.push(IngestOutcome {
            event_id: event_id.to_owned(),
            decision,
            inbox_hit: false,
            operation,
        });
    }

    let queue_rows: Vec<(&Operation, QueueState, OffsetDateTime)> = queue
        .iter()
        .map(|&c| (&candidates[c], QueueState::of(candidates[c].status), now))
        .collect();
    // The operations hit by duplicates (each locked above) are updated with the rest.
    let hit_ops: Vec<Operation> = hit.values().cloned().collect();
    tx.write_rows(
        &Rows {
            attempts: &attempts,
            events: &events,
            queue: &queue_rows,
            outbox: &outbox,
            operations: &hit_ops,
            finished: &[],
        },
        now,
    )
    .await?;
    // A dedupe outcome, and a claim, report the operation as it stands after the whole
    // batch (a duplicate later in the batch adds a result to a claimed operation).
    let operations = outcomes
        .iter_mut()
        .filter_map(|o| o.operation.as_mut())
        .chain(claims.iter_mut().map(|c| &mut c.operation));
    for op in operations {
        if let Some(latest) = hit.get(&(op.namespace.clone(), op.idempotency_key.clone())) {
            *op = latest.clone();
        }
    }
    // The inbox rows whose proposals ended otherwise than their row says.
    let inbox_rows: Vec<(&str, &IngestDecision, Option<Uuid>)> = decisions
        .iter()
        .filter(|(i, decision, op)| {
            *decision != *deliveries[*i].decision || *op != deliveries[*i].operation_id
        })
        .map(|(i, decision, op)| (deliveries[*i].key, decision, *op))
        .collect();
    tx.set_inbox_batch(&inbox_rows).await?;
    if created_waiting(&outcomes).next().is_none() {
        // Each operation it created is claimed or parked: nothing for a dispatcher.
        tx.leaves_nothing_claimable();
    }
    Ok((outcomes, claims))
}

/// The refusal of an accepted proposal that the ledger's contents contradict.
fn refusal(env: &Envelope, reason: &'static str, message: String) -> RejectedProposal {
    RejectedProposal {
        event_id: env.event_id.clone(),
        delivery: env.delivery.clone(),
        namespace: Some(env.key.namespace.clone()),
        workflow_id: env.workflow_id.clone(),
        step: env.step,
        tool: Some(env.tool.clone()),
        entity: Some(env.entity.clone()),
        rejection: Rejection { reason, message },
        content_fingerprint: Some(env.content_fingerprint.clone()),
    }
}

/// The refusal of a proposal that reuses an event id with other content.
pub(super) fn event_id_conflict(item: &IngestItem, first: &IngestDecision) -> RejectedProposal {
    let message = format!(
        "event id `{}` was already used by a proposal with other content (decided {}); a new proposal needs a new event id",
        item.event_id(),
        first.as_str()
    );
    match item {
        IngestItem::Accepted(env) => refusal(env, "event_id_conflict", message),
        IngestItem::Rejected(r) => RejectedProposal {
            rejection: Rejection {
                reason: "event_id_conflict",
                message,
            },
            ..(**r).clone()
        },
    }
}

/// A proposal whose key names an existing operation: a dedupe hit (a new result with the
/// next sequence number), or a key conflict when the tool differs or, for the
/// workflow_step strategy, the arguments differ.
pub(super) fn duplicate(
    env: &Envelope,
    mut existing: Operation,
    now: OffsetDateTime,
    outbox: &mut Vec<NewOutbox>,
) -> Result<(IngestDecision, Operation)> {
    let conflict = if existing.tool != env.tool {
        Some(format!(
            "key `{}` already names operation {} of tool `{}`; give the tools distinct key templates",
            env.key.key, existing.operation_id, existing.tool
        ))
    } else if env.key_strategy == KeyStrategy::WorkflowStep
        && existing.args_fingerprint != env.args_fingerprint
    {
        Some(format!(
            "key `{}` already names operation {} with different arguments; a new step is needed",
            env.key.key, existing.operation_id
        ))
    } else {
        None
    };
    if let Some(message) = conflict {
        let rejected = refusal(env, "key_conflict", message);
        outbox.push(rejection_row(&rejected, now)?);
        let decision = IngestDecision::Rejected {
            reason: "key_conflict".into(),
        };
        return Ok((decision, existing));
    }
    outbox.push(result_row(
        &mut existing,
        &env.event_id,
        Dedupe::hit("key"),
        now,
    )?);
    let decision = IngestDecision::Deduplicated {
        reason: "key".into(),
    };
    Ok((decision, existing))
}
