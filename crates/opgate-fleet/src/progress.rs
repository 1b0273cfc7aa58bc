//! A refreshing status line on a terminal, a plain line every two seconds otherwise.

use std::io::{IsTerminal as _, Write as _};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A progress line.
pub struct Progress {
    tty: bool,
    last: Mutex<Option<Instant>>,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    /// A progress line on stdout.
    pub fn new() -> Self {
        Self {
            tty: std::io::stdout().is_terminal(),
            last: Mutex::new(None),
        }
    }

    /// Shows `text` (rate-limited when stdout is not a terminal).
    pub fn line(&self, text: &str) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let every = if self.tty {
            Duration::ZERO
        } else {
            Duration::from_secs(2)
        };
        if last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        *last = Some(Instant::now());
        let mut out = std::io::stdout().lock();
        if self.tty {
            let _ = write!(out, "\r\x1b[2K{text}");
        } else {
            let _ = writeln!(out, "{text}");
        }
        let _ = out.flush();
    }

    /// Ends the line.
    pub fn done(&self) {
        if self.tty {
            println!();
        }
    }
}
