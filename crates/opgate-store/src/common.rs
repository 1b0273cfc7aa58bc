//! Small helpers both adapters share: row-decoding errors, durations, source columns,
//! and list pagination.

use std::time::Duration;

use opgate_core::{Delivery, Operation, Source};
use serde_json::Value;
use uuid::Uuid;

use crate::types::{ListFilter, Page};
use crate::{Error, Result};

/// A stored value the store cannot read back.
pub(crate) fn corrupt(what: &str, value: &str) -> Error {
    Error::Corrupt(format!("{what} {value:?}"))
}

/// Whole milliseconds, saturating.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The inbox's topic / partition / offset columns for a delivery.
pub(crate) fn source_columns(delivery: &Delivery) -> (Option<&str>, Option<i32>, Option<i64>) {
    match &delivery.source {
        Source::Kafka {
            topic,
            partition,
            offset,
        } => (Some(topic.as_str()), Some(*partition), Some(*offset)),
        Source::Http => (None, None, None),
    }
}

/// The page size of a list request (default 50, at most 500).
pub(crate) fn page_size(filter: &ListFilter) -> usize {
    filter.limit.unwrap_or(50).clamp(1, 500)
}

/// The cursor of a list request (the last operation id of the previous page).
pub(crate) fn parse_cursor(filter: &ListFilter) -> Result<Option<Uuid>> {
    filter
        .cursor
        .as_deref()
        .map(|c| Uuid::parse_str(c).map_err(|_| Error::Corrupt(format!("bad cursor {c:?}"))))
        .transpose()
}

/// A value the operations list binds: text, or the cursor (an operation id).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ListBind {
    Text(String),
    Cursor(Uuid),
}

/// The operations list's statement with only the filters given (each one can then use
/// its index; `$1 IS NULL OR status = $1` would hide them from a prepared statement's
/// generic plan), newest first, one row more than the page. The binds follow in order;
/// the last placeholder is the row limit.
pub(crate) fn list_sql(filter: &ListFilter, cursor: Option<Uuid>) -> (String, Vec<ListBind>) {
    let mut clauses = Vec::new();
    let mut binds = Vec::new();
    let texts = [
        ("status", filter.status.map(|s| s.as_str().to_owned())),
        ("tool", filter.tool.clone()),
        // The same expression as the index operations_by_entity.
        ("(entity_type || ':' || entity_id)", filter.entity.clone()),
        ("namespace", filter.namespace.clone()),
        ("idempotency_key", filter.idempotency_key.clone()),
        ("agent_id", filter.agent_id.clone()),
    ];
    for (column, value) in texts {
        if let Some(value) = value {
            binds.push(ListBind::Text(value));
            clauses.push(format!("{column} = ${}", binds.len()));
        }
    }
    if let Some(cursor) = cursor {
        binds.push(ListBind::Cursor(cursor));
        clauses.push(format!("operation_id < ${}", binds.len()));
    }
    let filter = if clauses.is_empty() {
        String::new()
    } else {
        format!("WHERE {} ", clauses.join(" AND "))
    };
    (
        format!(
            "SELECT {{columns}} FROM operations {filter}ORDER BY operation_id DESC LIMIT ${}",
            binds.len() + 1
        ),
        binds,
    )
}

/// Cuts one extra row off a page and turns it into the next cursor.
pub(crate) fn paginate(mut operations: Vec<Operation>, limit: usize) -> Page {
    let next_cursor = if operations.len() > limit {
        operations.truncate(limit);
        operations.last().map(|o| o.operation_id.to_string())
    } else {
        None
    };
    Page {
        operations,
        next_cursor,
    }
}

/// Live (non-terminal) operations per tool, class and state, with the oldest entry into
/// the state: `unknown_since` for unknown outcomes (the reconciler's lookups touch
/// `updated_at` without changing the state), the last change otherwise.
/// `table` holds the state with the tool and class: `operations`, or PostgreSQL's
/// `operation_state`.
pub(crate) fn live_sql(table: &str) -> String {
    format!(
        "SELECT tool, side_effect_class, status, COUNT(*) AS n, \
         MIN(CASE WHEN status = 'unknown_outcome' THEN COALESCE(unknown_since, updated_at) \
             ELSE updated_at END) AS oldest \
         FROM {table} WHERE status IN ({}) GROUP BY 1, 2, 3",
        *crate::types::LIVE_SQL
    )
}

