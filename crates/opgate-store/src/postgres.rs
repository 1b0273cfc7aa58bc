//! The PostgreSQL ledger: row locks, `FOR UPDATE SKIP LOCKED`, the database clock.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use opgate_core::{Entity, ErrorInfo, IngestItem, Operation, SideEffectClass, Status};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Postgres, Row, Transaction};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::common::{
    DECISIONS_SQL, ListBind, QUEUE_DEPTH_SQL, RESULTS_SQL, corrupt, in_order_prefix, list_sql,
    live_sql, millis, page_size, paginate, parse_cursor, source_columns, unknown_entered_sql,
    unknown_exits_sql, waited_ms,
};
use crate::flow::{
    self, GUARD_IGNORES, GuardProbe, InboxRow, NewAttempt, NewEvent, NewInbox, NewOutbox, Rows, Tx,
    write_rows_in_turn,
};
use crate::schema::{self, SchemaStatus};
use crate::signal::{Changes, Signal};
use crate::types::*;
use crate::{Error, Ledger, Result};

/// A ledger on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    changes: Arc<PgChanges>,
}

impl PgLedger {
    /// Connects (does not migrate).
    pub async fn connect(url: &str) -> Result<Self> {
        let options: PgConnectOptions = url.parse()?;
        Self::connect_with(options).await
    }

    /// Connects with explicit options (e.g. a `search_path` per test schema).
    pub async fn connect_with(options: PgConnectOptions) -> Result<Self> {
        // One connection first: a refused connection, an unknown database or a bad
        // password is reported at once and as itself, not as the pool's timeout 10 s later.
        sqlx::Connection::close(
            tokio::time::timeout(
                Duration::from_secs(10),
                <sqlx::PgConnection as sqlx::Connection>::connect_with(&options),
            )
            .await
            .map_err(|_| Error::Database(sqlx::Error::PoolTimedOut))??,
        )
        .await?;
        // Four connections are kept open (the hot path runs about four transactions at
        // once: an ingest group, a claim, a record, a relay turn), so the first ones
        // after a start, or after an idle spell, do not wait on a connect (the operations
        // dispatched in a run's first 200 ms were the slowest; with this, fewer were slow
        // on one machine, within the noise on another: BENCHMARKS.md, 2026-12-05).
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .min_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        // One channel per schema: deployments sharing a database do not wake each other.
        let schema: String = sqlx::query_scalar("SELECT COALESCE(current_schema(), '')")
            .fetch_one(&pool)
            .await?;
        Ok(Self {
            changes: Arc::new(PgChanges::new(format!("opgate_changes_{schema}"))),
            pool,
        })
    }

    /// Applies pending migrations.
    pub async fn migrate(&self) -> Result<()> {
        schema::POSTGRES.run(&self.pool).await?;
        Ok(())
    }

    /// The connection pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn begin(&self) -> Result<PgTx> {
        Ok(PgTx(self.pool.begin().await?, Prelude::default()))
    }
}

/// Runs `$body` (an expression using `$tx`) in a transaction, committing on success and
/// retrying the whole transaction on transient conflicts.
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
/// it sends a `NOTIFY` (other processes' listeners receive it on commit), and this
/// process's workers are woken once it committed.
macro_rules! write_tx {
    ($self:ident, |$tx:ident| $body:expr) => {
        write_tx!($self, Error::is_transient, |$tx| $body)
    };
    ($self:ident, $retry_when:expr, |$tx:ident| $body:expr) => {{
        let out = in_tx!($self, $retry_when, |$tx| {
            $tx.1.notify = Some($self.changes.clone());
            let out = $body;
            $tx.announce().await?;
            (out, !$tx.1.nothing_claimable)
        });
        out.map(|(out, claimable)| {
            $self.changes.signal.commit(claimable);
            out
        })
    }};
}

struct PgTx(Transaction<'static, Postgres>, Prelude);

/// What a transaction asks of the server besides its statements. Each is sent with the
/// transaction's first clock read ([`Tx::now`], which every flow begins with), one round
/// trip fewer each; whatever is still pending then is sent on its own.
#[derive(Default)]
struct Prelude {
    /// A write transaction's `NOTIFY` to the other processes' listeners (delivered at
    /// commit, wherever in the transaction it is sent).
    notify: Option<Arc<PgChanges>>,
    /// Planner settings for the rest of the transaction.
    planner: Planner,
    /// The longest a statement of the transaction may wait for a lock (`lock_timeout`).
    lock_wait: Option<Duration>,
    /// Its commit need not wake this process's dispatcher ([`Tx::leaves_nothing_claimable`]).
    nothing_claimable: bool,
}

/// Planner settings a hot-path transaction runs with (`set_config(..., true)`, as `SET
/// LOCAL`: they end with the transaction).
#[derive(Default, Clone, Copy)]
enum Planner {
    /// The server's settings.
    #[default]
    Default,
    /// Ingest and record: every statement reads by key, so no sequential scans
    /// (`enable_seqscan = off`). sqlx prepares each statement once per connection, and
    /// after five runs PostgreSQL may keep a generic plan for it; one made while a table
    /// was empty by its statistics (a fresh or freshly analyzed queue, `attempts`) scanned
    /// that table whole for every row of every later batch (BENCHMARKS.md, P4 at 5M).
    Keyed,
    /// A claim: as `Keyed`, and no sort (`enable_sort = off`), which leaves the ordered
    /// walk of `dispatch_queue_ready` that stops at the claim's limit.
    Claim,
}

// Both hot-path settings also switch JIT compilation off (`jit = off`). These statements
// read a handful of rows by key, where compiling never pays, yet their estimates can
// cross `jit_above_cost` (100,000): EXPLAIN here priced the claim's ordered walk of the
// queue at ~295,000 before its LIMIT cut it down, and a path the settings disable is
// priced at 1e10 rather than removed.
//
// And both run generic plans only (`plan_cache_mode = force_generic_plan`). Under the
// default (`auto`) the server plans a prepared statement anew for its first five runs and
// then whenever a custom plan looks cheaper than the generic one, which for the
// statements over id arrays (`= ANY($1)`, `unnest(...)`) is most runs, because each
// array's length changes the estimate: two runs of `bench e2e --rate 1000` made 5,905
// and 6,629 plans and spent 1.3 and 1.5 s planning against 14-15 s executing
// (`pg_stat_statements` with `track_planning`), against 860-1,004 plans and 0.2 s with
// this setting (BENCHMARKS.md, 2026-12-04). The generic plan is the one these statements
// want anyway: with sequential scans off every one of them reads its rows by key.

impl Planner {
    /// The `set_config` calls that apply it.
    fn settings(self) -> &'static str {
        match self {
            Self::Default => "",
            Self::Keyed => {
                ", set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true), \
                 set_config('plan_cache_mode', 'force_generic_plan', true)"
            }
            Self::Claim => {
                ", set_config('enable_seqscan', 'off', true), set_config('enable_sort', 'off', true), \
                 set_config('jit', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)"
            }
        }
    }
}

impl PgTx {
    /// Plans the rest of the transaction with these settings, in a round trip of its own
    /// (for reads that do not begin with the clock read that carries them, [`Tx::now`]).
    async fn plan_as(&mut self, planner: Planner) -> Result<()> {
        sqlx::query(&format!("SELECT NULL{}", planner.settings()))
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// Tells the other processes' listeners, on commit, that the ledger changed, unless
    /// the transaction's clock read did already.
    async fn announce(&mut self) -> Result<()> {
        if let Some(changes) = self.1.notify.take() {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(&changes.channel)
                .bind(&changes.instance)
                .execute(&mut *self.0)
                .await?;
        }
        Ok(())
    }

    /// Takes the relay's turn: one transaction at a time on the database may take result
    /// rows (a transaction-scoped advisory lock, tried, never waited for; `None` if another
    /// holds it). The turn ends with the transaction, and a transaction that idles longer
    /// than `lease` (a relay hung in its publish) is ended by the server, so its turn
    /// and its rows pass to another relay after the lease, as a written lease would.
    ///
    /// Serializing the relays replaces locking each row (`FOR UPDATE SKIP LOCKED`, a
    /// row version written per result row and a second statement to keep each
    /// operation's rows in order); the others stand by. One relay kept up with the
    /// dispatch path in the benchmarks and fell behind by a few seconds only in an
    /// ingest burst (BENCHMARKS.md, "Session of 2026-12-02").
    ///
    /// With the turn comes the highest result id handed out so far, read before anything
    /// else in the transaction: the next fence of the relay floor
    /// ([`PgTx::raise_relay_floor`]). The turn's reads walk the primary key from the
    /// floor, so the turn plans as the hot path does ([`Planner::Keyed`]: no sequential
    /// scans, no JIT, generic plans). With it too, the floor as it stands, for what a turn
    /// that takes nothing does ([`idle_floor`]).
    async fn take_relay_turn(&mut self, lease: Duration) -> Result<Option<RelayTurn>> {
        let sql = format!(
            "SELECT pg_try_advisory_xact_lock($2, 0), h.handed_out, {FENCE_PASSED}, \
               f.floor, f.fence_id \
             FROM (SELECT set_config('idle_in_transaction_session_timeout', $1, true){}) AS p \
             CROSS JOIN (SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END \
               AS handed_out FROM result_outbox_id_seq) AS h \
             LEFT JOIN result_relay_floor AS f ON true",
            Planner::Keyed.settings()
        );
        let (turn, handed_out, passed, floor, fence_id): (
            bool,
            i64,
            bool,
            Option<i64>,
            Option<i64>,
        ) = sqlx::query_as(&sql)
            .bind(millis(lease).clamp(1, i64::from(i32::MAX)).to_string())
            .bind(RELAY_TURN)
            .fetch_one(&mut *self.0)
            .await?;
        Ok(turn.then_some(RelayTurn {
            handed_out,
            idle: idle_floor(passed, floor, fence_id, handed_out),
        }))
    }

    /// Raises the relay floor (migration 0010): every result row below
    /// `result_relay_floor.floor` is published and no running transaction can still
    /// commit one there, so the relay's reads start at the floor rather than at an index
    /// naming `published_at` (whose every mark would rewrite each of the table's indexes).
    ///
    /// The floor can pass only ids whose writers have all ended. The fence stored by an
    /// earlier turn says which: `fence_id`, the highest id handed out when that turn began,
    /// and `fence_xid`, that turn's own transaction id, taken after it. A writer takes its
    /// xid before its first result id (migration 0011: a trigger on every insert), so every writer
    /// holding an id up to `fence_id` has an xid below `fence_xid`; once the oldest running
    /// transaction is no older than `fence_xid`, they have all committed or rolled back, and
    /// this statement's snapshot sees every row up to the fence that will ever exist. The
    /// floor then moves to the lowest unpublished id up to the fence (a row this relay
    /// only leased, or another relay's lease, or one that failed to publish, holds it), or
    /// just past the fence; and this turn's fence replaces the old one. A fence not yet
    /// passed stays, and the floor with it; one from the future (a dump restored into
    /// another server, whose xids start lower) is replaced, the floor left where it is.
    /// Called by a turn that took rows, after they are marked or leased, and by one that
    /// took nothing when ids were handed out past a passed fence ([`idle_floor`]), with
    /// what [`PgTx::take_relay_turn`] read; the turn's own transaction id becomes the new
    /// fence's.
    async fn raise_relay_floor(&mut self, handed_out: i64) -> Result<()> {
        const RENEW: &str = "(f.fence_xid IS NULL OR f.fence_xid > pg_current_xact_id())";
        sqlx::query(&format!(
            "UPDATE result_relay_floor AS f SET \
               floor = CASE WHEN {FENCE_PASSED} THEN {FLOOR_PAST_FENCE} ELSE f.floor END, \
               fence_id = CASE WHEN {FENCE_PASSED} OR {RENEW} THEN $1 ELSE f.fence_id END, \
               fence_xid = CASE WHEN {FENCE_PASSED} OR {RENEW} THEN pg_current_xact_id() \
                 ELSE f.fence_xid END"
        ))
        .bind(handed_out)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// A turn that took nothing brings the floor up to the stored fence once it has
    /// passed ([`PgTx::raise_relay_floor`]'s rule; no new fence, which would take an
    /// xid). Without it a floor held back by a long transaction stayed put after that
    /// transaction ended until traffic came back, and every idle round read the whole
    /// window. Called only when the turn found it due ([`IdleFloor::Close`]), so an idle
    /// round costs no statement more; writes only when the floor moves (a row
    /// leased by another relay at the floor keeps it, and the update then changes no row
    /// and takes no xid).
    async fn close_relay_window(&mut self) -> Result<()> {
        sqlx::query(&format!(
            "UPDATE result_relay_floor AS f SET floor = {FLOOR_PAST_FENCE} \
             WHERE {FENCE_PASSED} AND f.floor <= f.fence_id AND {FLOOR_PAST_FENCE} > f.floor"
        ))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    /// The result rows a relay may take now (the caller holds the relay's turn):
    /// unpublished, oldest first, up to `limit`, leaving out rows leased by
    /// [`Ledger::claim_results`] and every later row of their operations
    /// (`common::in_order_prefix`), so no relay publishes a later state before an earlier
    /// one. An operation's earlier rows have lower ids and were committed before its
    /// later ones were written, so one read in id order sees all that precede a row.
    async fn pick_results(&mut self, limit: usize) -> Result<Vec<OutboxRow>> {
        let rows = sqlx::query(&format!(
            "SELECT id, operation_id, seq, status, kafka_key, payload::text AS payload, \
             traceparent, \
             COALESCE(claimed_until >= now(), false) AS leased \
             FROM result_outbox {UNPUBLISHED} ORDER BY id LIMIT $1"
        ))
        .bind(limit as i64)
        .fetch_all(&mut *self.0)
        .await?;
        let mut taken = Vec::with_capacity(rows.len());
        let mut candidates = Vec::with_capacity(rows.len());
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            let out = OutboxRow {
                id: row.try_get("id")?,
                operation_id: row.try_get("operation_id")?,
                seq: row.try_get("seq")?,
                status: row.try_get("status")?,
                kafka_key: row.try_get("kafka_key")?,
                payload: row.try_get("payload")?,
                traceparent: row.try_get("traceparent")?,
            };
            if let Some(op) = out.operation_id {
                pending.push((op, out.id));
            }
            if !row.try_get::<bool, _>("leased")? {
                candidates.push((out.id, out.operation_id));
            }
            taken.push(out);
        }
        let keep: HashSet<i64> = in_order_prefix(&candidates, &pending).into_iter().collect();
        taken.retain(|row| keep.contains(&row.id));
        Ok(taken)
    }

    /// Operations by id, with a trailing clause (ordering and [`LOCK_STATE`]).
    async fn select_operations(
        &mut self,
        ids: &[Uuid],
        clause: &str,
    ) -> Result<HashMap<Uuid, Operation>> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let rows = sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} WHERE operation_id = ANY($1) {clause}"
        ))
        .bind(ids)
        .fetch_all(&mut *self.0)
        .await?;
        rows.iter()
            .map(|row| op_from_row(row).map(|op| (op.operation_id, op)))
            .collect()
    }

    /// One operation by id, with a locking clause (`""` or [`LOCK_STATE`], `SKIP LOCKED`
    /// or not).
    async fn select_operation(&mut self, id: Uuid, locking: &str) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} WHERE operation_id = $1 {locking}"
        ))
        .bind(id)
        .fetch_optional(&mut *self.0)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }
}

