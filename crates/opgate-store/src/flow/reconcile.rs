//! The reconciler's claim: expired leases become `unknown_outcome`, then due ambiguous
//! operations are leased.

use super::*;

/// Expires leases and claims ambiguous operations (see [`crate::Ledger::claim_reconcile`]).
pub(crate) async fn claim_reconcile<T: Tx>(
    tx: &mut T,
    request: &ClaimRequest,
) -> Result<Vec<Claim>> {
    let now = tx.now().await?;
    for id in tx.pick_expired(now, request.limit).await? {
        let Some(mut op) = tx.try_lock_operation(id).await? else {
            continue;
        };
        let lost_by = op.lease_owner.clone();
        // The lost attempt started when it was claimed (the last update before now): an
        // effect may exist from then on.
        let claimed_at = op.updated_at;
        // The lease holder lost it: fence it off before anyone acts on the operation.
        op.lease_epoch += 1;
        op.error = Some(ErrorInfo {
            category: "lease_expired".into(),
            retryable: false,
            retry_after_seconds: None,
            message: Some(format!(
                "the lease of {} expired before an outcome was recorded",
                lost_by.as_deref().unwrap_or("a worker")
            )),
        });
        let changed = change(
            tx,
            &mut op,
            Change {
                event: Event::OutcomeUnknown,
                reason: "lease_expired",
                attempt_id: None,
                actor: None,
                next_in: None,
                detail: Some(json!({ "lease_owner": lost_by })),
                ambiguity: Ambiguity::Since(claimed_at),
            },
            now,
        )
        .await?;
        changed?;
    }
    let mut claims = Vec::new();
    for id in tx.pick_reconcilable(now, request.limit).await? {
        let Some(mut op) = tx.try_lock_operation(id).await? else {
            continue;
        };
        op.lease_epoch += 1;
        op.lease_owner = Some(request.owner.clone());
        op.lease_expires_at = Some(add(now, request.lease));
        op.updated_at = now;
        tx.update_operation(&op).await?;
        claims.push(Claim {
            first_attempt_at: op.first_attempt_at,
            operation: op,
            attempt_id: None,
            claimed_at: now,
        });
    }
    Ok(claims)
}
