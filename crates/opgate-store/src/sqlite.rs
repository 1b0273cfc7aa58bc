//! The SQLite ledger, for the embedded default (`opgate dev`) and service-free tests.
//!
//! SQLite has one writer at a time, so every write transaction runs on a single
//! dedicated connection (no `SKIP LOCKED` needed: claimers are serialized), while reads
//! use a separate read-only pool over WAL. Timestamps are TEXT in one fixed RFC 3339 UTC
//! format with milliseconds, so they compare as text; the clock is SQLite's `now`.

use std::str::FromStr;
use std::time::Duration;

use opgate_core::{Entity, ErrorInfo, IngestItem, Operation, SideEffectClass, Status};
use serde_json::Value;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Row, Sqlite, Transaction};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use uuid::Uuid;

use crate::common::{
    DECISIONS_SQL, ListBind, QUEUE_DEPTH_SQL, RESULTS_SQL, corrupt, in_order_prefix, list_sql,
    live_sql, millis, page_size, paginate, parse_cursor, source_columns, unknown_entered_sql,
    unknown_exits_sql, waited_ms,
};
use crate::flow::{
    self, GUARD_IGNORES, GuardProbe, InboxRow, NewAttempt, NewEvent, NewInbox, NewOutbox, Tx,
};
use crate::schema::{self, SchemaStatus};
use crate::signal::{Changes, Signal};
use crate::types::*;
use crate::{Error, Ledger, Result};

/// A ledger in a SQLite file.
#[derive(Debug, Clone)]
pub struct SqliteLedger {
    writer: SqlitePool,
    reader: SqlitePool,
    signal: Signal,
}

impl SqliteLedger {
    /// Opens (creating the file if needed) without migrating. Accepts `sqlite://PATH`,
    /// `sqlite:PATH` or a plain path.
    pub async fn open(url: &str) -> Result<Self> {
        let path = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .unwrap_or(url);
        let options = SqliteConnectOptions::from_str(&format!("sqlite://{path}"))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options.clone())
            .await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options.read_only(true))
            .await?;
        Ok(Self {
            writer,
            reader,
            signal: Signal::new(),
        })
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        schema::SQLITE.run(&self.writer).await?;
        Ok(())
    }

    async fn begin(&self) -> Result<SqliteTx> {
        Ok(SqliteTx(self.writer.begin().await?, false))
    }
}

/// See the PostgreSQL twin: commit on success, retry on transient conflicts.
macro_rules! in_tx {
    ($self:ident, |$tx:ident| $body:expr) => {
        in_tx!($self, Error::is_transient, |$tx| $body)
    };
    ($self:ident, $retry_when:expr, |$tx:ident| $body:expr) => {{
        use backon::Retryable as _;
        (|| async {
            let mut $tx = $self.begin().await?;
            let out = $body;
            $tx.0.commit().await?;
            Ok::<_, Error>(out)
        })
        .retry(crate::retry_policy())
        .when($retry_when)
        .await
    }};
}

/// A write transaction whose commit may have made work for the dispatcher or the relay:
/// they are woken once it committed.
macro_rules! write_tx {
    ($self:ident, |$tx:ident| $body:expr) => {
        write_tx!($self, Error::is_transient, |$tx| $body)
    };
    ($self:ident, $retry_when:expr, |$tx:ident| $body:expr) => {{
        let out = in_tx!($self, $retry_when, |$tx| {
            let out = $body;
            (out, !$tx.1)
        });
        out.map(|(out, claimable)| {
            $self.signal.commit(claimable);
            out
        })
    }};
}

/// A transaction, and whether its commit need not wake this process's dispatcher
/// ([`Tx::leaves_nothing_claimable`]).
struct SqliteTx(Transaction<'static, Sqlite>, bool);

const OP_COLUMNS: &str = "operation_id, namespace, idempotency_key, key_components, args_fingerprint, \
    event_id, agent_id, workflow_id, run_id, step, tool, intent, entity_type, entity_id, entity_key, \
    canonical_args, side_effect_class, status, attempt_count, first_attempt_at, next_attempt_at, \
    unknown_since, lease_owner, lease_expires_at, lease_epoch, external_request_id, \
    external_object_id, result, error, compensates, traceparent, result_seq, created_at, updated_at, \
    ambiguous_since";

/// The one timestamp format stored: `YYYY-MM-DDTHH:MM:SS.sssZ`.
fn ts(at: OffsetDateTime) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second(),
        at.millisecond()
    )
}

fn ts_opt(at: Option<OffsetDateTime>) -> Option<String> {
    at.map(ts)
}