/// The two tables of an operation (migration 0009): `operation_identity`, written once
/// at ingest, and `operation_state`, which every transition updates (a narrow row whose
/// updates rewrite only the indexes that name its state). The `operations` view joins
/// them for readers; the flows read them directly, so that a lock takes the state row
/// alone ([`LOCK_STATE`]): locking the identity row too would write a lock into it. The
/// state row's copies of the tool and class (held equal by a foreign key) merge with the
/// identity's in the join.
const OP_TABLES: &str =
    "operation_identity JOIN operation_state USING (operation_id, tool, side_effect_class)";

/// The locking clause of a read that is about to change an operation's state.
const LOCK_STATE: &str = "FOR UPDATE OF operation_state";

const OP_COLUMNS: &str = "operation_id, namespace, idempotency_key, key_components, args_fingerprint, \
    event_id, agent_id, workflow_id, run_id, step, tool, intent, entity_type, entity_id, entity_key, \
    canonical_args, side_effect_class, status, attempt_count, first_attempt_at, next_attempt_at, \
    unknown_since, lease_owner, lease_expires_at, lease_epoch, external_request_id, \
    external_object_id, result, error, compensates, traceparent, result_seq, created_at, updated_at, \
    ambiguous_since";

fn op_from_row(row: &PgRow) -> Result<Operation> {
    let class: String = row.try_get("side_effect_class")?;
    let status: String = row.try_get("status")?;
    Ok(Operation {
        operation_id: row.try_get("operation_id")?,
        namespace: row.try_get("namespace")?,
        idempotency_key: row.try_get("idempotency_key")?,
        key_components: row.try_get::<Json<Value>, _>("key_components")?.0,
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
        canonical_args: row.try_get::<Json<Value>, _>("canonical_args")?.0,
        side_effect_class: SideEffectClass::parse(&class)
            .ok_or_else(|| corrupt("side_effect_class", &class))?,
        status: Status::parse(&status).ok_or_else(|| corrupt("status", &status))?,
        attempt_count: row.try_get::<i32, _>("attempt_count")? as u32,
        first_attempt_at: row.try_get("first_attempt_at")?,
        next_attempt_at: row.try_get("next_attempt_at")?,
        unknown_since: row.try_get("unknown_since")?,
        ambiguous_since: row.try_get("ambiguous_since")?,
        lease_owner: row.try_get("lease_owner")?,
        lease_expires_at: row.try_get("lease_expires_at")?,
        lease_epoch: row.try_get("lease_epoch")?,
        external_request_id: row.try_get("external_request_id")?,
        external_object_id: row.try_get("external_object_id")?,
        result: row
            .try_get::<Option<Json<Value>>, _>("result")?
            .map(|j| j.0),
        error: row
            .try_get::<Option<Json<ErrorInfo>>, _>("error")?
            .map(|j| j.0),
        compensates: row.try_get("compensates")?,
        traceparent: row.try_get("traceparent")?,
        result_seq: row.try_get("result_seq")?,
        created_at: row.try_get("created_at")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// A query on a transaction's connection, for the functions that bind its arrays.
type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// One bound array per column: the batched statements read their rows with `unnest`,
/// one statement text per kind of row whatever the batch's length. (A `VALUES` list
/// was a new statement per length: planned every time — 585 ms of planning over 31
/// calls of the largest operations insert in one 20,000-operation run, BENCHMARKS.md —
/// and prepared by sqlx in a round trip of its own.)
fn column<'a, R, T>(rows: &'a [R], f: impl Fn(&'a R) -> T) -> Vec<T> {
    rows.iter().map(f).collect()
}

/// The columns an operation is created with and never changes, with the SQL type of
/// each one's array, in the order [`bind_op_identity`] binds them.
const OP_IDENTITY: [(&str, &str); 20] = [
    ("operation_id", "uuid"),
    ("namespace", "text"),
    ("idempotency_key", "text"),
    ("key_components", "jsonb"),
    ("args_fingerprint", "text"),
    ("event_id", "text"),
    ("agent_id", "text"),
    ("workflow_id", "text"),
    ("run_id", "text"),
    ("step", "int8"),
    ("tool", "text"),
    ("intent", "text"),
    ("entity_type", "text"),
    ("entity_id", "text"),
    ("entity_key", "text"),
    ("canonical_args", "jsonb"),
    ("side_effect_class", "text"),
    ("compensates", "uuid"),
    ("traceparent", "text"),
    ("created_at", "timestamptz"),
];

/// The columns a transition writes, in the order [`bind_op_state`] binds them.
const OP_STATE: [(&str, &str); 15] = [
    ("status", "text"),
    ("attempt_count", "int4"),
    ("first_attempt_at", "timestamptz"),
    ("next_attempt_at", "timestamptz"),
    ("unknown_since", "timestamptz"),
    ("lease_owner", "text"),
    ("lease_expires_at", "timestamptz"),
    ("lease_epoch", "int8"),
    ("external_request_id", "text"),
    ("external_object_id", "text"),
    ("result", "jsonb"),
    ("error", "jsonb"),
    ("result_seq", "int8"),
    ("updated_at", "timestamptz"),
    ("ambiguous_since", "timestamptz"),
];

/// `unnest($1::t1[], $2::t2[], ...)` over these columns.
fn unnest_sql<'c>(columns: impl Iterator<Item = &'c (&'c str, &'c str)>) -> String {
    let types: Vec<&str> = columns.map(|(_, ty)| *ty).collect();
    unnest_at(1, &types)
}

/// `unnest($first::t1[], ...)` over arrays of these types, numbered from `$first` (a type
/// may carry a cast of its array after it: `text[]::json` reads text as `json[]`).
fn unnest_at(first: usize, types: &[&str]) -> String {
    let arrays: Vec<String> = types
        .iter()
        .enumerate()
        .map(|(i, ty)| format!("${}::{ty}[]", first + i))
        .collect();
    format!("unnest({})", arrays.join(", "))
}

/// Inserts operations ([`bind_op_identity`], then [`bind_op_state`]), each unless its
/// (namespace, key) exists, in one statement: the identity row, then the state row of
/// each identity inserted. The state row's `exclusive_entity` (the key of the
/// one-write-in-flight index) is the identity's generated `holds` (migration 0009: the
/// entity key of a write that is not a compensation, '' otherwise), and it copies the
/// tool and class (for the live gauges), all held to the identity by a foreign key.
/// Returns the ids inserted.
static INSERT_OPERATIONS: LazyLock<String> = LazyLock::new(|| {
    let identity: Vec<&str> = OP_IDENTITY.iter().map(|(name, _)| *name).collect();
    let state: Vec<&str> = OP_STATE.iter().map(|(name, _)| *name).collect();
    let state_values: Vec<String> = state.iter().map(|name| format!("v.{name}")).collect();
    let all = [identity.as_slice(), state.as_slice()].concat();
    let identity = identity.join(", ");
    format!(
        "WITH v AS (SELECT * FROM {} AS u({})), \
         ins AS (INSERT INTO operation_identity ({identity}) SELECT {identity} FROM v \
           ON CONFLICT (namespace, idempotency_key) DO NOTHING \
           RETURNING operation_id, holds, tool, side_effect_class) \
         INSERT INTO operation_state \
           (operation_id, exclusive_entity, tool, side_effect_class, {}) \
         SELECT ins.operation_id, ins.holds, ins.tool, ins.side_effect_class, {} \
         FROM ins JOIN v ON v.operation_id = ins.operation_id \
         RETURNING operation_id",
        unnest_sql(OP_IDENTITY.iter().chain(&OP_STATE)),
        all.join(", "),
        state.join(", "),
        state_values.join(", ")
    )
});

/// Writes operations' state: their ids, then [`bind_op_state`], numbered from `$first`.
fn update_operations_at(first: usize) -> String {
    let id = [("operation_id", "uuid")];
    let columns = || id.iter().chain(&OP_STATE);
    let names: Vec<&str> = columns().map(|(name, _)| *name).collect();
    let types: Vec<&str> = columns().map(|(_, ty)| *ty).collect();
    let sets: Vec<String> = OP_STATE
        .iter()
        .map(|(name, _)| format!("{name} = v.{name}"))
        .collect();
    format!(
        "UPDATE operation_state AS o SET {} FROM {} AS v({}) WHERE o.operation_id = v.operation_id",
        sets.join(", "),
        unnest_at(first, &types),
        names.join(", ")
    )
}

/// Binds operations' ids and state ([`update_operations_at`]).
fn bind_operations<'q>(query: PgQuery<'q>, ops: &'q [Operation]) -> PgQuery<'q> {
    bind_op_state(query.bind(column(ops, |op| op.operation_id)), ops)
}

/// Binds [`OP_IDENTITY`]'s arrays.
fn bind_op_identity<'q>(query: PgQuery<'q>, ops: &'q [Operation]) -> PgQuery<'q> {
    query
        .bind(column(ops, |o| o.operation_id))
        .bind(column(ops, |o| o.namespace.as_str()))
        .bind(column(ops, |o| o.idempotency_key.as_str()))
        .bind(column(ops, |o| Json(&o.key_components)))
        .bind(column(ops, |o| o.args_fingerprint.as_str()))
        .bind(column(ops, |o| o.event_id.as_str()))
        .bind(column(ops, |o| o.agent_id.as_deref()))
        .bind(column(ops, |o| o.workflow_id.as_deref()))
        .bind(column(ops, |o| o.run_id.as_deref()))
        .bind(column(ops, |o| o.step.map(|s| s as i64)))
        .bind(column(ops, |o| o.tool.as_str()))
        .bind(column(ops, |o| o.intent.as_deref()))
        .bind(column(ops, |o| o.entity.kind.as_str()))
        .bind(column(ops, |o| o.entity.id.as_str()))
        .bind(column(ops, |o| o.entity_key.as_str()))
        .bind(column(ops, |o| Json(&o.canonical_args)))
        .bind(column(ops, |o| o.side_effect_class.as_str()))
        .bind(column(ops, |o| o.compensates))
        .bind(column(ops, |o| o.traceparent.as_deref()))
        .bind(column(ops, |o| o.created_at))
}

/// Binds [`OP_STATE`]'s arrays (the insert and the transition update share it).
fn bind_op_state<'q>(query: PgQuery<'q>, ops: &'q [Operation]) -> PgQuery<'q> {
    query
        .bind(column(ops, |o| o.status.as_str()))
        .bind(column(ops, |o| o.attempt_count as i32))
        .bind(column(ops, |o| o.first_attempt_at))
        .bind(column(ops, |o| o.next_attempt_at))
        .bind(column(ops, |o| o.unknown_since))
        .bind(column(ops, |o| o.lease_owner.as_deref()))
        .bind(column(ops, |o| o.lease_expires_at))
        .bind(column(ops, |o| o.lease_epoch))
        .bind(column(ops, |o| o.external_request_id.as_deref()))
        .bind(column(ops, |o| o.external_object_id.as_deref()))
        .bind(column(ops, |o| o.result.as_ref().map(Json)))
        .bind(column(ops, |o| o.error.as_ref().map(Json)))
        .bind(column(ops, |o| o.result_seq))
        .bind(column(ops, |o| o.updated_at))
        .bind(column(ops, |o| o.ambiguous_since))
}

/// A relay's turn ([`PgTx::take_relay_turn`]).
struct RelayTurn {
    /// The highest result id handed out when the turn began: the next fence.
    handed_out: i64,
    /// What the turn does for the floor if it takes nothing.
    idle: IdleFloor,
}

impl RelayTurn {
    /// What a turn that took nothing does for the floor.
    async fn idle(&self, tx: &mut PgTx) -> Result<()> {
        match self.idle {
            IdleFloor::Raise => tx.raise_relay_floor(self.handed_out).await,
            IdleFloor::Close => tx.close_relay_window().await,
            IdleFloor::Keep => Ok(()),
        }
    }
}

/// What a relay turn that takes nothing does for the floor ([`idle_floor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdleFloor {
    /// Nothing: no fence has passed, or the floor is past it and no id was handed out since.
    Keep,
    /// Bring the floor up to the passed fence ([`PgTx::close_relay_window`]).
    Close,
    /// Store a new fence as a turn that took rows does ([`PgTx::raise_relay_floor`]).
    Raise,
}

/// The idle turn's rule, from what the turn read: whether the stored fence has passed, the
/// floor and the fence's id (none before migration 0010's row), and the highest id handed
/// out. A passed fence with ids handed out after it (the last rounds that took rows kept a
/// fence they could not pass yet, or took rows committed after their turn began) gets a
/// new fence, so the window can close once traffic stops; a passed fence the floor is still
/// below brings the floor up to it.
fn idle_floor(
    passed: bool,
    floor: Option<i64>,
    fence_id: Option<i64>,
    handed_out: i64,
) -> IdleFloor {
    match (passed, floor, fence_id) {
        (true, Some(_), Some(fence)) if fence < handed_out => IdleFloor::Raise,
        (true, Some(floor), Some(fence)) if floor <= fence => IdleFloor::Close,
        _ => IdleFloor::Keep,
    }
}

/// The stored fence of the relay floor has passed: no transaction older than its xid still
/// runs ([`PgTx::raise_relay_floor`]). Read from the row being updated, as
/// [`FLOOR_PAST_FENCE`] is (no second read of the table that could pair another version's
/// fence with this one's).
const FENCE_PASSED: &str = "(f.fence_xid IS NOT NULL \
    AND f.fence_xid <= pg_snapshot_xmin(pg_current_snapshot()))";

/// Where the floor goes once its fence has passed: to the lowest unpublished id up to the
/// fence, or just past the fence.
const FLOOR_PAST_FENCE: &str = "GREATEST(f.floor, COALESCE( \
    (SELECT min(r.id) FROM result_outbox r \
     WHERE r.id >= f.floor AND r.id <= f.fence_id AND r.published_at IS NULL), \
    f.fence_id + 1))";

/// The unpublished result rows: at or above the relay floor ([`PgTx::raise_relay_floor`]);
/// without its row (never after migration 0010), from the first id, slowly but whole.
const UNPUBLISHED: &str =
    "WHERE id >= COALESCE((SELECT floor FROM result_relay_floor), 0) AND published_at IS NULL";

/// The start of an outbox insert, of rows [`OUTBOX_TYPES`] bound by [`bind_outbox`].
const PUT_OUTBOX: &str = "INSERT INTO result_outbox (operation_id, seq, status, kafka_key, \
    payload, traceparent, created_at)";
const OUTBOX_TYPES: [&str; 7] = [
    "uuid",
    "int8",
    "text",
    "text",
    "text[]::json",
    "text",
    "timestamptz",
];

/// The start of a history insert, of rows [`EVENT_TYPES`] bound by [`bind_events`].
const INSERT_EVENTS: &str = "INSERT INTO operation_events (operation_id, from_status, \
    to_status, reason, attempt_id, epoch, actor, at, detail)";
const EVENT_TYPES: [&str; 9] = [
    "uuid",
    "text",
    "text",
    "text",
    "uuid",
    "int8",
    "text",
    "timestamptz",
    "jsonb",
];

/// The start of a queue-row upsert, of rows [`QUEUE_TYPES`] bound by [`bind_queue`],
/// ended by [`QUEUE_UPSERT`].
const PUT_QUEUE: &str = "INSERT INTO dispatch_queue (operation_id, entity_key, is_read, \
    compensates, state, ready_at, tool)";
const QUEUE_TYPES: [&str; 7] = [
    "uuid",
    "text",
    "bool",
    "uuid",
    "text",
    "timestamptz",
    "text",
];
const QUEUE_UPSERT: &str = "ON CONFLICT (operation_id) DO UPDATE SET state = EXCLUDED.state, \
    ready_at = EXCLUDED.ready_at";

/// The start of an attempt insert, of rows [`ATTEMPT_TYPES`] bound by [`bind_attempts`].
const INSERT_ATTEMPTS: &str =
    "INSERT INTO attempts (attempt_id, operation_id, number, epoch, worker, started_at)";
const ATTEMPT_TYPES: [&str; 6] = ["uuid", "uuid", "int4", "int8", "text", "timestamptz"];

/// The kinds of rows a claim, a record or an ingest writes ([`Rows`]), in the order one
/// statement writes them ([`rows_sql`]). Each kind has one statement text, used on its own
/// and as a part of the combined statement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Attempts,
    Events,
    /// Queue rows of finished operations: deleted.
    Done,
    /// Queue rows inserted or updated.
    Queue,
    /// Result rows, each with the next id of `result_outbox_id_seq`, drawn after the
    /// transaction has its xid (migration 0011's statement trigger fires before the part
    /// draws one, in the combined statement too).
    Outbox,
    Operations,
    /// Attempts that ended.
    Finished,
}