/// Dispatch-queue rows per state (the queue holds live work only: a finished operation's
/// row is deleted in the transaction that finishes it).
pub(crate) const QUEUE_DEPTH_SQL: &str =
    "SELECT state, COUNT(*) FROM dispatch_queue GROUP BY state";

/// An operation's result rows (through `result_outbox_operation`).
pub(crate) const RESULTS_SQL: &str = "SELECT seq, status, created_at, published_at \
     FROM result_outbox WHERE operation_id = $1 ORDER BY id";

/// Inbox decisions since `$1` (a range of `inbox_received`).
pub(crate) const DECISIONS_SQL: &str = "SELECT decision, reason, COUNT(*) AS n FROM inbox \
     WHERE received_at >= $1 GROUP BY decision, reason ORDER BY n DESC, decision, reason";

/// The predicate of the partial index `operation_events_unknown`, repeated word for word
/// in the queries that should use it (SQLite matches the text).
const UNKNOWN_EVENTS: &str = "(from_status = 'unknown_outcome' OR to_status = 'unknown_outcome')";

/// Operations that entered `unknown_outcome` since `$1`.
pub(crate) fn unknown_entered_sql() -> String {
    format!(
        "SELECT COUNT(*) FROM operation_events WHERE {UNKNOWN_EVENTS} AND at >= $1 \
         AND to_status = 'unknown_outcome' AND COALESCE(from_status, '') <> 'unknown_outcome'"
    )
}

/// Operations that left `unknown_outcome` since `$1`, newest first, at most `$2`.
pub(crate) fn unknown_exits_sql() -> String {
    format!(
        "SELECT to_status, actor IS NOT NULL AS by_person, detail FROM operation_events \
         WHERE {UNKNOWN_EVENTS} AND at >= $1 \
         AND from_status = 'unknown_outcome' AND to_status <> 'unknown_outcome' \
         ORDER BY at DESC LIMIT $2"
    )
}

/// How long an operation leaving `unknown_outcome` had been unknown (its event's detail).
pub(crate) fn waited_ms(detail: Option<&Value>) -> Option<i64> {
    detail?.get("unknown_for_ms")?.as_i64()
}

/// The result rows a relay may lease so that each operation's results are published in
/// order: of the candidates (`id`, operation), every row without an operation, and for
/// each operation the longest run of its unpublished rows, from its oldest, that are all
/// candidates. A row whose predecessor is leased elsewhere, locked by another claim or
/// cut off by the batch limit waits, so it can never overtake it.
pub(crate) fn in_order_prefix(
    candidates: &[(i64, Option<Uuid>)],
    unpublished: &[(Uuid, i64)],
) -> Vec<i64> {
    use std::collections::{BTreeSet, HashMap};
    let chosen: BTreeSet<i64> = candidates.iter().map(|(id, _)| *id).collect();
    let mut per_op: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for (op, id) in unpublished {
        per_op.entry(*op).or_default().push(*id);
    }
    let mut keep: BTreeSet<i64> = candidates
        .iter()
        .filter(|(_, op)| op.is_none())
        .map(|(id, _)| *id)
        .collect();
    for ids in per_op.values_mut() {
        ids.sort_unstable();
        keep.extend(ids.iter().take_while(|id| chosen.contains(id)));
    }
    keep.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_never_overtakes_an_earlier_one_of_its_operation() {
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        // a: 1, 3, 5 unpublished; 1 is leased elsewhere, so 3 and 5 wait.
        // b: 2, 4 unpublished, both candidates. Row 6 has no operation.
        let candidates = [
            (2, Some(b)),
            (3, Some(a)),
            (4, Some(b)),
            (5, Some(a)),
            (6, None),
        ];
        let unpublished = [(a, 1), (b, 2), (a, 3), (b, 4), (a, 5)];
        assert_eq!(in_order_prefix(&candidates, &unpublished), vec![2, 4, 6]);
        // Once 1 is a candidate too, all of a's rows go, in a run.
        let candidates = [(1, Some(a)), (3, Some(a)), (5, Some(a))];
        assert_eq!(in_order_prefix(&candidates, &unpublished), vec![1, 3, 5]);
        // A gap (3 locked by another claim) stops the run at the gap.
        let candidates = [(1, Some(a)), (5, Some(a))];
        assert_eq!(in_order_prefix(&candidates, &unpublished), vec![1]);
    }
}