fn parse_ts(text: &str) -> Result<OffsetDateTime> {
    OffsetDateTime::parse(text, &Rfc3339)
        .map_err(|e| Error::Corrupt(format!("timestamp {text:?}: {e}")))
}

fn get_ts(row: &SqliteRow, col: &str) -> Result<OffsetDateTime> {
    parse_ts(&row.try_get::<String, _>(col)?)
}

fn get_ts_opt(row: &SqliteRow, col: &str) -> Result<Option<OffsetDateTime>> {
    row.try_get::<Option<String>, _>(col)?
        .as_deref()
        .map(parse_ts)
        .transpose()
}

fn get_uuid_opt(row: &SqliteRow, col: &str) -> Result<Option<Uuid>> {
    row.try_get::<Option<String>, _>(col)?
        .map(|s| Uuid::parse_str(&s).map_err(|e| Error::Corrupt(format!("{col} {s:?}: {e}"))))
        .transpose()
}

fn get_uuid(row: &SqliteRow, col: &str) -> Result<Uuid> {
    get_uuid_opt(row, col)?.ok_or_else(|| Error::Corrupt(format!("{col} is null")))
}

fn get_json_opt<T: serde::de::DeserializeOwned>(row: &SqliteRow, col: &str) -> Result<Option<T>> {
    row.try_get::<Option<String>, _>(col)?
        .map(|s| serde_json::from_str(&s).map_err(|e| Error::Corrupt(format!("{col}: {e}"))))
        .transpose()
}

fn get_json(row: &SqliteRow, col: &str) -> Result<Value> {
    get_json_opt(row, col)?.ok_or_else(|| Error::Corrupt(format!("{col} is null")))
}

/// A value as the JSON text SQLite stores. A value that cannot be serialized is an
/// error, never a stored `null` (which would read back as another value).
fn json_text<T: serde::Serialize>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|e| Error::Corrupt(format!("not serializable: {e}")))
}

fn op_from_row(row: &SqliteRow) -> Result<Operation> {
    let class: String = row.try_get("side_effect_class")?;
    let status: String = row.try_get("status")?;
    Ok(Operation {
        operation_id: get_uuid(row, "operation_id")?,
        namespace: row.try_get("namespace")?,
        idempotency_key: row.try_get("idempotency_key")?,
        key_components: get_json(row, "key_components")?,
        args_fingerprint: row.try_get("args_fingerprint")?,
        event_id: row.try_get("event_id")?,
        agent_id: row.try_get("agent_id")?,
        workflow_id: row.try_get("workflow_id")?,
        run_id: row.try_get("run_id")?,
        step: row.try_get::<Option<i64>, _>("step")?.map(|s| s as u64),
        tool: row.try_get("tool")?,
        intent: row.try_get("intent")?,
        entity: Entity {
            kind: row.try_get("entity_type")?,
            id: row.try_get("entity_id")?,
        },
        entity_key: row.try_get("entity_key")?,
        canonical_args: get_json(row, "canonical_args")?,
        side_effect_class: SideEffectClass::parse(&class)
            .ok_or_else(|| corrupt("side_effect_class", &class))?,
        status: Status::parse(&status).ok_or_else(|| corrupt("status", &status))?,
        attempt_count: row.try_get::<i64, _>("attempt_count")? as u32,
        first_attempt_at: get_ts_opt(row, "first_attempt_at")?,
        next_attempt_at: get_ts_opt(row, "next_attempt_at")?,
        unknown_since: get_ts_opt(row, "unknown_since")?,
        ambiguous_since: get_ts_opt(row, "ambiguous_since")?,
        lease_owner: row.try_get("lease_owner")?,
        lease_expires_at: get_ts_opt(row, "lease_expires_at")?,
        lease_epoch: row.try_get("lease_epoch")?,
        external_request_id: row.try_get("external_request_id")?,
        external_object_id: row.try_get("external_object_id")?,
        result: get_json_opt(row, "result")?,
        error: get_json_opt::<ErrorInfo>(row, "error")?,
        compensates: get_uuid_opt(row, "compensates")?,
        traceparent: row.try_get("traceparent")?,
        result_seq: row.try_get("result_seq")?,
        created_at: get_ts(row, "created_at")?,
        updated_at: get_ts(row, "updated_at")?,
    })
}

fn ids(rows: Vec<String>) -> Result<Vec<Uuid>> {
    rows.iter().map(|s| parse_uuid(s)).collect()
}

fn parse_uuid(s: &str) -> Result<Uuid> {
    Uuid::parse_str(s).map_err(|e| Error::Corrupt(format!("operation_id {s:?}: {e}")))
}

