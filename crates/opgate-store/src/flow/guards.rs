//! Policies beside the key (dedupe window, exclusive group), decided inside the ingest
//! transaction under a per-entity lock.

use super::*;

/// What a guard looks for: an operation on `entity_key` created since `since` by one of
/// `tools` (with `fingerprint`, when given) that has not failed, been refused or been
/// undone — other than the proposal's own key (a key hit is a `key` dedupe instead).
pub(crate) struct GuardProbe<'a> {
    pub entity_key: &'a str,
    pub tools: &'a [String],
    pub since: OffsetDateTime,
    pub fingerprint: Option<&'a str>,
    pub namespace: &'a str,
    pub exclude_key: &'a str,
}

/// The statuses that no longer count for a guard ([`Status::never_acts`]).
pub(crate) static GUARD_IGNORES: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| Status::sql_list(Status::never_acts));

/// For each fresh, accepted proposal whose tool has guards: the reason and the key of
/// the operation that suppresses it — an earlier proposal of this batch that becomes an
/// operation, or a recent operation in the ledger.
///
/// The key decides first: a proposal whose own key already names an operation (in the
/// ledger or earlier in the batch) is a key dedupe or conflict, never a guard hit. Each
/// guarded entity is locked for the transaction ([`Tx::lock_entity`], in sorted order) so
/// two transactions cannot both find "nothing yet" and both act.
pub(super) async fn guard_hits<T: Tx>(
    tx: &mut T,
    batch: &[IngestItem],
    fresh: &[bool],
    now: OffsetDateTime,
) -> Result<Vec<Option<(&'static str, (String, String))>>> {
    let mut hits = vec![None; batch.len()];
    let guarded: Vec<(usize, &Envelope)> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, item)| match item {
            IngestItem::Accepted(env) if fresh[i] && !env.guards.is_empty() => Some((i, &**env)),
            _ => None,
        })
        .collect();
    if guarded.is_empty() {
        return Ok(hits);
    }
    let entities: std::collections::BTreeSet<&str> = guarded
        .iter()
        .map(|(_, env)| env.entity_key.as_str())
        .collect();
    for entity in entities {
        tx.lock_entity(entity).await?;
    }
    // Whether a key already names an operation in the ledger (asked at most once per key).
    let mut known: HashMap<(String, String), bool> = HashMap::new();
    for (i, env) in guarded {
        let own = (env.key.namespace.clone(), env.key.key.clone());
        // An earlier proposal of this batch with the same key decides for this one only
        // if it becomes the operation: one a guard suppressed makes none, so this one
        // faces the same guards (found by `opgate eval`: a refund suppressed by the
        // account's credit, then the same refund under another event id, acted).
        let earlier_same_key = batch[..i].iter().enumerate().any(|(j, other)| {
            matches!(other, IngestItem::Accepted(o)
                if fresh[j] && hits[j].is_none() && o.key.namespace == own.0 && o.key.key == own.1)
        });
        if earlier_same_key || exists(tx, &mut known, &own).await? {
            continue;
        }
        for guard in &env.guards {
            // A window reaching before the epoch (or past what time can represent)
            // covers everything.
            let since = time::Duration::try_from(guard.window)
                .ok()
                .and_then(|w| now.checked_sub(w))
                .unwrap_or(OffsetDateTime::UNIX_EPOCH);
            // An earlier proposal of this batch that becomes a new operation.
            let mut found = None;
            for (j, other) in batch[..i].iter().enumerate() {
                let IngestItem::Accepted(o) = other else {
                    continue;
                };
                let candidate = fresh[j]
                    && hits[j].is_none()
                    && o.entity_key == env.entity_key
                    && o.key.key != env.key.key
                    && guard.tools.contains(&o.tool)
                    && (!guard.same_args || o.args_fingerprint == env.args_fingerprint);
                let key = (o.key.namespace.clone(), o.key.key.clone());
                if candidate && !exists(tx, &mut known, &key).await? {
                    found = Some(key);
                    break;
                }
            }
            if found.is_none() {
                found = tx
                    .lock_guarded(&GuardProbe {
                        entity_key: &env.entity_key,
                        tools: &guard.tools,
                        since,
                        fingerprint: guard.same_args.then_some(env.args_fingerprint.as_str()),
                        namespace: &env.key.namespace,
                        exclude_key: &env.key.key,
                    })
                    .await?
                    .map(|op| (op.namespace, op.idempotency_key));
            }
            if let Some(key) = found {
                hits[i] = Some((guard.reason, key));
                break;
            }
        }
    }
    Ok(hits)
}

/// Whether `key` names an operation in the ledger, remembered in `known`.
pub(super) async fn exists<T: Tx>(
    tx: &mut T,
    known: &mut HashMap<(String, String), bool>,
    key: &(String, String),
) -> Result<bool> {
    if let Some(&hit) = known.get(key) {
        return Ok(hit);
    }
    let hit = tx.lock_operation_by_key(&key.0, &key.1).await?.is_some();
    known.insert(key.clone(), hit);
    Ok(hit)
}
