//! Shared fixtures for the storage conformance suite: a registry, proposal builders,
//! and fresh ledgers (a SQLite file per test; a PostgreSQL schema per test).

#![allow(dead_code, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use opgate_core::{Delivery, IngestItem, Limits, Proposal, Registry, Source};
use opgate_store::{ClaimRequest, Ledger, SqliteLedger};
use serde_json::{Value, json};
use uuid::Uuid;

pub const TOOLS: &str = r#"
[[tools]]
name = "pay"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"

[[tools]]
name = "email"
side_effect_class = "external_non_idempotent"
[tools.args]
to = "email"

[[tools]]
name = "lookup"
side_effect_class = "read"

[[tools]]
name = "ticket"
side_effect_class = "external_idempotent"
key_strategy = "workflow_step"

# A misconfigured twin: same key template as `pay`. The ledger must not merge the two.
[[tools]]
name = "pay_twin"
side_effect_class = "irreversible"
entity = "order"
key = "payment:{entity}:capture:{args.amount}:{args.currency}"
[tools.args]
amount = "money_minor"
currency = "upper"

[[tools]]
name = "refund"
side_effect_class = "irreversible"
approval = "required"

# One notification per workflow step; the same one to a user within an hour is suppressed
# across workflows.
[[tools]]
name = "notify"
side_effect_class = "external_non_idempotent"
entity = "user"
key_strategy = "workflow_step"
dedupe_window = "1h"
[tools.args]
to = "email"

# Two ways to make a customer whole; only one per account per hour.
[[tools]]
name = "refund_acct"
side_effect_class = "irreversible"
entity = "account"
key = "refund:{entity}:{args.amount}"
required = ["amount"]
exclusive_group = { name = "make_good", window = "1h" }

[[tools]]
name = "credit_acct"
side_effect_class = "irreversible"
entity = "account"
key = "credit:{entity}:{args.amount}"
required = ["amount"]
exclusive_group = { name = "make_good", window = "1h" }

# A charge that can be undone.
[[tools]]
name = "charge"
side_effect_class = "irreversible"
entity = "order"
key = "charge:{entity}:{args.amount}"
required = ["amount"]
[tools.compensation]
tool = "uncharge"
args = { charge_id = "{result.charge_id}" }

[[tools]]
name = "uncharge"
side_effect_class = "irreversible"
entity = "order"
key = "uncharge:{entity}:{args.charge_id}"
required = ["charge_id"]
"#;

/// A ledger under test plus raw SQL access to its database, for schema-level checks.
pub struct Harness {
    pub ledger: Arc<dyn Ledger>,
    pub raw: Raw,
}

pub enum Raw {
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "integration")]
    Postgres(sqlx::PgPool),
}

impl Harness {
    /// Executes raw SQL (with `$1`-style text only, no binds) and returns rows affected.
    pub async fn exec(&self, sql: &str) -> Result<u64, sqlx::Error> {
        match &self.raw {
            Raw::Sqlite(pool) => sqlx::query(sql)
                .execute(pool)
                .await
                .map(|r| r.rows_affected()),
            #[cfg(feature = "integration")]
            Raw::Postgres(pool) => sqlx::query(sql)
                .execute(pool)
                .await
                .map(|r| r.rows_affected()),
        }
    }

    /// Counts rows of a query returning one integer.
    pub async fn count(&self, sql: &str) -> i64 {
        match &self.raw {
            Raw::Sqlite(pool) => sqlx::query_scalar(sql)
                .fetch_one(pool)
                .await
                .expect("count"),
            #[cfg(feature = "integration")]
            Raw::Postgres(pool) => sqlx::query_scalar(sql)
                .fetch_one(pool)
                .await
                .expect("count"),
        }
    }

    /// The one text value a query returns.
    pub async fn text(&self, sql: &str) -> String {
        match &self.raw {
            Raw::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect("text"),
            #[cfg(feature = "integration")]
            Raw::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await.expect("text"),
        }
    }

    /// A second ledger on the same database, as another process would open it.
    pub async fn another_process(&self) -> Arc<dyn Ledger> {
        match &self.raw {
            Raw::Sqlite(pool) => Arc::new(
                SqliteLedger::open(&pool.connect_options().get_filename().display().to_string())
                    .await
                    .expect("open sqlite again"),
            ),
            #[cfg(feature = "integration")]
            Raw::Postgres(pool) => Arc::new(
                opgate_store::PgLedger::connect_with((*pool.connect_options()).clone())
                    .await
                    .expect("connect again"),
            ),
        }
    }