impl Tx for SqliteTx {
    fn leaves_nothing_claimable(&mut self) {
        self.1 = true;
    }

    async fn now(&mut self) -> Result<OffsetDateTime> {
        let now: String = sqlx::query_scalar("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now')")
            .fetch_one(&mut *self.0)
            .await?;
        parse_ts(&now)
    }

    async fn insert_inbox(&mut self, row: NewInbox<'_>, at: OffsetDateTime) -> Result<bool> {
        let (topic, partition, offset) = source_columns(row.delivery);
        let done = sqlx::query(
            r#"INSERT INTO inbox (source_id, topic, "partition", "offset", decision, reason,
                                  operation_id, received_at, fingerprint)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (source_id) DO NOTHING"#,
        )
        .bind(row.key)
        .bind(topic)
        .bind(partition)
        .bind(offset)
        .bind(row.decision.as_str())
        .bind(row.decision.reason())
        .bind(row.operation_id.map(|u| u.to_string()))
        .bind(ts(at))
        .bind(row.fingerprint)
        .execute(&mut *self.0)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn inbox(&mut self, key: &str) -> Result<Option<InboxRow>> {
        /// decision, reason, operation_id, fingerprint.
        type Row = (String, Option<String>, Option<String>, Option<String>);
        let row: Option<Row> = sqlx::query_as(
            "SELECT decision, reason, operation_id, fingerprint FROM inbox WHERE source_id = $1",
        )
        .bind(key)
        .fetch_optional(&mut *self.0)
        .await?;
        row.map(|(decision, reason, operation_id, fingerprint)| {
            Ok(InboxRow {
                decision,
                reason,
                operation_id: operation_id.as_deref().map(parse_uuid).transpose()?,
                fingerprint,
            })
        })
        .transpose()
    }

    async fn set_inbox(
        &mut self,
        event_id: &str,
        decision: &IngestDecision,
        operation_id: Option<Uuid>,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE inbox SET decision = $2, reason = $3, operation_id = $4 WHERE source_id = $1",
        )
        .bind(event_id)
        .bind(decision.as_str())
        .bind(decision.reason())
        .bind(operation_id.map(|u| u.to_string()))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn insert_operation(&mut self, op: &Operation) -> Result<bool> {
        let done = sqlx::query(&format!(
            "INSERT INTO operations ({OP_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, \
             $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, \
             $28, $29, $30, $31, $32, $33, $34, $35) \
             ON CONFLICT (namespace, idempotency_key) DO NOTHING"
        ))
        .bind(op.operation_id.to_string())
        .bind(&op.namespace)
        .bind(&op.idempotency_key)
        .bind(json_text(&op.key_components)?)
        .bind(&op.args_fingerprint)
        .bind(&op.event_id)
        .bind(&op.agent_id)
        .bind(&op.workflow_id)
        .bind(&op.run_id)
        .bind(op.step.map(|s| s as i64))
        .bind(&op.tool)
        .bind(&op.intent)
        .bind(&op.entity.kind)
        .bind(&op.entity.id)
        .bind(&op.entity_key)
        .bind(json_text(&op.canonical_args)?)
        .bind(op.side_effect_class.as_str())
        .bind(op.status.as_str())
        .bind(i64::from(op.attempt_count))
        .bind(ts_opt(op.first_attempt_at))
        .bind(ts_opt(op.next_attempt_at))
        .bind(ts_opt(op.unknown_since))
        .bind(&op.lease_owner)
        .bind(ts_opt(op.lease_expires_at))
        .bind(op.lease_epoch)
        .bind(&op.external_request_id)
        .bind(&op.external_object_id)
        .bind(op.result.as_ref().map(json_text).transpose()?)
        .bind(op.error.as_ref().map(json_text).transpose()?)
        .bind(op.compensates.map(|u| u.to_string()))
        .bind(&op.traceparent)
        .bind(op.result_seq)
        .bind(ts(op.created_at))
        .bind(ts(op.updated_at))
        .bind(ts_opt(op.ambiguous_since))
        .execute(&mut *self.0)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn read_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        self.lock_operation(id).await
    }