const PARTS: [Part; 7] = [
    Part::Attempts,
    Part::Events,
    Part::Done,
    Part::Queue,
    Part::Outbox,
    Part::Operations,
    Part::Finished,
];

impl Part {
    /// Its bit in a set of parts ([`rows_sql`]).
    fn bit(self) -> usize {
        1 << self as usize
    }

    /// How many parameters its statement binds.
    fn params(self) -> usize {
        match self {
            Part::Attempts => ATTEMPT_TYPES.len(),
            Part::Events => EVENT_TYPES.len(),
            Part::Done => 1,
            Part::Queue => QUEUE_TYPES.len(),
            Part::Outbox => OUTBOX_TYPES.len(),
            Part::Operations => 1 + OP_STATE.len(),
            // The arrays, then when the attempts ended.
            Part::Finished => 8,
        }
    }

    /// Its statement, parameters numbered from `$first`.
    fn sql(self, first: usize) -> String {
        match self {
            Part::Attempts => format!(
                "{INSERT_ATTEMPTS} SELECT * FROM {}",
                unnest_at(first, &ATTEMPT_TYPES)
            ),
            Part::Events => format!(
                "{INSERT_EVENTS} SELECT * FROM {}",
                unnest_at(first, &EVENT_TYPES)
            ),
            Part::Done => {
                format!("DELETE FROM dispatch_queue WHERE operation_id = ANY(${first}::uuid[])")
            }
            Part::Queue => format!(
                "{PUT_QUEUE} SELECT * FROM {} {QUEUE_UPSERT}",
                unnest_at(first, &QUEUE_TYPES)
            ),
            Part::Outbox => format!(
                "{PUT_OUTBOX} SELECT * FROM {}",
                unnest_at(first, &OUTBOX_TYPES)
            ),
            Part::Operations => update_operations_at(first),
            Part::Finished => format!(
                "UPDATE attempts AS a SET finished_at = ${}, outcome = v.outcome, \
                 http_status = v.http_status, error_category = v.error_category, \
                 latency_ms = v.latency_ms, provider_request_id = v.provider_request_id \
                 FROM {} AS v(attempt_id, operation_id, outcome, http_status, error_category, \
                 latency_ms, provider_request_id) \
                 WHERE a.attempt_id = v.attempt_id AND a.operation_id = v.operation_id",
                first + 7,
                unnest_at(
                    first,
                    &["uuid", "uuid", "text", "int4", "text", "int8", "text"]
                )
            ),
        }
    }

    /// Its statement on its own.
    fn alone(self) -> &'static str {
        rows_sql(self.bit())
    }
}

/// One statement writing the parts in the set `parts` (bits of [`Part::bit`]), each part
/// a data-modifying `WITH` item but the last. Built once per set. The parts touch
/// different rows of different tables, so none needs to see another's writes (they share
/// one snapshot): [`PgTx::write_rows`] writes in turn what does not fit that.
fn rows_sql(parts: usize) -> &'static str {
    static SQL: [OnceLock<String>; 1 << PARTS.len()] =
        [const { OnceLock::new() }; 1 << PARTS.len()];
    SQL[parts].get_or_init(|| {
        let mut first = 1;
        let mut statements = Vec::new();
        for part in PARTS.iter().filter(|part| parts & part.bit() != 0) {
            statements.push(part.sql(first));
            first += part.params();
        }
        let last = statements.pop().unwrap_or_default();
        if statements.is_empty() {
            return last;
        }
        let items: Vec<String> = statements
            .iter()
            .enumerate()
            .map(|(i, sql)| format!("w{i} AS ({sql})"))
            .collect();
        format!("WITH {} {last}", items.join(", "))
    })
}

/// Binds new attempts' arrays ([`ATTEMPT_TYPES`]).
fn bind_attempts<'q, 'a: 'q>(query: PgQuery<'q>, attempts: &'q [NewAttempt<'a>]) -> PgQuery<'q> {
    query
        .bind(column(attempts, |a| a.attempt_id))
        .bind(column(attempts, |a| a.operation_id))
        .bind(column(attempts, |a| a.number as i32))
        .bind(column(attempts, |a| a.epoch))
        .bind(column(attempts, |a| a.worker))
        .bind(column(attempts, |a| a.started_at))
}

/// An attempt that ended: (operation, attempt, what it observed).
type Finished<'r> = (Uuid, Uuid, &'r AttemptReport);

/// Binds ended attempts' arrays and when they ended ([`Part::Finished`]).
fn bind_finished<'q>(
    query: PgQuery<'q>,
    attempts: &'q [Finished<'q>],
    at: OffsetDateTime,
) -> PgQuery<'q> {
    query
        .bind(column(attempts, |(_, attempt, _)| *attempt))
        .bind(column(attempts, |(op, ..)| *op))
        .bind(column(attempts, |(.., r)| r.outcome.as_str()))
        .bind(column(attempts, |(.., r)| r.http_status.map(i32::from)))
        .bind(column(attempts, |(.., r)| r.error_category.as_deref()))
        .bind(column(attempts, |(.., r)| r.latency.map(millis)))
        .bind(column(attempts, |(.., r)| r.provider_request_id.as_deref()))
        .bind(at)
}

/// Binds history rows' arrays ([`EVENT_TYPES`]).
fn bind_events<'q, 'e: 'q>(query: PgQuery<'q>, events: &'q [NewEvent<'e>]) -> PgQuery<'q> {
    query
        .bind(column(events, |e| e.operation_id))
        .bind(column(events, |e| e.from.map(Status::as_str)))
        .bind(column(events, |e| e.to.as_str()))
        .bind(column(events, |e| e.reason))
        .bind(column(events, |e| e.attempt_id))
        .bind(column(events, |e| e.epoch))
        .bind(column(events, |e| e.actor))
        .bind(column(events, |e| e.at))
        .bind(column(events, |e| e.detail.as_ref().map(Json)))
}

/// A queue row as the queue statements bind it: the operation, its queue state and when
/// it is ready.
type QueueRow<'r> = (&'r Operation, QueueState, OffsetDateTime);

/// Binds queue rows' arrays ([`QUEUE_TYPES`]).
fn bind_queue<'q>(query: PgQuery<'q>, rows: &'q [&'q QueueRow<'q>]) -> PgQuery<'q> {
    query
        .bind(column(rows, |(op, ..)| op.operation_id))
        .bind(column(rows, |(op, ..)| op.entity_key.as_str()))
        .bind(column(rows, |(op, ..)| !op.side_effect_class.is_write()))
        .bind(column(rows, |(op, ..)| op.compensates))
        .bind(column(rows, |(_, state, _)| state.as_str()))
        .bind(column(rows, |(.., ready_at)| *ready_at))
        .bind(column(rows, |(op, ..)| op.tool.as_str()))
}

/// Binds result rows' arrays ([`OUTBOX_TYPES`]).
fn bind_outbox<'q>(query: PgQuery<'q>, rows: &'q [NewOutbox]) -> PgQuery<'q> {
    query
        .bind(column(rows, |r| r.operation_id))
        .bind(column(rows, |r| r.seq))
        .bind(column(rows, |r| r.status.as_str()))
        .bind(column(rows, |r| r.kafka_key.as_str()))
        .bind(column(rows, |r| r.payload.as_str()))
        .bind(column(rows, |r| r.traceparent.as_deref()))
        .bind(column(rows, |r| r.at))
}

/// The advisory lock of the relay's turn ([`PgTx::take_relay_turn`]), in the two-key space
/// (`lock_entity` takes single-key locks, so no entity's hash can collide with it).
const RELAY_TURN: i32 = 0x6f67_7274; // "ogrt"

/// A queued row `q` may be claimed: nothing in flight or held on its entity, nothing
/// waiting ahead of it. A compensation passes the operation it undoes (which holds the
/// entity in `compensating`) and the waiting operations queued behind that one: they wait
/// for the original, which waits for its compensation.
///
/// Written so that the only index condition the planner can find is the entity's:
/// `p.state IN (...)` at the top level is `dispatch_queue_entity`'s predicate, and the
/// remaining `OR` has an arm no index serves (`<>`). Written as `inflight/held OR (waiting
/// AND seq < q.seq)` instead, it let the planner, with statistics taken while the queue was
/// empty, serve the second arm from `dispatch_queue_ready` (`seq < q.seq`): every waiting
/// row ahead of the candidate, read once per candidate (6 ms a claim beside 5 million
/// operations; BENCHMARKS.md).
const HEAD_OF_LINE: &str = "(q.is_read OR NOT EXISTS ( \
    SELECT 1 FROM dispatch_queue p \
    WHERE p.entity_key = q.entity_key AND NOT p.is_read \
      AND p.state IN ('waiting', 'inflight', 'held') \
      AND p.operation_id <> q.operation_id \
      AND (q.compensates IS NULL OR p.operation_id <> q.compensates) \
      AND (p.state <> 'waiting' OR (p.seq < q.seq AND q.compensates IS NULL))))";

