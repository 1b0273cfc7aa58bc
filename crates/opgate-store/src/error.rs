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
    /// A database URL opgate cannot use.
    #[error("{0}")]
    Url(String),
    /// A row the store wrote cannot be read back (a bug or manual edit).
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// An ingest's claim would overtake an earlier write of the same entity that another
    /// transaction committed, waiting, while this one waited on a row or lock: the
    /// transaction is retried as a claim race is ([`Self::is_claim_race`]), and the retry
    /// sees that write and leaves the new one waiting behind it.
    #[error("a claim at ingest would overtake a write waiting on an entity ({0})")]
    ClaimOvertakes(String),
}

/// The unique index that keeps one write in flight per entity (both dialects).
pub(crate) const ENTITY_INDEX: &str = "operations_one_write_in_flight";

impl Error {
    /// Transient conflicts worth retrying the whole transaction for: serialization
    /// failure (40001), deadlock (40P01), a lost race on a unique index other than the
    /// per-entity one (23505) on PostgreSQL, a busy or locked database on SQLite, and a
    /// pool that timed out.
    ///
    /// A hit on the per-entity index is not transient by itself: it means another write
    /// on the entity is in flight, which may last minutes ([`Self::is_entity_busy`]).
    pub fn is_transient(&self) -> bool {
        let Self::Database(sqlx::Error::Database(db)) = self else {
            return matches!(self, Self::Database(sqlx::Error::PoolTimedOut));
        };
        match db.code().as_deref() {
            Some("40001" | "40P01") => true,
            Some("23505") => !self.is_entity_busy(),
            // SQLITE_BUSY (5), SQLITE_LOCKED (6) and their extended codes.
            Some(code) => code.parse::<i32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6)),
            None => false,
        }
    }

    /// The per-entity unique index refused the write: another write on the same entity
    /// holds it (dispatched, unresolved or compensating).
    pub fn is_entity_busy(&self) -> bool {
        let Self::Database(sqlx::Error::Database(db)) = self else {
            return false;
        };
        if db.constraint() == Some(ENTITY_INDEX) {
            return true;
        }
        // SQLite names the columns, not the index: `UNIQUE constraint failed: operations.entity_key`.
        db.code().as_deref() == Some("2067") && db.message().contains("operations.entity_key")
    }

    /// For a claim, a hit on the per-entity index is a race between two claimers of one
    /// entity's operations: retrying finds the entity held and claims something else.
    pub fn is_claim_race(&self) -> bool {
        self.is_transient() || self.is_entity_busy() || matches!(self, Self::ClaimOvertakes(_))
    }

    /// A person's command that would make a second write hold an entity (a compensation
    /// while another write on the entity is in flight) is a conflict to report, not an
    /// outage: 409, try again once the other write settles.
    pub fn entity_busy_is_a_conflict(self) -> Self {
        if self.is_entity_busy() {
            Self::Conflict(
                "another write on this entity is in flight; try again once it has settled".into(),
            )
        } else {
            self
        }
    }

    /// The database refused a value, and will refuse it every time: the input, not the
    /// database, is at fault, so retrying cannot help. PostgreSQL: class 22 (data
    /// exception: NUL in text, 22P05 in jsonb, 22001 too long, invalid encoding 22021),
    /// class 54 (program limit: 54000 an index row too large), 23502 (not null) and 23514
    /// (check). SQLite: TOOBIG (18), MISMATCH (20), CHECK (275), NOTNULL (1299).
    pub fn is_deterministic(&self) -> bool {
        let Self::Database(sqlx::Error::Database(db)) = self else {
            return false;
        };
        let Some(code) = db.code() else {
            return false;
        };
        code.starts_with("22")
            || code.starts_with("54")
            || matches!(
                code.as_ref(),
                "23502" | "23514" | "18" | "20" | "275" | "1299"
            )
    }
}

/// `Result` with the store's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
