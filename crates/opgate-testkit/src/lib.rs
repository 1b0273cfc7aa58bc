//! Fixtures shared by the test suites of opgate's crates.
//!
//! Every test gets a database of its own: a SQLite file in the temp dir by default, or,
//! with the `postgres` feature, a fresh schema in the PostgreSQL named by
//! `OPGATE_TEST_DATABASE_URL` (a testcontainers PostgreSQL when the variable is unset and
//! a Docker engine answers; otherwise the test fails naming the variable). The URL carries
//! the schema (`options=-csearch_path=...`), so a child process given the URL uses it too.
#![forbid(unsafe_code)]

pub mod provider;

use std::path::Path;

use opgate_store::SharedLedger;

/// A migrated ledger and raw SQL access to the same database.
pub struct TestLedger {
    /// The database URL (pass it to child processes).
    pub url: String,
    /// The ledger.
    pub ledger: SharedLedger,
    raw: Raw,
}

enum Raw {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
}

impl TestLedger {
    /// A fresh, migrated ledger.
    pub async fn new() -> Self {
        let dir = std::env::temp_dir();
        let url = database_url(&dir).await;
        opgate_store::migrate(&url)
            .await
            .expect("migrate the test ledger");
        let ledger = opgate_store::open(&url)
            .await
            .expect("open the test ledger");
        let raw = if url.starts_with("postgres") {
            Raw::Postgres(sqlx::PgPool::connect(&url).await.expect("raw pool"))
        } else {
            Raw::Sqlite(sqlx::SqlitePool::connect(&url).await.expect("raw pool"))
        };
        Self { url, ledger, raw }
    }

    /// The single integer a query returns (e.g. a `COUNT(*)`).
    pub async fn count(&self, sql: &str) -> i64 {
        match &self.raw {
            Raw::Sqlite(p) => sqlx::query_scalar(sql).fetch_one(p).await.expect("count"),
            Raw::Postgres(p) => sqlx::query_scalar(sql).fetch_one(p).await.expect("count"),
        }
    }
}

/// A fresh database URL: a SQLite file under `dir`, or a new PostgreSQL schema.
pub async fn database_url(dir: &Path) -> String {
    let name = uuid::Uuid::now_v7().simple().to_string();
    #[cfg(feature = "postgres")]
    {
        let _ = dir;
        let base = postgres_url().await;
        let schema = format!("t_{name}");
        let admin = sqlx::PgPool::connect(&base)
            .await
            .expect("connect to PostgreSQL");
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&admin)
            .await
            .expect("create a test schema");
        let sep = if base.contains('?') { '&' } else { '?' };
        format!("{base}{sep}options=-csearch_path%3D{schema}")
    }
    #[cfg(not(feature = "postgres"))]
    {
        format!(
            "sqlite://{}",
            dir.join(format!("opgate-test-{name}.db")).display()
        )
    }
}

/// `OPGATE_TEST_DATABASE_URL`, or a testcontainers PostgreSQL when a Docker engine answers.
#[cfg(feature = "postgres")]
pub async fn postgres_url() -> String {
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