    /// The table an operation's state is written to: on PostgreSQL its own narrow table
    /// (migration 0009; `operations` is a view there), on SQLite the one table.
    pub fn state_table(&self) -> &'static str {
        match self.dialect() {
            "sqlite" => "operations",
            _ => "operation_state",
        }
    }

    /// The table an operation's identity (what it is, written once) is written to.
    pub fn identity_table(&self) -> &'static str {
        match self.dialect() {
            "sqlite" => "operations",
            _ => "operation_identity",
        }
    }

    /// Sets the status of the operations `which` names (a condition on the columns of
    /// `operations`) by hand, past the ledger's checks: a schema-level check.
    pub async fn set_status(&self, status: &str, which: &str) -> Result<u64, sqlx::Error> {
        self.exec(&format!(
            "UPDATE {} SET status = '{status}' \
             WHERE operation_id IN (SELECT operation_id FROM operations WHERE {which})",
            self.state_table()
        ))
        .await
    }

    /// `sqlite` or `postgres`.
    pub fn dialect(&self) -> &'static str {
        match &self.raw {
            Raw::Sqlite(_) => "sqlite",
            #[cfg(feature = "integration")]
            Raw::Postgres(_) => "postgres",
        }
    }
}

pub async fn sqlite() -> Harness {
    let path = std::env::temp_dir().join(format!("opgate-conformance-{}.db", Uuid::now_v7()));
    let url = format!("sqlite://{}", path.display());
    let ledger = SqliteLedger::open(&url).await.expect("open sqlite");
    ledger.migrate().await.expect("migrate sqlite");
    let raw = sqlx::SqlitePool::connect(&url).await.expect("raw pool");
    Harness {
        ledger: Arc::new(ledger),
        raw: Raw::Sqlite(raw),
    }
}

#[cfg(feature = "integration")]
pub async fn postgres() -> Harness {
    use sqlx::postgres::PgConnectOptions;
    use std::str::FromStr;

    let url = postgres_url().await;
    let schema = format!("t_{}", Uuid::now_v7().simple());
    let admin = sqlx::PgPool::connect(&url)
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(&format!("CREATE SCHEMA {schema}"))
        .execute(&admin)
        .await
        .expect("create schema");
    let options = PgConnectOptions::from_str(&url)
        .expect("url")
        .options([("search_path", schema.as_str())]);
    let ledger = opgate_store::PgLedger::connect_with(options.clone())
        .await
        .expect("connect");
    ledger.migrate().await.expect("migrate");
    let raw = sqlx::PgPool::connect_with(options).await.expect("raw pool");
    Harness {
        ledger: Arc::new(ledger),
        raw: Raw::Postgres(raw),
    }
}

/// `OPGATE_TEST_DATABASE_URL`, or a testcontainers PostgreSQL when a Docker engine
/// answers; otherwise the test fails naming the variable.
#[cfg(feature = "integration")]
async fn postgres_url() -> String {
    use testcontainers_modules::postgres::Postgres;
    use testcontainers_modules::testcontainers::ContainerAsync;
    use testcontainers_modules::testcontainers::runners::AsyncRunner;
    use tokio::sync::OnceCell;

    if let Ok(url) = std::env::var("OPGATE_TEST_DATABASE_URL") {
        return url;
    }
    static CONTAINER: OnceCell<ContainerAsync<Postgres>> = OnceCell::const_new();
    let container = CONTAINER
        .get_or_try_init(|| async { Postgres::default().start().await })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "set OPGATE_TEST_DATABASE_URL (e.g. postgres://postgres@127.0.0.1:5432/test); \
                 no Docker engine answered for testcontainers either: {e}"
            )
        });
    let port = container
        .get_host_port_ipv4(5432)
        .await
        .expect("mapped port");
    format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres")
}

pub fn registry() -> Registry {
    Registry::from_toml(TOOLS).expect("valid registry")
}

pub fn delivery(offset: i64) -> Delivery {
    Delivery {
        principal: None,
        source: Source::Kafka {
            topic: "opgate.proposals".into(),
            partition: 0,
            offset,
        },
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    }
}

/// A proposal as an ingest item.
pub fn item(event_id: &str, tool: &str, entity: (&str, &str), args: Value) -> IngestItem {
    item_with(event_id, tool, entity, args, json!({}))
}

/// A proposal with extra top-level fields (workflow_id, step, ...).
pub fn item_with(
    event_id: &str,
    tool: &str,
    entity: (&str, &str),
    args: Value,
    extra: Value,
) -> IngestItem {
    let mut value = json!({
        "event_id": event_id, "namespace": "acme", "tool": tool,
        "entity": {"type": entity.0, "id": entity.1}, "args": args,
    });
    for (k, v) in extra.as_object().expect("object") {
        value[k] = v.clone();
    }
    let proposal = Proposal::from_value(value, &Limits::default()).expect("valid proposal");
    IngestItem::from_proposal(&registry(), &proposal, delivery(0))
}

/// A payment on an order: each distinct amount is a distinct operation.
pub fn pay(event_id: &str, order: &str, amount: &str) -> IngestItem {
    item(
        event_id,
        "pay",
        ("order", order),
        json!({"amount": amount, "currency": "usd"}),
    )
}

pub fn claim_request(owner: &str, lease: Duration, limit: usize) -> ClaimRequest {
    ClaimRequest {
        owner: owner.into(),
        lease,
        limit,
        ..Default::default()
    }
}