    async fn try_lock_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        // One writer at a time: nothing else can hold the row.
        self.lock_operation(id).await
    }

    async fn lock_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE operation_id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&mut *self.0)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn lock_operation_by_key(
        &mut self,
        namespace: &str,
        key: &str,
    ) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE namespace = $1 AND idempotency_key = $2"
        ))
        .bind(namespace)
        .bind(key)
        .fetch_optional(&mut *self.0)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn lock_entity(&mut self, _entity_key: &str) -> Result<()> {
        // Every write transaction goes through the one writer connection.
        Ok(())
    }

    async fn lock_guarded(&mut self, p: &GuardProbe<'_>) -> Result<Option<Operation>> {
        let tools = serde_json::to_string(p.tools).map_err(|e| Error::Corrupt(e.to_string()))?;
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations \
             WHERE entity_key = $1 AND tool IN (SELECT value FROM json_each($2)) AND created_at >= $3 \
               AND ($4 IS NULL OR args_fingerprint = $4) \
               AND NOT (namespace = $5 AND idempotency_key = $6) \
               AND status NOT IN ({ignores}) \
             ORDER BY created_at LIMIT 1",
            ignores = *GUARD_IGNORES
        ))
        .bind(p.entity_key)
        .bind(tools)
        .bind(ts(p.since))
        .bind(p.fingerprint)
        .bind(p.namespace)
        .bind(p.exclude_key)
        .fetch_optional(&mut *self.0)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn update_operation(&mut self, op: &Operation) -> Result<()> {
        sqlx::query(
            "UPDATE operations SET status = $2, attempt_count = $3, first_attempt_at = $4, \
             next_attempt_at = $5, unknown_since = $6, lease_owner = $7, lease_expires_at = $8, \
             lease_epoch = $9, external_request_id = $10, external_object_id = $11, result = $12, \
             error = $13, result_seq = $14, updated_at = $15, ambiguous_since = $16 WHERE operation_id = $1",
        )
        .bind(op.operation_id.to_string())
        .bind(op.status.as_str())
        .bind(i64::from(op.attempt_count))
        .bind(ts_opt(op.first_attempt_at))
        .bind(ts_opt(op.next_attempt_at))
        .bind(ts_opt(op.unknown_since))
        .bind(&op.lease_owner)
        .bind(ts_opt(op.lease_expires_at))
        .bind(op.lease_epoch)
        .bind(&op.external_request_id)
        .bind(&op.external_object_id)
        .bind(op.result.as_ref().map(json_text).transpose()?)
        .bind(op.error.as_ref().map(json_text).transpose()?)
        .bind(op.result_seq)
        .bind(ts(op.updated_at))
        .bind(ts_opt(op.ambiguous_since))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn insert_event(&mut self, e: &NewEvent<'_>) -> Result<()> {
        sqlx::query(
            "INSERT INTO operation_events (operation_id, from_status, to_status, reason, attempt_id, \
             epoch, actor, at, detail) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(e.operation_id.to_string())
        .bind(e.from.map(Status::as_str))
        .bind(e.to.as_str())
        .bind(e.reason)
        .bind(e.attempt_id.map(|u| u.to_string()))
        .bind(e.epoch)
        .bind(e.actor)
        .bind(ts(e.at))
        .bind(e.detail.as_ref().map(json_text).transpose()?)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn insert_attempt(&mut self, a: &NewAttempt<'_>) -> Result<()> {
        sqlx::query(
            "INSERT INTO attempts (attempt_id, operation_id, number, epoch, worker, started_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(a.attempt_id.to_string())
        .bind(a.operation_id.to_string())
        .bind(i64::from(a.number))
        .bind(a.epoch)
        .bind(a.worker)
        .bind(ts(a.started_at))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn finish_attempt(
        &mut self,
        operation_id: Uuid,
        attempt_id: Uuid,
        r: &AttemptReport,
        at: OffsetDateTime,
    ) -> Result<()> {
        sqlx::query(
            "UPDATE attempts SET finished_at = $3, outcome = $4, http_status = $5, error_category = $6, \
             latency_ms = $7, provider_request_id = $8 WHERE attempt_id = $1 AND operation_id = $2",
        )
        .bind(attempt_id.to_string())
        .bind(operation_id.to_string())
        .bind(ts(at))
        .bind(&r.outcome)
        .bind(r.http_status.map(i64::from))
        .bind(&r.error_category)
        .bind(r.latency.map(millis))
        .bind(&r.provider_request_id)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn put_queue(
        &mut self,
        op: &Operation,
        state: QueueState,
        ready_at: OffsetDateTime,
    ) -> Result<()> {
        if state == QueueState::Done {
            sqlx::query("DELETE FROM dispatch_queue WHERE operation_id = $1")
                .bind(op.operation_id.to_string())
                .execute(&mut *self.0)
                .await?;
            return Ok(());
        }
        // A new row's seq is above every row in the queue (a finished operation's row is
        // gone, so its seq may be given again: seqs only order the rows present).
        sqlx::query(
            "INSERT INTO dispatch_queue (operation_id, entity_key, seq, is_read, compensates, state, ready_at, tool) \
             VALUES ($1, $2, (SELECT COALESCE(MAX(seq), 0) + 1 FROM dispatch_queue), $3, $4, $5, $6, $7) \
             ON CONFLICT (operation_id) DO UPDATE \
             SET state = excluded.state, ready_at = excluded.ready_at",
        )
        .bind(op.operation_id.to_string())
        .bind(&op.entity_key)
        .bind(!op.side_effect_class.is_write())
        .bind(op.compensates.map(|u| u.to_string()))
        .bind(state.as_str())
        .bind(ts(ready_at))
        .bind(&op.tool)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    async fn insert_outbox(&mut self, row: &NewOutbox) -> Result<()> {
        sqlx::query(
            "INSERT INTO result_outbox (operation_id, seq, status, kafka_key, payload, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(row.operation_id.map(|u| u.to_string()))
        .bind(row.seq)
        .bind(&row.status)
        .bind(&row.kafka_key)
        .bind(&row.payload)
        .bind(ts(row.at))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    // Head of line per entity: nothing in flight or held on the entity, nothing waiting
    // ahead. A compensation passes the operation it undoes (which holds the entity in
    // `compensating`) and the waiting operations queued behind that one: they wait for
    // the original, which waits for its compensation.
    async fn pick_claimable(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
        skip_tools: &[String],
    ) -> Result<Vec<(Uuid, String)>> {
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT q.operation_id, q.tool FROM dispatch_queue q \
             WHERE q.state = 'waiting' AND q.ready_at <= $1 \
               AND q.tool NOT IN (SELECT value FROM json_each($3)) \
               AND (q.is_read = 1 OR NOT EXISTS ( \
                   SELECT 1 FROM dispatch_queue p \
                   WHERE p.entity_key = q.entity_key AND p.is_read = 0 \
                     AND p.operation_id <> q.operation_id \
                     AND (q.compensates IS NULL OR p.operation_id <> q.compensates) \
                     AND (p.state IN ('inflight', 'held') \
                          OR (p.state = 'waiting' AND p.seq < q.seq AND q.compensates IS NULL)))) \
             ORDER BY q.ready_at, q.seq LIMIT $2",
        )
        .bind(ts(now))
        .bind(limit as i64)
        .bind(serde_json::to_string(skip_tools).unwrap_or_else(|_| "[]".into()))
        .fetch_all(&mut *self.0)
        .await?;
        rows.into_iter()
            .map(|(id, tool)| Ok((parse_uuid(&id)?, tool)))
            .collect()
    }

    async fn busy_entities(
        &mut self,
        entity_keys: &[&str],
    ) -> Result<std::collections::HashSet<String>> {
        if entity_keys.is_empty() {
            return Ok(std::collections::HashSet::new());
        }
        let busy: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT entity_key FROM dispatch_queue \
             WHERE entity_key IN (SELECT value FROM json_each($1)) \
               AND state IN ('waiting', 'inflight', 'held') AND is_read = 0",
        )
        .bind(serde_json::to_string(entity_keys).unwrap_or_else(|_| "[]".into()))
        .fetch_all(&mut *self.0)
        .await?;
        Ok(busy.into_iter().collect())
    }

    async fn waiting_on_entities(&mut self, entity_keys: &[&str]) -> Result<bool> {
        let found: i64 = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM dispatch_queue \
             WHERE entity_key IN (SELECT value FROM json_each($1)) \
               AND state = 'waiting' AND is_read = 0)",
        )
        .bind(serde_json::to_string(entity_keys).unwrap_or_else(|_| "[]".into()))
        .fetch_one(&mut *self.0)
        .await?;
        Ok(found != 0)
    }

    async fn pick_expired(&mut self, now: OffsetDateTime, limit: usize) -> Result<Vec<Uuid>> {
        ids(sqlx::query_scalar(
            "SELECT operation_id FROM operations WHERE status = 'dispatched' AND lease_expires_at < $1 \
             ORDER BY lease_expires_at LIMIT $2",
        )
        .bind(ts(now))
        .bind(limit as i64)
        .fetch_all(&mut *self.0)
        .await?)
    }

    async fn pick_reconcilable(&mut self, now: OffsetDateTime, limit: usize) -> Result<Vec<Uuid>> {
        ids(sqlx::query_scalar(
            "SELECT operation_id FROM operations \
             WHERE status IN ('unknown_outcome', 'acknowledged') \
               AND (next_attempt_at IS NULL OR next_attempt_at <= $1) \
               AND (lease_expires_at IS NULL OR lease_expires_at < $1) \
             ORDER BY next_attempt_at NULLS FIRST LIMIT $2",
        )
        .bind(ts(now))
        .bind(limit as i64)
        .fetch_all(&mut *self.0)
        .await?)
    }
}

fn event_from_row(row: &SqliteRow) -> Result<OperationEvent> {
    let to: String = row.try_get("to_status")?;
    let from: Option<String> = row.try_get("from_status")?;
    Ok(OperationEvent {
        event_seq: row.try_get("event_seq")?,
        from: from
            .map(|f| Status::parse(&f).ok_or_else(|| corrupt("from_status", &f)))
            .transpose()?,
        to: Status::parse(&to).ok_or_else(|| corrupt("to_status", &to))?,
        reason: row.try_get("reason")?,
        attempt_id: get_uuid_opt(row, "attempt_id")?,
        epoch: row.try_get("epoch")?,
        actor: row.try_get("actor")?,
        at: get_ts(row, "at")?,
        detail: get_json_opt(row, "detail")?,
    })
}

fn attempt_from_row(row: &SqliteRow) -> Result<Attempt> {
    let outcome: Option<String> = row.try_get("outcome")?;
    Ok(Attempt {
        attempt_id: get_uuid(row, "attempt_id")?,
        number: row.try_get::<i64, _>("number")? as u32,
        epoch: row.try_get("epoch")?,
        worker: row.try_get("worker")?,
        started_at: get_ts(row, "started_at")?,
        finished_at: get_ts_opt(row, "finished_at")?,
        report: match outcome {
            None => None,
            Some(outcome) => Some(AttemptReport {
                outcome,
                http_status: row
                    .try_get::<Option<i64>, _>("http_status")?
                    .map(|s| s as u16),
                error_category: row.try_get("error_category")?,
                latency: row
                    .try_get::<Option<i64>, _>("latency_ms")?
                    .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                provider_request_id: row.try_get("provider_request_id")?,
            }),
        },
    })
}

#[async_trait::async_trait]
impl Ledger for SqliteLedger {
    async fn ingest(&self, batch: &[IngestItem]) -> Result<Vec<IngestOutcome>> {
        write_tx!(self, |tx| flow::ingest(&mut tx, batch).await?)
    }

    async fn ingest_and_claim(
        &self,
        batch: &[IngestItem],
        _lock_wait: Duration,
        request: &ClaimRequest,
    ) -> Result<(Vec<IngestOutcome>, Vec<Claim>)> {
        // One writer at a time: no other transaction's claim can race this one's.
        write_tx!(self, Error::is_claim_race, |tx| flow::ingest_and_claim(
            &mut tx, batch, request
        )
        .await?)
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claim>> {
        in_tx!(self, Error::is_claim_race, |tx| flow::claim(
            &mut tx, request
        )
        .await?)
    }

    async fn record(&self, recordings: &[Recording]) -> Result<Vec<Result<Operation>>> {
        write_tx!(self, |tx| flow::record(&mut tx, recordings).await?)
    }

    async fn claim_reconcile(&self, request: &ClaimRequest) -> Result<Vec<Claim>> {
        in_tx!(self, |tx| flow::claim_reconcile(&mut tx, request).await?)
    }

    async fn apply(&self, command: &Command) -> Result<Operation> {
        write_tx!(self, |tx| flow::apply(&mut tx, command).await?)
            .map_err(Error::entity_busy_is_a_conflict)
    }

    async fn compensate(&self, request: &CompensationRequest) -> Result<(Operation, Operation)> {
        write_tx!(self, |tx| flow::compensate(&mut tx, request).await?)
            .map_err(Error::entity_busy_is_a_conflict)
    }

    async fn claim_results(&self, request: &ClaimRequest) -> Result<Vec<OutboxRow>> {
        let rows = in_tx!(self, |tx| {
            let now = tx.now().await?;
            let until = now + time::Duration::milliseconds(millis(request.lease));
            let candidates: Vec<(i64, Option<String>)> = sqlx::query_as(
                "SELECT id, operation_id FROM result_outbox \
                 WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < $1) \
                 ORDER BY id LIMIT $2",
            )
            .bind(ts(now))
            .bind(request.limit as i64)
            .fetch_all(&mut *tx.0)
            .await?;
            let candidates = candidates
                .into_iter()
                .map(|(id, op)| Ok((id, op.as_deref().map(parse_uuid).transpose()?)))
                .collect::<Result<Vec<_>>>()?;
            let ops: Vec<String> = candidates
                .iter()
                .filter_map(|(_, op)| op.map(|u| u.to_string()))
                .collect();
            let unpublished: Vec<(String, i64)> = sqlx::query_as(
                "SELECT operation_id, id FROM result_outbox \
                 WHERE published_at IS NULL AND operation_id IN (SELECT value FROM json_each($1))",
            )
            .bind(serde_json::to_string(&ops).unwrap_or_else(|_| "[]".into()))
            .fetch_all(&mut *tx.0)
            .await?;
            let unpublished = unpublished
                .into_iter()
                .map(|(op, id)| Ok((parse_uuid(&op)?, id)))
                .collect::<Result<Vec<_>>>()?;
            let keep = in_order_prefix(&candidates, &unpublished);
            sqlx::query(
                "UPDATE result_outbox SET claimed_by = $1, claimed_until = $2 \
                 WHERE id IN (SELECT value FROM json_each($3)) \
                 RETURNING id, operation_id, seq, status, kafka_key, payload, \
                 json_extract(payload, '$.traceparent') AS traceparent",
            )
            .bind(&request.owner)
            .bind(ts(until))
            .bind(serde_json::to_string(&keep).unwrap_or_else(|_| "[]".into()))
            .fetch_all(&mut *tx.0)
            .await?
        })?;
        let mut out = rows
            .iter()
            .map(|row| {
                Ok(OutboxRow {
                    id: row.try_get("id")?,
                    operation_id: get_uuid_opt(row, "operation_id")?,
                    seq: row.try_get("seq")?,
                    status: row.try_get("status")?,
                    kafka_key: row.try_get("kafka_key")?,
                    payload: row.try_get("payload")?,
                    traceparent: row.try_get("traceparent")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        out.sort_by_key(|r| r.id);
        Ok(out)
    }

    async fn mark_published(&self, ids: &[i64]) -> Result<()> {
        in_tx!(self, |tx| {
            let now = tx.now().await?;
            sqlx::query(
                "UPDATE result_outbox SET published_at = $1 \
                 WHERE id IN (SELECT value FROM json_each($2)) AND published_at IS NULL",
            )
            .bind(ts(now))
            .bind(json_text(&ids)?)
            .execute(&mut *tx.0)
            .await?;
        })
    }

    async fn operation(&self, id: Uuid) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE operation_id = $1"
        ))
        .bind(id.to_string())
        .fetch_optional(&self.reader)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn operation_by_key(&self, namespace: &str, key: &str) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE namespace = $1 AND idempotency_key = $2"
        ))
        .bind(namespace)
        .bind(key)
        .fetch_optional(&self.reader)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn events(&self, id: Uuid) -> Result<Vec<OperationEvent>> {
        sqlx::query(
            "SELECT event_seq, from_status, to_status, reason, attempt_id, epoch, actor, at, detail \
             FROM operation_events WHERE operation_id = $1 ORDER BY event_seq",
        )
        .bind(id.to_string())
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(event_from_row)
        .collect()
    }

    async fn attempts(&self, id: Uuid) -> Result<Vec<Attempt>> {
        sqlx::query(
            "SELECT attempt_id, number, epoch, worker, started_at, finished_at, outcome, http_status, \
             error_category, latency_ms, provider_request_id FROM attempts WHERE operation_id = $1 \
             ORDER BY number",
        )
        .bind(id.to_string())
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(attempt_from_row)
        .collect()
    }

    async fn ids_between(&self, low: Uuid, high: Uuid, limit: i64) -> Result<Vec<Uuid>> {
        // Ids are stored as lowercase hyphenated text, which sorts as the bytes do.
        sqlx::query_scalar::<_, String>(
            "SELECT operation_id FROM operations WHERE operation_id BETWEEN $1 AND $2 \
             ORDER BY operation_id LIMIT $3",
        )
        .bind(low.to_string())
        .bind(high.to_string())
        .bind(limit)
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(|s| Uuid::parse_str(s).map_err(|_| corrupt("operation_id", s)))
        .collect()
    }

    async fn results(&self, id: Uuid) -> Result<Vec<ResultRecord>> {
        sqlx::query(RESULTS_SQL)
            .bind(id.to_string())
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(|r| {
                Ok(ResultRecord {
                    seq: r.try_get("seq")?,
                    status: r.try_get("status")?,
                    created_at: get_ts(r, "created_at")?,
                    published_at: get_ts_opt(r, "published_at")?,
                })
            })
            .collect()
    }

    async fn activity(&self, since: OffsetDateTime) -> Result<Activity> {
        let decisions = sqlx::query(DECISIONS_SQL)
            .bind(ts(since))
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(|r| {
                Ok(DecisionCount {
                    decision: r.try_get("decision")?,
                    reason: r.try_get("reason")?,
                    count: r.try_get("n")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let unknown_entered: i64 = sqlx::query_scalar(&unknown_entered_sql())
            .bind(ts(since))
            .fetch_one(&self.reader)
            .await?;
        let unknown_exits = sqlx::query(&unknown_exits_sql())
            .bind(ts(since))
            .bind(ACTIVITY_EXITS_MAX)
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(|r| {
                let detail = r
                    .try_get::<Option<String>, _>("detail")?
                    .map(|d| serde_json::from_str::<Value>(&d))
                    .transpose()
                    .map_err(|e| Error::Corrupt(format!("event detail: {e}")))?;
                Ok(UnknownExit {
                    to: r.try_get("to_status")?,
                    by_person: r.try_get("by_person")?,
                    waited_ms: waited_ms(detail.as_ref()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let now: String = sqlx::query_scalar("SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now')")
            .fetch_one(&self.reader)
            .await?;
        let now = parse_ts(&now)?;
        Ok(Activity {
            since,
            now,
            decisions,
            unknown_entered,
            unknown_exits,
        })
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page> {
        let limit = page_size(filter);
        let cursor = parse_cursor(filter)?;
        let (sql, binds) = list_sql(filter, cursor);
        let sql = sql.replace("{columns}", OP_COLUMNS);
        let mut q = sqlx::query(&sql);
        for bind in binds {
            q = match bind {
                ListBind::Text(t) => q.bind(t),
                ListBind::Cursor(c) => q.bind(c.to_string()),
            };
        }
        let rows = q.bind(limit as i64 + 1).fetch_all(&self.reader).await?;
        let operations = rows.iter().map(op_from_row).collect::<Result<Vec<_>>>()?;
        Ok(paginate(operations, limit))
    }

    async fn reap(&self, retention: Duration) -> Result<ReapStats> {
        in_tx!(self, |tx| {
            let now = tx.now().await?;
            let cutoff = ts(now - time::Duration::milliseconds(millis(retention)));
            let inbox = sqlx::query("DELETE FROM inbox WHERE received_at < $1")
                .bind(&cutoff)
                .execute(&mut *tx.0)
                .await?
                .rows_affected();
            let results = sqlx::query("DELETE FROM result_outbox WHERE published_at < $1")
                .bind(&cutoff)
                .execute(&mut *tx.0)
                .await?
                .rows_affected();
            ReapStats { inbox, results }
        })
    }

    async fn stats(&self) -> Result<LedgerStats> {
        let live = sqlx::query(&live_sql("operations"))
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(|r| {
                Ok(LiveCount {
                    tool: r.try_get("tool")?,
                    class: r.try_get("side_effect_class")?,
                    status: r.try_get("status")?,
                    count: r.try_get("n")?,
                    oldest_change: get_ts(r, "oldest")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let queue = sqlx::query_as::<_, (String, i64)>(QUEUE_DEPTH_SQL)
            .fetch_all(&self.reader)
            .await?;
        let (relay_pending, relay_oldest, now) =
            sqlx::query_as::<_, (i64, Option<String>, String)>(
                "SELECT COUNT(*), MIN(created_at), strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             FROM result_outbox WHERE published_at IS NULL",
            )
            .fetch_one(&self.reader)
            .await?;
        Ok(LedgerStats {
            live,
            queue,
            relay_pending,
            // Its relay reads the unpublished rows through an index of them.
            relay_window: relay_pending,
            relay_oldest: relay_oldest.as_deref().map(parse_ts).transpose()?,
            now: parse_ts(&now)?,
        })
    }

    async fn schema_status(&self) -> Result<SchemaStatus> {
        let found: Option<i64> = match sqlx::query_scalar(schema::APPLIED_VERSION)
            .fetch_one(&self.writer)
            .await
        {
            Ok(v) => v,
            Err(sqlx::Error::Database(db)) if db.message().contains("no such table") => None,
            Err(e) => return Err(e.into()),
        };
        Ok(SchemaStatus::new(found, &schema::SQLITE))
    }

    fn changes(&self) -> Changes {
        // One file, one writer: the process that writes is the one that listens.
        self.signal.subscribe()
    }

    fn claimable_changes(&self) -> Changes {
        self.signal.subscribe_claimable()
    }
}
