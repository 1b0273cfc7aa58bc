//! Schema versions: the migrations embedded in this build, and the check that refuses
//! to run on a database migrated by a newer build (or not migrated at all).

use sqlx::migrate::Migrator;

use crate::{Error, Result};

/// PostgreSQL migrations, embedded from `migrations/postgres`.
pub(crate) static POSTGRES: Migrator = sqlx::migrate!("../../migrations/postgres");
/// SQLite migrations, embedded from `migrations/sqlite`.
pub(crate) static SQLITE: Migrator = sqlx::migrate!("../../migrations/sqlite");

/// The schema version found against the one this build knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaStatus {
    /// Highest applied migration (0 when none).
    pub found: i64,
    /// Highest migration this build knows.
    pub known: i64,
}

impl SchemaStatus {
    pub(crate) fn new(found: Option<i64>, migrator: &Migrator) -> Self {
        let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
        Self {
            found: found.unwrap_or(0),
            known,
        }
    }

    /// True when the database is exactly at this build's version.
    pub fn is_current(&self) -> bool {
        self.found == self.known
    }

    /// `Ok` when current; otherwise the error that names what to do.
    pub fn require_current(&self) -> Result<()> {
        if self.found > self.known {
            Err(Error::SchemaTooNew {
                found: self.found,
                known: self.known,
            })
        } else if self.found < self.known {
            Err(Error::SchemaNotMigrated {
                found: self.found,
                known: self.known,
            })
        } else {
            Ok(())
        }
    }
}

/// The query for the applied version; the table is absent before the first migration.
pub(crate) const APPLIED_VERSION: &str = "SELECT MAX(version) FROM _sqlx_migrations WHERE success";
