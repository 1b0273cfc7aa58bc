//! The store's error type.

use opgate_core::IllegalTransition;
use uuid::Uuid;

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A database error.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database has migrations this build does not know.
    #[error("schema version {found} is newer than this build knows ({known}); upgrade opgate")]
    SchemaTooNew {
        /// Version in the database.
        found: i64,
        /// Newest version this build knows.
        known: i64,
    },
    /// The database is missing migrations.
    #[error(
        "schema version {found} is older than this build needs ({known}); run `opgate migrate`"
    )]
    SchemaNotMigrated {
        /// Version in the database (0 when never migrated).
        found: i64,
        /// Version this build needs.
        known: i64,
    },
    /// No such operation.
    #[error("operation {0} not found")]
    NotFound(Uuid),
    /// The caller's lease was superseded (another worker claimed the operation since).
    #[error("operation {operation_id}: stale epoch {presented}, current is {current}")]
    StaleEpoch {
        /// Operation.
        operation_id: Uuid,
        /// Epoch presented.
        presented: i64,
        /// Epoch in the ledger.
        current: i64,
    },
    /// The state machine refuses the event.
    #[error("operation {operation_id}: {source}")]
    IllegalTransition {
        /// Operation.
        operation_id: Uuid,
        /// The refused transition.
        source: IllegalTransition,
    },
    /// A request the ledger's current contents contradict (e.g. a key already taken).
    #[error("conflict: {0}")]
    Conflict(String),
    /// A row the store wrote cannot be read back (a bug or manual edit).
    #[error("corrupt row: {0}")]
    Corrupt(String),
}

impl Error {
    /// Transient conflicts worth retrying the whole transaction for: serialization
    /// failure (40001), deadlock (40P01), a unique race (23505) on PostgreSQL, and a
    /// busy or locked database on SQLite.
    pub fn is_transient(&self) -> bool {
        let Self::Database(sqlx::Error::Database(db)) = self else {
            return matches!(self, Self::Database(sqlx::Error::PoolTimedOut));
        };
        match db.code().as_deref() {
            Some("40001" | "40P01" | "23505") => true,
            // SQLITE_BUSY (5), SQLITE_LOCKED (6) and their extended codes.
            Some(code) => code.parse::<i32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6)),
            None => false,
        }
    }
}

/// `Result` with the store's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