impl Tx for PgTx {
    fn leaves_nothing_claimable(&mut self) {
        self.1.nothing_claimable = true;
    }

    async fn now(&mut self) -> Result<OffsetDateTime> {
        // clock_timestamp(), not now(): now() is the transaction's start, and time spent
        // waiting on locks must not shorten a lease.
        // The prelude rides along: `pg_notify` is queued until commit, and `set_config`
        // with `is_local` lasts until the transaction ends, as `SET LOCAL` does.
        let notify = self.1.notify.take();
        let planner = std::mem::take(&mut self.1.planner);
        let notify_sql = if notify.is_some() {
            "pg_notify($1, $2)"
        } else {
            "NULL"
        };
        let lock_wait = self.1.lock_wait.take().map_or(String::new(), |wait| {
            format!(
                ", set_config('lock_timeout', '{}', true)",
                millis(wait).max(1)
            )
        });
        let sql = format!(
            "SELECT clock_timestamp() FROM (SELECT {notify_sql}{}{lock_wait}) AS p",
            planner.settings()
        );
        let mut query = sqlx::query_scalar(&sql);
        if let Some(changes) = &notify {
            query = query.bind(&changes.channel).bind(&changes.instance);
        }
        Ok(query.fetch_one(&mut *self.0).await?)
    }

    async fn insert_inbox(&mut self, row: NewInbox<'_>, at: OffsetDateTime) -> Result<bool> {
        let inserted = self.insert_inbox_batch(&[row], at).await?;
        Ok(inserted.first().copied().unwrap_or(false))
    }

    async fn inbox(&mut self, key: &str) -> Result<Option<InboxRow>> {
        Ok(self.inbox_batch(&[key]).await?.remove(key))
    }

    async fn set_inbox(
        &mut self,
        event_id: &str,
        decision: &IngestDecision,
        operation_id: Option<Uuid>,
    ) -> Result<()> {
        self.set_inbox_batch(&[(event_id, decision, operation_id)])
            .await
    }

    async fn insert_operation(&mut self, op: &Operation) -> Result<bool> {
        let inserted = self
            .insert_operations_batch(std::slice::from_ref(op))
            .await?;
        Ok(inserted.first().copied().unwrap_or(false))
    }

    async fn read_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        self.select_operation(id, "").await
    }

    async fn try_lock_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        self.select_operation(id, &format!("{LOCK_STATE} SKIP LOCKED"))
            .await
    }

    async fn lock_operation(&mut self, id: Uuid) -> Result<Option<Operation>> {
        self.select_operation(id, LOCK_STATE).await
    }

    async fn lock_operation_by_key(
        &mut self,
        namespace: &str,
        key: &str,
    ) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} WHERE namespace = $1 AND idempotency_key = $2 {LOCK_STATE}"
        ))
        .bind(namespace)
        .bind(key)
        .fetch_optional(&mut *self.0)
        .await?
        .as_ref()
        .map(op_from_row)
        .transpose()
    }

    async fn lock_entity(&mut self, entity_key: &str) -> Result<()> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(entity_key)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    async fn lock_guarded(&mut self, p: &GuardProbe<'_>) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} \
             WHERE entity_key = $1 AND tool = ANY($2) AND created_at >= $3 \
               AND ($4::text IS NULL OR args_fingerprint = $4) \
               AND NOT (namespace = $5 AND idempotency_key = $6) \
               AND status NOT IN ({ignores}) \
             ORDER BY created_at LIMIT 1 {LOCK_STATE}",
            ignores = *GUARD_IGNORES
        ))
        .bind(p.entity_key)
        .bind(p.tools)
        .bind(p.since)
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
        self.update_operations_batch(std::slice::from_ref(op)).await
    }

    async fn insert_event(&mut self, e: &NewEvent<'_>) -> Result<()> {
        self.insert_events_batch(std::slice::from_ref(e)).await
    }

    async fn insert_attempt(&mut self, a: &NewAttempt<'_>) -> Result<()> {
        self.insert_attempts_batch(std::slice::from_ref(a)).await
    }

    async fn finish_attempt(
        &mut self,
        operation_id: Uuid,
        attempt_id: Uuid,
        r: &AttemptReport,
        at: OffsetDateTime,
    ) -> Result<()> {
        self.finish_attempts_batch(&[(operation_id, attempt_id, r)], at)
            .await
    }

    async fn put_queue(
        &mut self,
        op: &Operation,
        state: QueueState,
        ready_at: OffsetDateTime,
    ) -> Result<()> {
        self.put_queue_rows(&[(op, state, ready_at)]).await
    }

    async fn insert_outbox(&mut self, row: &NewOutbox) -> Result<()> {
        self.insert_outbox_batch(std::slice::from_ref(row)).await
    }

    async fn inbox_batch(&mut self, event_ids: &[&str]) -> Result<HashMap<String, InboxRow>> {
        if event_ids.is_empty() {
            return Ok(HashMap::new());
        }
        /// source_id, decision, reason, operation_id, fingerprint.
        type Row = (String, String, Option<String>, Option<Uuid>, Option<String>);
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT source_id, decision, reason, operation_id, fingerprint FROM inbox \
                 WHERE source_id = ANY($1)",
        )
        .bind(event_ids)
        .fetch_all(&mut *self.0)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, decision, reason, operation_id, fingerprint)| {
                (
                    id,
                    InboxRow {
                        decision,
                        reason,
                        operation_id,
                        fingerprint,
                    },
                )
            })
            .collect())
    }

    async fn read_operations(&mut self, ids: &[Uuid]) -> Result<HashMap<Uuid, Operation>> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} WHERE operation_id = ANY($1)"
        ))
        .bind(ids)
        .fetch_all(&mut *self.0)
        .await?
        .iter()
        .map(|row| op_from_row(row).map(|op| (op.operation_id, op)))
        .collect()
    }

    async fn lock_operations_by_keys(
        &mut self,
        keys: &[(String, String)],
    ) -> Result<HashMap<(String, String), Operation>> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let (namespaces, names): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(n, k)| (n.as_str(), k.as_str())).unzip();
        // Locked in id order, which avoids most lock-order cycles between batches; the
        // rest (with rows the guards lock) end in a deadlock error, and the transaction is
        // re-run like any transient conflict.
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM {OP_TABLES} \
             WHERE (namespace, idempotency_key) IN (SELECT * FROM UNNEST($1::text[], $2::text[])) \
             ORDER BY operation_id {LOCK_STATE}"
        ))
        .bind(namespaces)
        .bind(names)
        .fetch_all(&mut *self.0)
        .await?
        .iter()
        .map(|row| {
            op_from_row(row).map(|op| ((op.namespace.clone(), op.idempotency_key.clone()), op))
        })
        .collect()
    }

    async fn insert_inbox_batch(
        &mut self,
        rows: &[NewInbox<'_>],
        at: OffsetDateTime,
    ) -> Result<Vec<bool>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let sources: Vec<_> = rows.iter().map(|r| source_columns(r.delivery)).collect();
        let ids: Vec<String> = sqlx::query_scalar(
            r#"INSERT INTO inbox (source_id, topic, "partition", "offset", decision, reason, operation_id, fingerprint, received_at)
               SELECT *, $9::timestamptz FROM unnest($1::text[], $2::text[], $3::int4[], $4::int8[], $5::text[], $6::text[], $7::uuid[], $8::text[])
               ON CONFLICT (source_id) DO NOTHING RETURNING source_id"#,
        )
        .bind(column(rows, |r| r.key))
        .bind(column(&sources, |s| s.0))
        .bind(column(&sources, |s| s.1))
        .bind(column(&sources, |s| s.2))
        .bind(column(rows, |r| r.decision.as_str()))
        .bind(column(rows, |r| r.decision.reason()))
        .bind(column(rows, |r| r.operation_id))
        .bind(column(rows, |r| r.fingerprint))
        .bind(at)
        .fetch_all(&mut *self.0)
        .await?;
        let mut inserted: HashSet<String> = ids.into_iter().collect();
        // The first row of a repeated event id is the one that inserted it.
        Ok(rows.iter().map(|row| inserted.remove(row.key)).collect())
    }

    async fn insert_operations_batch(&mut self, ops: &[Operation]) -> Result<Vec<bool>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let query = sqlx::query(&INSERT_OPERATIONS);
        let inserted = bind_op_state(bind_op_identity(query, ops), ops)
            .fetch_all(&mut *self.0)
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<std::result::Result<HashSet<Uuid>, _>>()?;
        Ok(ops
            .iter()
            .map(|op| inserted.contains(&op.operation_id))
            .collect())
    }

    async fn insert_events_batch(&mut self, events: &[NewEvent<'_>]) -> Result<()> {
        if events.is_empty() {
            return Ok(());
        }
        bind_events(sqlx::query(Part::Events.alone()), events)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    async fn lock_operations(&mut self, ids: &[Uuid]) -> Result<HashMap<Uuid, Operation>> {
        self.select_operations(ids, &format!("ORDER BY operation_id {LOCK_STATE}"))
            .await
    }

    async fn try_lock_operations(&mut self, ids: &[Uuid]) -> Result<HashMap<Uuid, Operation>> {
        self.select_operations(ids, &format!("{LOCK_STATE} SKIP LOCKED"))
            .await
    }

    async fn update_operations_batch(&mut self, ops: &[Operation]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        bind_operations(sqlx::query(Part::Operations.alone()), ops)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    async fn put_queue_rows(
        &mut self,
        rows: &[(&Operation, QueueState, OffsetDateTime)],
    ) -> Result<()> {
        type Row<'r> = &'r (&'r Operation, QueueState, OffsetDateTime);
        let (done, rows): (Vec<Row<'_>>, Vec<Row<'_>>) = rows
            .iter()
            .partition(|(_, state, _)| *state == QueueState::Done);
        if !done.is_empty() {
            sqlx::query(Part::Done.alone())
                .bind(column(&done, |(op, ..)| op.operation_id))
                .execute(&mut *self.0)
                .await?;
        }
        if !rows.is_empty() {
            bind_queue(sqlx::query(Part::Queue.alone()), &rows)
                .execute(&mut *self.0)
                .await?;
        }
        Ok(())
    }

    async fn insert_attempts_batch(&mut self, attempts: &[NewAttempt<'_>]) -> Result<()> {
        if attempts.is_empty() {
            return Ok(());
        }
        bind_attempts(sqlx::query(Part::Attempts.alone()), attempts)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    async fn finish_attempts_batch(
        &mut self,
        attempts: &[(Uuid, Uuid, &AttemptReport)],
        at: OffsetDateTime,
    ) -> Result<()> {
        if attempts.is_empty() {
            return Ok(());
        }
        bind_finished(sqlx::query(Part::Finished.alone()), attempts, at)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// The rows' transaction has its xid before the first id is drawn, as for every insert
    /// into the table (migration 0011's statement trigger): the relay floor's fence relies
    /// on it ([`PgTx::raise_relay_floor`]).
    async fn insert_outbox_batch(&mut self, rows: &[NewOutbox]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        bind_outbox(sqlx::query(Part::Outbox.alone()), rows)
            .execute(&mut *self.0)
            .await?;
        Ok(())
    }

    /// In one statement ([`rows_sql`]) of the kinds of rows there are, unless an
    /// operation has two queue rows or an attempt might be inserted and ended at once:
    /// then in turn, as each part must see the one before.
    async fn write_rows(&mut self, rows: &Rows<'_>, at: OffsetDateTime) -> Result<()> {
        let mut ids = HashSet::with_capacity(rows.queue.len());
        let twice = !rows
            .queue
            .iter()
            .all(|(op, ..)| ids.insert(op.operation_id));
        if twice || (!rows.attempts.is_empty() && !rows.finished.is_empty()) {
            return write_rows_in_turn(self, rows, at).await;
        }
        let (done, queue): (Vec<&QueueRow<'_>>, Vec<&QueueRow<'_>>) = rows
            .queue
            .iter()
            .partition(|(_, state, _)| *state == QueueState::Done);
        let done: Vec<Uuid> = column(&done, |(op, ..)| op.operation_id);
        let present = [
            (Part::Attempts, !rows.attempts.is_empty()),
            (Part::Events, !rows.events.is_empty()),
            (Part::Done, !done.is_empty()),
            (Part::Queue, !queue.is_empty()),
            (Part::Outbox, !rows.outbox.is_empty()),
            (Part::Operations, !rows.operations.is_empty()),
            (Part::Finished, !rows.finished.is_empty()),
        ];
        let parts = present
            .iter()
            .filter(|(_, any)| *any)
            .fold(0, |set, (part, _)| set | part.bit());
        if parts == 0 {
            return Ok(());
        }
        // Bound in the order of PARTS, as `rows_sql` numbers them.
        let mut query = sqlx::query(rows_sql(parts));
        for (part, _) in present.iter().filter(|(_, any)| *any) {
            query = match part {
                Part::Attempts => bind_attempts(query, rows.attempts),
                Part::Events => bind_events(query, rows.events),
                Part::Done => query.bind(&done),
                Part::Queue => bind_queue(query, &queue),
                Part::Outbox => bind_outbox(query, rows.outbox),
                Part::Operations => bind_operations(query, rows.operations),
                Part::Finished => bind_finished(query, rows.finished, at),
            };
        }
        query.execute(&mut *self.0).await?;
        Ok(())
    }

    async fn set_inbox_batch(
        &mut self,
        rows: &[(&str, &IngestDecision, Option<Uuid>)],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "UPDATE inbox SET decision = v.decision, reason = v.reason, operation_id = v.operation_id \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) \
             AS v(source_id, decision, reason, operation_id) WHERE inbox.source_id = v.source_id",
        )
        .bind(column(rows, |(event_id, ..)| *event_id))
        .bind(column(rows, |(_, decision, _)| decision.as_str()))
        .bind(column(rows, |(_, decision, _)| decision.reason()))
        .bind(column(rows, |(.., op)| *op))
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    // Head of line per entity ([`HEAD_OF_LINE`]), oldest first. The plan must walk the
    // ready index in order and stop at `limit` heads: statistics go stale in a burst
    // (the queue grows from nothing to tens of thousands of rows between two autoanalyze
    // runs), and with them the planner bitmap-scanned every waiting row, ran the
    // head-of-line check on each and sorted: 243 ms per claim at 35,000 waiting rows, most
    // of the dispatcher's time. Sorting is switched off for the claim transaction
    // (`SET LOCAL`), which leaves the ordered index scan that stops at the limit: 0.4 ms
    // for the same claim. (Switching bitmap scans off too would turn
    // the head-of-line probe into a sequential scan.)
    async fn pick_claimable(
        &mut self,
        now: OffsetDateTime,
        limit: usize,
        skip_tools: &[String],
    ) -> Result<Vec<(Uuid, String)>> {
        // Runs with sorting (and sequential scans) off: `Ledger::claim` sets
        // `Planner::Claim`, applied with the transaction's clock read, which the claim
        // flow takes before this.
        Ok(sqlx::query_as(&format!(
            "SELECT q.operation_id, q.tool FROM dispatch_queue q \
             WHERE q.state = 'waiting' AND q.ready_at <= $1 AND NOT (q.tool = ANY($3)) \
               AND {HEAD_OF_LINE} \
             ORDER BY q.ready_at, q.seq LIMIT $2 FOR UPDATE OF q SKIP LOCKED"
        ))
        .bind(now)
        .bind(limit as i64)
        .bind(skip_tools)
        .fetch_all(&mut *self.0)
        .await?)
    }

    async fn busy_entities(&mut self, entity_keys: &[&str]) -> Result<HashSet<String>> {
        if entity_keys.is_empty() {
            return Ok(HashSet::new());
        }
        // A statement of its own, after the clock read that sets the hot path's planner
        // settings: with them (a generic plan, no sequential scan) it is an index-only
        // scan of the per-entity index (`dispatch_queue_entity`, which holds exactly these
        // rows). Read in the clock read's own statement, planned before its settings apply,
        // it was a bitmap scan that visits the dead entries this churning table leaves:
        // clock and read 0.116 ms a call together, against 0.036 for the two apart
        // (BENCHMARKS.md, 2026-12-07 evening).
        let busy: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT entity_key FROM dispatch_queue \
             WHERE entity_key = ANY($1) AND state IN ('waiting', 'inflight', 'held') \
               AND NOT is_read",
        )
        .bind(entity_keys)
        .fetch_all(&mut *self.0)
        .await?;
        Ok(busy.into_iter().collect())
    }

    async fn waiting_on_entities(&mut self, entity_keys: &[&str]) -> Result<bool> {
        // The per-entity index (`dispatch_queue_entity`) holds exactly the rows asked for.
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM dispatch_queue \
             WHERE entity_key = ANY($1) AND state = 'waiting' AND NOT is_read)",
        )
        .bind(entity_keys)
        .fetch_one(&mut *self.0)
        .await?)
    }

    async fn pick_expired(&mut self, now: OffsetDateTime, limit: usize) -> Result<Vec<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT operation_id FROM operation_state WHERE status = 'dispatched' AND lease_expires_at < $1 \
             ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .bind(limit as i64)
        .fetch_all(&mut *self.0)
        .await?)
    }

    async fn pick_reconcilable(&mut self, now: OffsetDateTime, limit: usize) -> Result<Vec<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT operation_id FROM operation_state \
             WHERE status IN ('unknown_outcome', 'acknowledged') \
               AND (next_attempt_at IS NULL OR next_attempt_at <= $1) \
               AND (lease_expires_at IS NULL OR lease_expires_at < $1) \
             ORDER BY next_attempt_at NULLS FIRST LIMIT $2 FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .bind(limit as i64)
        .fetch_all(&mut *self.0)
        .await?)
    }
}

