//! Small helpers both adapters share: row-decoding errors, durations, source columns,
//! and list pagination.

use std::time::Duration;

use opgate_core::{Delivery, Operation, Source};
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
pub(crate) fn live_sql() -> String {
    format!(
        "SELECT tool, side_effect_class, status, COUNT(*) AS n, \
         MIN(CASE WHEN status = 'unknown_outcome' THEN COALESCE(unknown_since, updated_at) \
             ELSE updated_at END) AS oldest \
         FROM operations WHERE status NOT IN ({}) GROUP BY 1, 2, 3",
        crate::types::TERMINAL_SQL
    )
}

/// Unfinished dispatch-queue rows per state.
pub(crate) const QUEUE_DEPTH_SQL: &str =
    "SELECT state, COUNT(*) FROM dispatch_queue WHERE state <> 'done' GROUP BY state";