fn event_from_row(row: &PgRow) -> Result<OperationEvent> {
    let to: String = row.try_get("to_status")?;
    let from: Option<String> = row.try_get("from_status")?;
    Ok(OperationEvent {
        event_seq: row.try_get("event_seq")?,
        from: from
            .map(|f| Status::parse(&f).ok_or_else(|| corrupt("from_status", &f)))
            .transpose()?,
        to: Status::parse(&to).ok_or_else(|| corrupt("to_status", &to))?,
        reason: row.try_get("reason")?,
        attempt_id: row.try_get("attempt_id")?,
        epoch: row.try_get("epoch")?,
        actor: row.try_get("actor")?,
        at: row.try_get("at")?,
        detail: row
            .try_get::<Option<Json<Value>>, _>("detail")?
            .map(|j| j.0),
    })
}

fn attempt_from_row(row: &PgRow) -> Result<Attempt> {
    let outcome: Option<String> = row.try_get("outcome")?;
    Ok(Attempt {
        attempt_id: row.try_get("attempt_id")?,
        number: row.try_get::<i32, _>("number")? as u32,
        epoch: row.try_get("epoch")?,
        worker: row.try_get("worker")?,
        started_at: row.try_get("started_at")?,
        finished_at: row.try_get("finished_at")?,
        report: match outcome {
            None => None,
            Some(outcome) => Some(AttemptReport {
                outcome,
                http_status: row
                    .try_get::<Option<i32>, _>("http_status")?
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
impl Ledger for PgLedger {
    async fn ingest(&self, batch: &[IngestItem]) -> Result<Vec<IngestOutcome>> {
        write_tx!(self, |tx| {
            tx.1.planner = Planner::Keyed;
            flow::ingest(&mut tx, batch).await?
        })
    }

    async fn ingest_waiting_at_most(
        &self,
        batch: &[IngestItem],
        lock_wait: Duration,
    ) -> Result<Vec<IngestOutcome>> {
        write_tx!(self, |tx| {
            tx.1.planner = Planner::Keyed;
            tx.1.lock_wait = Some(lock_wait);
            flow::ingest(&mut tx, batch).await?
        })
    }

    async fn ingest_and_claim(
        &self,
        batch: &[IngestItem],
        lock_wait: Duration,
        request: &ClaimRequest,
    ) -> Result<(Vec<IngestOutcome>, Vec<Claim>)> {
        // A claim racing another transaction's for the same entity (the unique index on
        // writes in flight) is retried as a claim's is: the retry sees the other's write
        // and leaves this operation waiting.
        write_tx!(self, Error::is_claim_race, |tx| {
            tx.1.planner = Planner::Keyed;
            tx.1.lock_wait = Some(lock_wait);
            flow::ingest_and_claim(&mut tx, batch, request).await?
        })
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Vec<Claim>> {
        in_tx!(self, Error::is_claim_race, |tx| {
            tx.1.planner = Planner::Claim;
            flow::claim(&mut tx, request).await?
        })
    }

    async fn record(&self, recordings: &[Recording]) -> Result<Vec<Result<Operation>>> {
        write_tx!(self, |tx| {
            tx.1.planner = Planner::Keyed;
            flow::record(&mut tx, recordings).await?
        })
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
        in_tx!(self, |tx| {
            let Some(turn) = tx.take_relay_turn(request.lease).await? else {
                return Ok(Vec::new());
            };
            let rows = tx.pick_results(request.limit).await?;
            if rows.is_empty() {
                turn.idle(&mut tx).await?;
                return Ok(rows);
            }
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            sqlx::query(
                "UPDATE result_outbox SET claimed_by = $1, claimed_until = now() + $2 * interval '1 millisecond' \
                 WHERE id = ANY($3)",
            )
            .bind(&request.owner)
            .bind(millis(request.lease))
            .bind(&ids)
            .execute(&mut *tx.0)
            .await?;
            tx.raise_relay_floor(turn.handed_out).await?;
            rows
        })
    }

    async fn relay_round(
        &self,
        request: &ClaimRequest,
        publish: crate::Publish<'_>,
    ) -> Result<RelayRound> {
        // Not retried as a whole: a failure leaves the rows unpublished for a later round
        // (the broker may have them already; consumers dedupe on seq).
        let mut tx = self.begin().await?;
        let Some(turn) = tx.take_relay_turn(request.lease).await? else {
            tx.0.commit().await?;
            return Ok(RelayRound {
                standby: true,
                ..RelayRound::default()
            });
        };
        let rows = tx.pick_results(request.limit).await?;
        if rows.is_empty() {
            turn.idle(&mut tx).await?;
            tx.0.commit().await?;
            return Ok(RelayRound::default());
        }
        let taken = rows.len();
        let acked = publish(rows).await;
        sqlx::query(
            "UPDATE result_outbox SET published_at = now() WHERE id = ANY($1) AND published_at IS NULL",
        )
        .bind(&acked)
        .execute(&mut *tx.0)
        .await?;
        tx.raise_relay_floor(turn.handed_out).await?;
        tx.0.commit().await?;
        Ok(RelayRound {
            taken,
            marked: acked.len(),
            standby: false,
        })
    }

    async fn mark_published(&self, ids: &[i64]) -> Result<()> {
        sqlx::query(
            "UPDATE result_outbox SET published_at = now() WHERE id = ANY($1) AND published_at IS NULL",
        )
        .bind(ids)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn operation(&self, id: Uuid) -> Result<Option<Operation>> {
        sqlx::query(&format!(
            "SELECT {OP_COLUMNS} FROM operations WHERE operation_id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
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
        .fetch_optional(&self.pool)
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
        .bind(id)
        .fetch_all(&self.pool)
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
        .bind(id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(attempt_from_row)
        .collect()
    }

    async fn ids_between(&self, low: Uuid, high: Uuid, limit: i64) -> Result<Vec<Uuid>> {
        Ok(sqlx::query_scalar(
            "SELECT operation_id FROM operation_identity WHERE operation_id BETWEEN $1 AND $2 \
             ORDER BY operation_id LIMIT $3",
        )
        .bind(low)
        .bind(high)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    async fn results(&self, id: Uuid) -> Result<Vec<ResultRecord>> {
        sqlx::query(RESULTS_SQL)
            .bind(id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| {
                Ok(ResultRecord {
                    seq: r.try_get("seq")?,
                    status: r.try_get("status")?,
                    created_at: r.try_get("created_at")?,
                    published_at: r.try_get("published_at")?,
                })
            })
            .collect()
    }

    async fn activity(&self, since: OffsetDateTime) -> Result<Activity> {
        let decisions = sqlx::query(DECISIONS_SQL)
            .bind(since)
            .fetch_all(&self.pool)
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
            .bind(since)
            .fetch_one(&self.pool)
            .await?;
        let unknown_exits = sqlx::query(&unknown_exits_sql())
            .bind(since)
            .bind(ACTIVITY_EXITS_MAX)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| {
                let detail: Option<Value> = r.try_get("detail")?;
                Ok(UnknownExit {
                    to: r.try_get("to_status")?,
                    by_person: r.try_get("by_person")?,
                    waited_ms: waited_ms(detail.as_ref()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let now: OffsetDateTime = sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?;
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
                ListBind::Cursor(c) => q.bind(c),
            };
        }
        let rows = q.bind(limit as i64 + 1).fetch_all(&self.pool).await?;
        let operations = rows.iter().map(op_from_row).collect::<Result<Vec<_>>>()?;
        Ok(paginate(operations, limit))
    }

    async fn reap(&self, retention: Duration) -> Result<ReapStats> {
        let ms = millis(retention);
        in_tx!(self, |tx| {
            let inbox = sqlx::query(
                "DELETE FROM inbox WHERE received_at < now() - $1 * interval '1 millisecond'",
            )
            .bind(ms)
            .execute(&mut *tx.0)
            .await?
            .rows_affected();
            // Result rows are appended in id order as time goes, and no index names a time
            // (a mark must stay a heap-only update, migration 0010): the walk goes up the
            // primary key from the oldest row to the first one written after the cut, and
            // deletes what was published before it, reading about as many rows as it
            // deletes. A row is written before it is published, so a row written after
            // the cut was published after it too; `published_at` decides.
            tx.plan_as(Planner::Keyed).await?;
            let results = sqlx::query(
                "DELETE FROM result_outbox \
                 WHERE id < COALESCE((SELECT id FROM result_outbox \
                   WHERE created_at >= now() - $1 * interval '1 millisecond' \
                   ORDER BY id LIMIT 1), 9223372036854775807) \
                 AND published_at < now() - $1 * interval '1 millisecond'",
            )
            .bind(ms)
            .execute(&mut *tx.0)
            .await?
            .rows_affected();
            ReapStats { inbox, results }
        })
    }

    async fn stats(&self) -> Result<LedgerStats> {
        // The state rows carry the tool and class: no walk of the identities.
        let live = sqlx::query(&live_sql("operation_state"))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| {
                Ok(LiveCount {
                    tool: r.try_get("tool")?,
                    class: r.try_get("side_effect_class")?,
                    status: r.try_get("status")?,
                    count: r.try_get("n")?,
                    oldest_change: r.try_get("oldest")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let queue = sqlx::query_as::<_, (String, i64)>(QUEUE_DEPTH_SQL)
            .fetch_all(&self.pool)
            .await?;
        // The unpublished rows lie at or above the relay floor (migration 0010): a walk of
        // the primary key from it, never of the table (the floor is a parameter to the
        // planner, so this read plans as the hot path does, `Planner::Keyed`).
        // The window, from the floor to the last row: the primary key's two ends.
        let (relay_pending, relay_oldest, now, relay_window) = in_tx!(self, |tx| {
            tx.plan_as(Planner::Keyed).await?;
            sqlx::query_as::<_, (i64, Option<OffsetDateTime>, OffsetDateTime, i64)>(&format!(
                "SELECT COUNT(*), MIN(created_at), now(), \
                   GREATEST(0, COALESCE((SELECT max(id) FROM result_outbox), 0) + 1 \
                     - COALESCE((SELECT floor FROM result_relay_floor), 1)) \
                 FROM result_outbox {UNPUBLISHED}"
            ))
            .fetch_one(&mut *tx.0)
            .await?
        })?;
        Ok(LedgerStats {
            live,
            queue,
            relay_pending,
            relay_oldest,
            relay_window,
            now,
        })
    }

    async fn schema_status(&self) -> Result<SchemaStatus> {
        let found: Option<i64> = match sqlx::query_scalar(schema::APPLIED_VERSION)
            .fetch_one(&self.pool)
            .await
        {
            Ok(v) => v,
            // 42P01: undefined_table, never migrated.
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01") => None,
            Err(e) => return Err(e.into()),
        };
        Ok(SchemaStatus::new(found, &schema::POSTGRES))
    }

    fn changes(&self) -> Changes {
        self.changes.listen(&self.pool);
        self.changes.signal.subscribe()
    }

    fn claimable_changes(&self) -> Changes {
        self.changes.listen(&self.pool);
        self.changes.signal.subscribe_claimable()
    }
}

/// This process's side of the change signal: fired after its own commits, and by a
/// listener task (started by the first [`Ledger::changes`]) on other processes'.
#[derive(Debug)]
struct PgChanges {
    signal: Signal,
    /// The channel write transactions `NOTIFY` (`opgate_changes_{schema}`).
    channel: String,
    /// The payload: it names this ledger instance, so a process ignores its own
    /// notifications (it fired the signal already).
    instance: String,
    listener: OnceLock<tokio::task::JoinHandle<()>>,
}

impl PgChanges {
    fn new(channel: String) -> Self {
        Self {
            signal: Signal::new(),
            channel,
            instance: Uuid::now_v7().to_string(),
            listener: OnceLock::new(),
        }
    }

    /// Starts the listener once. It reconnects by itself after a lost connection, and
    /// fires the signal then (notifications sent meanwhile are lost; a worker looks again).
    fn listen(&self, pool: &PgPool) {
        self.listener.get_or_init(|| {
            let (pool, signal) = (pool.clone(), self.signal.clone());
            let (channel, me) = (self.channel.clone(), self.instance.clone());
            tokio::spawn(async move {
                let mut pause = Duration::from_millis(100);
                loop {
                    match listen_once(&pool, &signal, &channel, &me).await {
                        Ok(()) => pause = Duration::from_millis(100),
                        Err(e) => {
                            tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "ledger change listener failed; workers poll meanwhile");
                            pause = (pause * 2).min(Duration::from_secs(10));
                        }
                    }
                    signal.fire();
                    tokio::time::sleep(pause).await;
                }
            })
        });
    }
}

impl Drop for PgChanges {
    fn drop(&mut self) {
        if let Some(task) = self.listener.get() {
            task.abort();
        }
    }
}

/// Listens until the connection is lost (`Ok`) or cannot be set up (`Err`).
async fn listen_once(pool: &PgPool, signal: &Signal, channel: &str, me: &str) -> Result<()> {
    let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    while let Some(notification) = listener.try_recv().await? {
        if notification.payload() != me {
            signal.fire();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_relay_turn_renews_a_passed_fence_behind_the_ids_and_else_closes_up_to_it() {
        // Ids handed out past a passed fence: a new fence, whatever the floor.
        assert_eq!(idle_floor(true, Some(5), Some(10), 12), IdleFloor::Raise);
        assert_eq!(idle_floor(true, Some(11), Some(10), 12), IdleFloor::Raise);
        // None since: bring the floor up to the fence, unless it is there already.
        assert_eq!(idle_floor(true, Some(5), Some(10), 10), IdleFloor::Close);
        assert_eq!(idle_floor(true, Some(10), Some(10), 10), IdleFloor::Close);
        assert_eq!(idle_floor(true, Some(11), Some(10), 10), IdleFloor::Keep);
        // A fence not passed yet, or none stored, or no floor row: nothing.
        assert_eq!(idle_floor(false, Some(5), Some(10), 12), IdleFloor::Keep);
        assert_eq!(idle_floor(true, Some(1), None, 12), IdleFloor::Keep);
        assert_eq!(idle_floor(false, None, None, 12), IdleFloor::Keep);
    }

    /// The batched insert writes every column the reads know ([`OP_COLUMNS`]), each once.
    #[test]
    fn the_batched_statements_name_every_operation_column_once() {
        let mut written: Vec<&str> = OP_IDENTITY
            .iter()
            .chain(&OP_STATE)
            .map(|(name, _)| *name)
            .collect();
        let mut read: Vec<&str> = OP_COLUMNS.split(',').map(str::trim).collect();
        written.sort_unstable();
        read.sort_unstable();
        assert_eq!(written, read);
        assert!(INSERT_OPERATIONS.contains(&format!("${}::timestamptz[]", read.len())));
    }

    /// Every set of row kinds [`PgTx::write_rows`] can write at once is one statement the
    /// server accepts, with as many parameters as its parts bind, in their order.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn every_set_of_row_kinds_is_one_statement_with_its_parts_parameters() -> Result<()> {
        use sqlx::{Executor as _, Statement as _};

        let (ledger, _schema) = fresh_ledger().await?;
        let mut tx = ledger.begin().await?;
        for parts in 1..1usize << PARTS.len() {
            let statement = tx.0.prepare(rows_sql(parts)).await?;
            let bound: usize = PARTS
                .iter()
                .filter(|part| parts & part.bit() != 0)
                .map(|part| part.params())
                .sum();
            let types = match statement.parameters() {
                Some(sqlx::Either::Left(types)) => types.len(),
                Some(sqlx::Either::Right(n)) => n,
                None => 0,
            };
            assert_eq!(types, bound, "parts {parts:#09b}: {}", rows_sql(parts));
        }
        // The parts are items of one statement, but the last, in the order of PARTS.
        let all = rows_sql((1 << PARTS.len()) - 1);
        assert!(all.starts_with("WITH w0 AS (INSERT INTO attempts"));
        assert!(all.contains("w5 AS (UPDATE operation_state"));
        assert!(
            all.ends_with("WHERE a.attempt_id = v.attempt_id AND a.operation_id = v.operation_id")
        );
        tx.0.rollback().await?;
        Ok(())
    }

    /// An operation with a distinct value in every column reads back as the batched
    /// insert wrote it, and as the batched update rewrote its state: a column bound in
    /// another column's place would show here, even between two of the same type.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn an_operation_reads_back_as_inserted_and_as_updated() -> Result<()> {
        use time::macros::datetime;

        let (ledger, _schema) = fresh_ledger().await?;

        let mut op = Operation {
            operation_id: Uuid::now_v7(),
            namespace: "ns".into(),
            idempotency_key: "key".into(),
            key_components: serde_json::json!({"parts": ["a", 1]}),
            args_fingerprint: "fingerprint".into(),
            event_id: "event".into(),
            agent_id: Some("agent".into()),
            workflow_id: Some("workflow".into()),
            run_id: Some("run".into()),
            step: Some(7),
            tool: "pay".into(),
            intent: Some("intent".into()),
            entity: Entity {
                kind: "order".into(),
                id: "o1".into(),
            },
            entity_key: "ns:order:o1".into(),
            canonical_args: serde_json::json!({"amount": 4900}),
            side_effect_class: SideEffectClass::Irreversible,
            status: Status::PendingDispatch,
            attempt_count: 1,
            first_attempt_at: Some(datetime!(2026-01-01 00:00:01.000001 UTC)),
            unknown_since: Some(datetime!(2026-01-01 00:00:02 UTC)),
            ambiguous_since: Some(datetime!(2026-01-01 00:00:03 UTC)),
            next_attempt_at: Some(datetime!(2026-01-01 00:00:04 UTC)),
            lease_owner: Some("owner".into()),
            lease_expires_at: Some(datetime!(2026-01-01 00:00:05 UTC)),
            lease_epoch: 2,
            external_request_id: Some("request".into()),
            external_object_id: Some("object".into()),
            result: Some(serde_json::json!({"charge_id": "ch_1"})),
            error: Some(ErrorInfo {
                category: "throttled".into(),
                retryable: true,
                retry_after_seconds: Some(3),
                message: Some("slow down".into()),
            }),
            compensates: None,
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            result_seq: 3,
            created_at: datetime!(2026-01-01 00:00:06 UTC),
            updated_at: datetime!(2026-01-01 00:00:07 UTC),
        };
        let mut tx = ledger.begin().await?;
        assert_eq!(
            tx.insert_operations_batch(std::slice::from_ref(&op))
                .await?,
            [true]
        );
        assert_eq!(
            tx.read_operation(op.operation_id).await?.as_ref(),
            Some(&op)
        );

        op.status = Status::Dispatched;
        op.attempt_count = 4;
        op.first_attempt_at = Some(datetime!(2026-02-01 00:00:01 UTC));
        op.unknown_since = None;
        op.ambiguous_since = Some(datetime!(2026-02-01 00:00:03 UTC));
        op.next_attempt_at = Some(datetime!(2026-02-01 00:00:04 UTC));
        op.lease_owner = Some("another owner".into());
        op.lease_expires_at = Some(datetime!(2026-02-01 00:00:05 UTC));
        op.lease_epoch = 5;
        op.external_request_id = Some("request 2".into());
        op.external_object_id = None;
        op.result = None;
        op.error = Some(ErrorInfo {
            category: "server_error".into(),
            retryable: false,
            retry_after_seconds: None,
            message: None,
        });
        op.result_seq = 6;
        op.updated_at = datetime!(2026-02-01 00:00:07 UTC);
        tx.update_operations_batch(std::slice::from_ref(&op))
            .await?;
        assert_eq!(
            tx.read_operation(op.operation_id).await?.as_ref(),
            Some(&op)
        );
        tx.0.rollback().await?;
        Ok(())
    }

    /// A migrated ledger in a new schema of `OPGATE_TEST_DATABASE_URL`, which it drops
    /// when dropped.
    #[cfg(feature = "integration")]
    async fn fresh_ledger() -> Result<(PgLedger, Schema)> {
        let (ledger, schema) = empty_ledger().await?;
        ledger.migrate().await?;
        Ok((ledger, schema))
    }

    /// A ledger over a new, empty schema (not migrated), dropped with the [`Schema`].
    #[cfg(feature = "integration")]
    async fn empty_ledger() -> Result<(PgLedger, Schema)> {
        let url = std::env::var("OPGATE_TEST_DATABASE_URL").map_err(|_| {
            Error::Corrupt(
                "set OPGATE_TEST_DATABASE_URL (e.g. postgres://postgres@127.0.0.1:5432/test)"
                    .into(),
            )
        })?;
        let name = format!("t_{}", Uuid::now_v7().simple());
        let admin = PgPool::connect(&url).await?;
        sqlx::query(&format!("CREATE SCHEMA {name}"))
            .execute(&admin)
            .await?;
        let schema = Schema { admin, name };
        let options: PgConnectOptions = url.parse()?;
        let ledger =
            PgLedger::connect_with(options.options([("search_path", schema.name.as_str())]))
                .await?;
        Ok((ledger, schema))
    }

    /// The hot path's transactions run generic plans only: a statement over an id array,
    /// run six times in a `Keyed` transaction, is never planned for its values, while the
    /// same statement on another connection under the server's settings is, at least for
    /// its first five runs (the server's rule), so the first half would fail without the
    /// setting.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn hot_path_transactions_run_generic_plans_only() -> Result<()> {
        let (ledger, _schema) = fresh_ledger().await?;
        // (generic, custom) plans of this connection's prepared id-array lock reads.
        async fn plans(tx: &mut PgTx) -> Result<(i64, i64)> {
            Ok(sqlx::query_as(
                "SELECT COALESCE(SUM(generic_plans), 0)::int8, COALESCE(SUM(custom_plans), 0)::int8 \
                 FROM pg_prepared_statements WHERE statement LIKE $1",
            )
            .bind(format!("%= ANY($1) ORDER BY operation_id {LOCK_STATE}"))
            .fetch_one(&mut *tx.0)
            .await?)
        }
        async fn six_lock_reads(tx: &mut PgTx) -> Result<(i64, i64)> {
            tx.now().await?;
            let before = plans(tx).await?;
            for n in 1..=6 {
                let ids: Vec<Uuid> = (0..n).map(|_| Uuid::now_v7()).collect();
                assert!(tx.lock_operations(&ids).await?.is_empty());
            }
            let after = plans(tx).await?;
            Ok((after.0 - before.0, after.1 - before.1))
        }

        let mut hot = ledger.begin().await?;
        hot.1.planner = Planner::Keyed;
        // Held open, so the other transaction runs on another connection, whose prepared
        // statements start from nothing.
        let mut plain = ledger.begin().await?;
        assert_eq!(
            six_lock_reads(&mut hot).await?,
            (6, 0),
            "hot path: generic only"
        );
        let (_, custom) = six_lock_reads(&mut plain).await?;
        assert!(
            custom >= 5,
            "server settings: {custom} custom plans of 6 runs"
        );
        hot.0.rollback().await?;
        plain.0.rollback().await?;
        Ok(())
    }

    /// A ledger over a new schema migrated by this build's migrations before `version`
    /// only: the schema an upgrade to `version` starts from.
    #[cfg(feature = "integration")]
    async fn ledger_before(version: i64) -> Result<(PgLedger, Schema)> {
        let (ledger, schema) = empty_ledger().await?;
        let dir = std::env::temp_dir().join(format!("opgate-migrations-{}", schema.name));
        std::fs::create_dir_all(&dir).map_err(|e| Error::Corrupt(e.to_string()))?;
        let source =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations/postgres");
        for entry in std::fs::read_dir(&source).map_err(|e| Error::Corrupt(e.to_string()))? {
            let path = entry.map_err(|e| Error::Corrupt(e.to_string()))?.path();
            let file = path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default();
            let number = file.split('_').next().and_then(|n| n.parse::<i64>().ok());
            if number.is_some_and(|n| n < version) {
                std::fs::copy(&path, dir.join(file)).map_err(|e| Error::Corrupt(e.to_string()))?;
            }
        }
        let before = sqlx::migrate::Migrator::new(dir.as_path())
            .await
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        assert_eq!(before.iter().map(|m| m.version).max(), Some(version - 1));
        before.run(ledger.pool()).await?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok((ledger, schema))
    }

    /// A result row for the relay floor's tests: its payload names its seq.
    #[cfg(feature = "integration")]
    fn outbox_row(seq: i64, operation_id: Option<Uuid>, at: OffsetDateTime) -> NewOutbox {
        NewOutbox {
            operation_id,
            seq,
            status: "accepted".into(),
            kafka_key: format!("k{seq}"),
            payload: format!("{{\"seq\":{seq}}}"),
            traceparent: None,
            at,
        }
    }

    /// One relay round that had the turn. The relays of the tests running beside this one
    /// share the turn (an advisory lock of the database), so a round may stand by: it is
    /// tried again, with a new publish, until it has the turn.
    #[cfg(feature = "integration")]
    async fn relay_with_turn(
        ledger: &PgLedger,
        request: &ClaimRequest,
        publish: impl Fn() -> crate::Publish<'static>,
    ) -> Result<RelayRound> {
        for _ in deadline_rounds() {
            let round = ledger.relay_round(request, publish()).await?;
            if !round.standby {
                return Ok(round);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Err(Error::Corrupt("the relay never had the turn".into()))
    }

    /// Rounds of a wait for the relay floor, for 30 s: a transaction another test holds
    /// open on the server holds every fence back while it runs, however many rounds pass.
    #[cfg(feature = "integration")]
    fn deadline_rounds() -> impl Iterator<Item = ()> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        std::iter::from_fn(move || (std::time::Instant::now() < deadline).then_some(()))
    }

    #[cfg(feature = "integration")]
    async fn relay_floor(ledger: &PgLedger) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT floor FROM result_relay_floor")
            .fetch_one(&ledger.pool)
            .await?)
    }

    /// `seen` (the seqs published, in order) holds `seq` once and as many rows as the
    /// table: every row relayed once; and the backlog gauge says none is left.
    #[cfg(feature = "integration")]
    async fn relayed_once_each(ledger: &PgLedger, seen: &[i64], seq: i64) -> Result<()> {
        assert_eq!(seen.iter().filter(|&&s| s == seq).count(), 1, "{seen:?}");
        let all: i64 = sqlx::query_scalar("SELECT count(*) FROM result_outbox")
            .fetch_one(&ledger.pool)
            .await?;
        assert_eq!(seen.len() as i64, all, "every row relayed once: {seen:?}");
        assert_eq!(ledger.stats().await?.relay_pending, 0);
        Ok(())
    }

    /// The relay floor (migration 0010) never passes a result row whose transaction is
    /// still running: a row that takes its id first and commits last, behind rows relayed
    /// meanwhile in rounds that raise the floor, is still relayed once it commits, and only
    /// then does the floor pass it. The backlog gauge reads from the floor. The same holds
    /// for a row written by any other insert, held between drawing its id and its first
    /// write: the schema gives its transaction an xid first (migration 0011), which the
    /// floor's fence relies on; meanwhile the relay's read window (a gauge) shows the held
    /// floor, which the backlog does not.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn the_relay_floor_never_passes_a_result_whose_transaction_is_still_running() -> Result<()>
    {
        let (ledger, _schema) = fresh_ledger().await?;
        let row = |seq: i64| outbox_row(seq, None, OffsetDateTime::now_utc());
        let published = Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
        let request = ClaimRequest {
            owner: "relay".into(),
            lease: Duration::from_secs(30),
            limit: 100,
            ..Default::default()
        };
        // One relay round, publishing whatever it takes.
        let relay = || {
            let (ledger, published, request) = (&ledger, published.clone(), &request);
            let publish = move || -> crate::Publish<'static> {
                let published = published.clone();
                Box::new(move |rows| {
                    Box::pin(async move {
                        let mut seen = published.lock().expect("published");
                        seen.extend(rows.iter().map(|r| r.seq));
                        rows.iter().map(|r| r.id).collect()
                    })
                })
            };
            async move { relay_with_turn(ledger, request, publish).await }
        };
        // One committed row, then one relay round: what a busy relay does each time.
        let write_and_relay = |seq: i64| {
            let (ledger, relay) = (&ledger, &relay);
            async move {
                let mut tx = ledger.begin().await?;
                tx.insert_outbox_batch(&[row(seq)]).await?;
                tx.0.commit().await?;
                relay().await
            }
        };
        let floor = || relay_floor(&ledger);
        // Raised by a relay that keeps up (another test's transaction may hold the fence
        // back for a moment: the fence waits for every older transaction on the server).
        let raised_past = |id: i64, mut seq: i64| {
            let write_and_relay = &write_and_relay;
            async move {
                for _ in deadline_rounds() {
                    if floor().await? > id {
                        return Ok::<i64, Error>(seq);
                    }
                    seq += 1;
                    write_and_relay(seq).await?;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(Error::Corrupt(format!("the floor never passed {id}")))
            }
        };
        let mut seq = 0;
        for _ in 0..3 {
            seq += 1;
            write_and_relay(seq).await?;
        }
        seq = raised_past(1, seq).await?;

        // A transaction whose first write is a result row, left open.
        let mut late = ledger.begin().await?;
        late.insert_outbox_batch(&[row(1000)]).await?;
        let late_id: i64 = sqlx::query_scalar("SELECT max(id) FROM result_outbox")
            .fetch_one(&mut *late.0)
            .await?;
        let floor_before = floor().await?;
        assert!(floor_before <= late_id);
        for _ in 0..5 {
            seq += 1;
            write_and_relay(seq).await?;
        }
        assert!(
            floor().await? <= late_id,
            "the floor passed a row whose transaction is still running"
        );
        assert!(!published.lock().expect("published").contains(&1000));
        assert_eq!(ledger.stats().await?.relay_pending, 0);

        late.0.commit().await?;
        assert_eq!(ledger.stats().await?.relay_pending, 1);
        seq = raised_past(late_id, seq).await?;
        let seen = published.lock().expect("published").clone();
        relayed_once_each(&ledger, &seen, 1000).await?;

        // A row written by hand (not by the store's statement) that has drawn its id and
        // waits before its first write: a trigger of this test holds it there until the
        // advisory lock below is let go. Its transaction has its xid already (migration
        // 0011's statement trigger), so no fence taken meanwhile can be passed.
        let key = i64::from(Uuid::now_v7().as_u128() as u32 & 0x7fff_ffff);
        for sql in [
            format!(
                "CREATE FUNCTION hold_row() RETURNS trigger LANGUAGE plpgsql AS \
                 $$ BEGIN PERFORM pg_advisory_xact_lock({key}); RETURN NEW; END $$"
            ),
            "CREATE TRIGGER hold_row BEFORE INSERT ON result_outbox FOR EACH ROW \
             WHEN (NEW.seq = 7777) EXECUTE FUNCTION hold_row()"
                .into(),
        ] {
            sqlx::query(&sql).execute(&ledger.pool).await?;
        }
        let mut holder = ledger.pool.acquire().await?;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(key)
            .execute(&mut *holder)
            .await?;
        let pool = ledger.pool.clone();
        let by_hand = tokio::spawn(async move {
            let mut tx = pool.begin().await?;
            sqlx::query(
                "INSERT INTO result_outbox (operation_id, seq, status, kafka_key, payload, \
                 created_at) VALUES (NULL, 7777, 'accepted', 'k7777', '{\"seq\":7777}', now())",
            )
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            Ok::<(), Error>(())
        });
        let mut waiting = false;
        for _ in deadline_rounds() {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks \
                 WHERE locktype = 'advisory' AND NOT granted AND objid::int8 = $1",
            )
            .bind(key)
            .fetch_one(&ledger.pool)
            .await?;
            if n == 1 {
                waiting = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(waiting, "the insert by hand never reached its trigger");
        // Nothing else writes result rows now: the sequence's last id is the waiting row's.
        let hand_id: i64 = sqlx::query_scalar("SELECT last_value FROM result_outbox_id_seq")
            .fetch_one(&ledger.pool)
            .await?;
        for _ in 0..20 {
            seq += 1;
            write_and_relay(seq).await?;
            assert!(
                floor().await? <= hand_id,
                "the floor passed a row that drew its id before its transaction had an xid"
            );
        }
        // The held floor shows in the read window, not in the backlog: the rows written
        // meanwhile are published, the waiting one is not visible yet.
        let stats = ledger.stats().await?;
        let last: i64 = sqlx::query_scalar("SELECT max(id) FROM result_outbox")
            .fetch_one(&ledger.pool)
            .await?;
        assert_eq!(stats.relay_pending, 0);
        assert_eq!(stats.relay_window, last + 1 - floor().await?);
        assert!(stats.relay_window >= 20, "{stats:?}");
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(key)
            .execute(&mut *holder)
            .await?;
        by_hand
            .await
            .map_err(|e| Error::Corrupt(format!("the insert by hand: {e}")))??;
        raised_past(hand_id, seq).await?;
        let seen = published.lock().expect("published").clone();
        relayed_once_each(&ledger, &seen, 7777).await?;

        // Traffic stops: rounds that take nothing still bring the floor up to the last
        // fence once it has passed, so the read window closes (and the gauge with it).
        let idle_until_closed = || {
            let (ledger, relay) = (&ledger, &relay);
            async move {
                for _ in deadline_rounds() {
                    if ledger.stats().await?.relay_window == 0 {
                        break;
                    }
                    assert_eq!(relay().await?.taken, 0);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                assert_eq!(ledger.stats().await?.relay_window, 0);
                Ok::<(), Error>(())
            }
        };
        idle_until_closed().await?;

        // The last rounds that took rows ran while another transaction held their fences
        // back, then that transaction ends and traffic stops: rounds that take nothing
        // store a fence past those rows and close the window all the same.
        let mut holder = ledger.pool.begin().await?;
        sqlx::query("SELECT pg_current_xact_id()")
            .execute(&mut *holder)
            .await?;
        for _ in 0..3 {
            seq += 1;
            write_and_relay(seq).await?;
        }
        holder.commit().await?;
        idle_until_closed().await?;
        Ok(())
    }

    /// The relay floor waits for every row that is not published yet, whatever kept it
    /// back: a row whose publish failed in two rounds in a row, while later rows were
    /// published and the floor raised round after round, and a row leased by
    /// `claim_results` whose lease then ran out. Each is published once, later, and only
    /// then does the floor pass it.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn the_relay_floor_waits_for_a_failed_publish_and_an_expired_lease() -> Result<()> {
        let (ledger, _schema) = fresh_ledger().await?;
        let ledger = &ledger;
        let row = |seq: i64| outbox_row(seq, Some(Uuid::now_v7()), OffsetDateTime::now_utc());
        let request = |owner: &str, lease_ms: u64| ClaimRequest {
            owner: owner.into(),
            lease: Duration::from_millis(lease_ms),
            limit: 100,
            ..Default::default()
        };
        let published = Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
        // The broker refuses seq 1 this many more times.
        let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(2));
        let write = move |seq: i64| async move {
            let mut tx = ledger.begin().await?;
            tx.insert_outbox_batch(&[row(seq)]).await?;
            tx.0.commit().await?;
            Ok::<i64, Error>(
                sqlx::query_scalar("SELECT max(id) FROM result_outbox")
                    .fetch_one(&ledger.pool)
                    .await?,
            )
        };
        let relay = || {
            let (published, refusals) = (published.clone(), refusals.clone());
            let publish = move || -> crate::Publish<'static> {
                let (published, refusals) = (published.clone(), refusals.clone());
                Box::new(move |rows| {
                    Box::pin(async move {
                        let mut acked = Vec::new();
                        for r in &rows {
                            if r.seq == 1
                                && refusals
                                    .fetch_update(
                                        std::sync::atomic::Ordering::SeqCst,
                                        std::sync::atomic::Ordering::SeqCst,
                                        |n| n.checked_sub(1),
                                    )
                                    .is_ok()
                            {
                                continue;
                            }
                            published.lock().expect("published").push(r.seq);
                            acked.push(r.id);
                        }
                        acked
                    })
                })
            };
            async move { relay_with_turn(ledger, &request("relay", 30_000), publish).await }
        };
        let floor = || relay_floor(ledger);

        // Two faults in a row: seq 1 is refused by the first two rounds.
        let refused_id = write(1).await?;
        let mut seq = 1;
        for _ in 0..6 {
            seq += 1;
            write(seq).await?;
            relay().await?;
        }
        assert_eq!(refusals.load(std::sync::atomic::Ordering::SeqCst), 0);
        let seen = published.lock().expect("published").clone();
        assert_eq!(seen.iter().filter(|&&s| s == 1).count(), 1, "{seen:?}");

        // A lease that runs out: another relay leases a row and never marks it (30 s, run
        // out by hand below, so the six rounds under it fit however loaded the machine).
        let leased_id = write(500).await?;
        let mut leased = Vec::new();
        for _ in deadline_rounds() {
            // Empty while another test's relay has the server's turn.
            leased = ledger.claim_results(&request("stalled", 30_000)).await?;
            if !leased.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(leased.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![500]);
        for _ in 0..6 {
            seq += 1;
            write(seq).await?;
            relay().await?;
            assert!(floor().await? <= leased_id, "the floor passed a leased row");
        }
        assert!(!published.lock().expect("published").contains(&500));
        // Rounds until the floor passes `id` (a transaction another test holds open can
        // keep every fence back a moment), never past the leased row before it is
        // published, once its lease has run out; their rows' seqs start at `seq`, clear of
        // 500 however many rounds it takes.
        let past = |id: i64, mut seq: i64| {
            let (write, relay, floor, published) = (&write, &relay, &floor, &published);
            async move {
                for _ in deadline_rounds() {
                    if floor().await? > id {
                        break;
                    }
                    seq += 1;
                    write(seq).await?;
                    relay().await?;
                    assert!(
                        floor().await? <= leased_id
                            || published.lock().expect("published").contains(&500),
                        "the floor passed a row not yet published"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Ok::<bool, Error>(floor().await? > id)
            }
        };
        assert!(
            past(refused_id, 10_000).await?,
            "the floor stayed below a published row"
        );
        sqlx::query(
            "UPDATE result_outbox SET claimed_until = now() - interval '1 second' WHERE id = $1",
        )
        .bind(leased_id)
        .execute(&ledger.pool)
        .await?;
        assert!(
            past(leased_id, 20_000).await?,
            "the floor never passed the lease"
        );
        let seen = published.lock().expect("published").clone();
        relayed_once_each(ledger, &seen, 500).await?;
        Ok(())
    }

    /// The reaper's walk up the primary key (migration 0010 left no index on a time):
    /// it deletes a result published before the cut, keeps one written before the cut
    /// but never published, and stops at the first row written after the cut, which it
    /// keeps though published.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn the_reaper_walks_to_the_cut_and_keeps_what_is_unpublished() -> Result<()> {
        let (ledger, _schema) = fresh_ledger().await?;
        let write = |seq: i64| {
            let ledger = &ledger;
            async move {
                let mut tx = ledger.begin().await?;
                let at = tx.now().await?;
                tx.insert_outbox_batch(&[outbox_row(seq, None, at)]).await?;
                tx.0.commit().await?;
                Ok::<i64, Error>(
                    sqlx::query_scalar("SELECT max(id) FROM result_outbox")
                        .fetch_one(&ledger.pool)
                        .await?,
                )
            }
        };
        let old_published = write(1).await?;
        let old_unpublished = write(2).await?;
        ledger.mark_published(&[old_published]).await?;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let young = write(3).await?;
        ledger.mark_published(&[young]).await?;
        let stats = ledger.reap(Duration::from_millis(150)).await?;
        assert_eq!(stats.results, 1);
        let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM result_outbox ORDER BY id")
            .fetch_all(&ledger.pool)
            .await?;
        assert_eq!(left, vec![old_unpublished, young]);
        Ok(())
    }

    /// A test schema, dropped with its contents at the end of the test.
    #[cfg(feature = "integration")]
    struct Schema {
        admin: PgPool,
        name: String,
    }

    #[cfg(feature = "integration")]
    impl Drop for Schema {
        fn drop(&mut self) {
            let (admin, name) = (self.admin.clone(), self.name.clone());
            // Best effort: .ci/run drops every leftover `t_` schema before a run.
            tokio::spawn(async move {
                let _ = sqlx::query(&format!("DROP SCHEMA {name} CASCADE"))
                    .execute(&admin)
                    .await;
            });
        }
    }

    /// A rejected proposal: an inbox row and a result row, nothing else to set up.
    #[cfg(feature = "integration")]
    fn rejected(event_id: &str) -> IngestItem {
        IngestItem::Rejected(Box::new(opgate_core::RejectedProposal {
            event_id: event_id.into(),
            delivery: opgate_core::Delivery {
                principal: None,
                source: opgate_core::Source::Http,
                traceparent: None,
            },
            namespace: Some("ns".into()),
            workflow_id: None,
            step: None,
            tool: None,
            entity: None,
            rejection: opgate_core::Rejection {
                reason: "schema",
                message: "test".into(),
            },
            content_fingerprint: None,
        }))
    }

    /// A transaction carrying several partitions' batches waits at most its bound for a
    /// lock another transaction holds (here: another ingest of the same event id, not yet
    /// committed), then ends with nothing written; a plain ingest waits for the other.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn a_bounded_lock_wait_ends_the_ingest_and_writes_nothing() -> Result<()> {
        let (ledger, _schema) = fresh_ledger().await?;
        let mut holder = ledger.begin().await?;
        flow::ingest(&mut holder, &[rejected("held")]).await?;

        let started = std::time::Instant::now();
        let bounded = tokio::time::timeout(
            Duration::from_secs(10),
            ledger.ingest_waiting_at_most(
                &[rejected("free"), rejected("held")],
                Duration::from_millis(200),
            ),
        )
        .await
        .map_err(|_| Error::Corrupt("the bounded ingest still waited after 10 s".into()))?;
        let waited = started.elapsed();
        let err = match bounded {
            Err(e) => e,
            Ok(outcomes) => panic!("expected a lock timeout, got {outcomes:?}"),
        };
        let Error::Database(sqlx::Error::Database(db)) = &err else {
            panic!("expected a lock timeout, got {err:?}");
        };
        assert_eq!(db.code().as_deref(), Some("55P03"), "{db}");
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert!(!err.is_transient() && !err.is_deterministic());
        let inbox = |key: &'static str| {
            let pool = ledger.pool().clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM inbox WHERE source_id = $1")
                    .bind(key)
                    .fetch_one(&pool)
                    .await
            }
        };
        assert_eq!(inbox("ns/free").await?, 0, "nothing written");

        // Without the bound the same ingest waits for the holder, then finds its row.
        let plain = tokio::spawn({
            let ledger = ledger.clone();
            async move { ledger.ingest(&[rejected("free"), rejected("held")]).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!plain.is_finished(), "a plain ingest waits for the lock");
        holder.0.commit().await?;
        let outcomes = plain.await.map_err(|e| Error::Corrupt(e.to_string()))??;
        assert_eq!(outcomes.len(), 2);
        assert!(outcomes[1].inbox_hit, "the held event was the holder's");
        assert_eq!(inbox("ns/free").await?, 1);
        Ok(())
    }

    /// Migration 0008 on a ledger that has results waiting: the unpublished rows keep
    /// their trace context (moved into its own column) and their text, and the relay
    /// takes them as it took them before the upgrade.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn results_waiting_at_the_upgrade_to_json_payloads_keep_their_trace_context() -> Result<()>
    {
        let (ledger, _schema) = ledger_before(8).await?;

        let traced = r#"{"status": "rejected", "seq": 0, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#;
        let plain = r#"{"status": "rejected", "seq": 0}"#;
        for (payload, published) in [(traced, false), (plain, false), (traced, true)] {
            sqlx::query(
                "INSERT INTO result_outbox (operation_id, seq, status, kafka_key, payload, created_at, published_at) \
                 VALUES (NULL, 0, 'rejected', 'order:o1', $1::jsonb, now(), CASE WHEN $2 THEN now() END)",
            )
            .bind(payload)
            .bind(published)
            .execute(ledger.pool())
            .await?;
        }

        ledger.migrate().await?;
        let kind: String = sqlx::query_scalar(
            "SELECT data_type FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = 'result_outbox' AND column_name = 'payload'",
        )
        .fetch_one(ledger.pool())
        .await?;
        assert_eq!(kind, "json");
        let rows = ledger
            .claim_results(&ClaimRequest {
                owner: "relay".into(),
                lease: Duration::from_secs(30),
                limit: 10,
                tool_room: Default::default(),
            })
            .await?;
        assert_eq!(rows.len(), 2, "the two unpublished rows: {rows:?}");
        assert_eq!(
            rows[0].traceparent.as_deref(),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_eq!(rows[1].traceparent, None);
        for row in &rows {
            let message: Value =
                serde_json::from_str(&row.payload).map_err(|e| Error::Corrupt(e.to_string()))?;
            assert_eq!(message["status"], "rejected");
            assert_eq!(row.traceparent.as_deref(), message["traceparent"].as_str());
        }
        Ok(())
    }

    /// Migration 0009 splits `operations` into identity and state: every operation reads
    /// back through the `operations` view exactly as the table held it, the state rows
    /// know which operations hold their entity (writes, not reads, not compensations),
    /// and the one-write-in-flight index still refuses a second write in flight.
    #[cfg(feature = "integration")]
    #[tokio::test]
    async fn operations_read_back_the_same_after_the_split_into_identity_and_state() -> Result<()> {
        let (ledger, _schema) = ledger_before(9).await?;
        let pool = ledger.pool();
        // (event id, class, status, compensates the operation of): on one entity, a write
        // in flight, a read in flight, a settled write and its compensation in flight.
        let rows = [
            ("w", "irreversible", "dispatched", None),
            ("r", "read", "dispatched", None),
            ("done", "external_idempotent", "completed_success", None),
            ("undo", "irreversible", "dispatched", Some("done")),
        ];
        for (event, class, status, undoes) in rows {
            sqlx::query(
                "INSERT INTO operations (operation_id, namespace, idempotency_key, key_components, \
                 args_fingerprint, event_id, tool, entity_type, entity_id, entity_key, \
                 canonical_args, side_effect_class, status, attempt_count, lease_owner, \
                 lease_expires_at, lease_epoch, result, error, compensates, result_seq, \
                 created_at, updated_at, ambiguous_since) \
                 VALUES ($1, 'default', 'key:' || $2, '{\"k\": 1}', 'fp', $2, 'pay', 'order', 'o1', \
                 'default:order:o1', '{\"amount\": \"1.00\"}', $3, $4, 2, 'worker-1', \
                 now() + interval '1 minute', 3, '{\"ok\": true}', NULL, \
                 (SELECT operation_id FROM operations WHERE event_id = $5), 4, now(), now(), now())",
            )
            .bind(Uuid::now_v7())
            .bind(event)
            .bind(class)
            .bind(status)
            .bind(undoes)
            .execute(pool)
            .await?;
        }
        let everything = "SELECT jsonb_agg(to_jsonb(o) ORDER BY operation_id) FROM operations o";
        let before: Value = sqlx::query_scalar(everything).fetch_one(pool).await?;

        ledger.migrate().await?;
        let after: Value = sqlx::query_scalar(everything).fetch_one(pool).await?;
        assert_eq!(after, before, "the view reads what the table held");
        let holders: Vec<(String, String)> = sqlx::query_as(
            "SELECT i.event_id, s.exclusive_entity FROM operation_identity i \
             JOIN operation_state s USING (operation_id) ORDER BY i.event_id",
        )
        .fetch_all(pool)
        .await?;
        let holders: Vec<(&str, &str)> = holders
            .iter()
            .map(|(event, entity)| (event.as_str(), entity.as_str()))
            .collect();
        let entity = "default:order:o1";
        assert_eq!(
            holders,
            [("done", entity), ("r", ""), ("undo", ""), ("w", entity)]
        );
        let refused = |statement: String, constraint: &'static str| async move {
            let outcome = sqlx::query(&statement).execute(pool).await;
            assert!(
                matches!(&outcome, Err(sqlx::Error::Database(db)) if db.constraint() == Some(constraint)),
                "{statement}: {outcome:?}"
            );
        };
        // A second write in flight on the entity.
        refused(
            "UPDATE operation_state SET status = 'dispatched' WHERE operation_id = \
             (SELECT operation_id FROM operation_identity WHERE event_id = 'done')"
                .into(),
            crate::error::ENTITY_INDEX,
        )
        .await;
        // A state row that lets its write hold nothing or another entity, or that says
        // another tool than its identity.
        for change in [
            "exclusive_entity = ''",
            "exclusive_entity = 'default:order:o2'",
            "tool = 'refund'",
        ] {
            refused(
                format!(
                    "UPDATE operation_state SET {change} WHERE operation_id = \
                     (SELECT operation_id FROM operation_identity WHERE event_id = 'w')"
                ),
                "operation_state_identity",
            )
            .await;
        }
        // An identity turned into a read under its state row, and one without a state row.
        refused(
            "UPDATE operation_identity SET side_effect_class = 'read' WHERE event_id = 'w'".into(),
            "operation_state_identity",
        )
        .await;
        refused(
            "INSERT INTO operation_identity (operation_id, namespace, idempotency_key, \
             key_components, args_fingerprint, event_id, tool, entity_type, entity_id, \
             entity_key, canonical_args, side_effect_class, created_at) \
             VALUES (gen_random_uuid(), 'default', 'key:alone', '{}', 'fp', 'alone', 'pay', \
             'order', 'o3', 'default:order:o3', '{}', 'irreversible', now())"
                .into(),
            "operation_identity_has_state",
        )
        .await;
        // The ledger reads the split tables.
        let id: Uuid =
            sqlx::query_scalar("SELECT operation_id FROM operations WHERE event_id = 'w'")
                .fetch_one(pool)
                .await?;
        let op = ledger.operation(id).await?.expect("the operation");
        assert_eq!(
            (op.status, op.attempt_count, op.lease_epoch),
            (Status::Dispatched, 2, 3)
        );
        Ok(())
    }
}
