//! Helpers shared by the process tests of the `opgate` binary.

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// A child process that is killed and reaped when dropped, so a failing test leaves no
/// `opgate` process behind.
pub struct Reaped(pub Child);

impl Reaped {
    /// Spawns the command.
    pub fn spawn(command: &mut Command) -> Self {
        Self(command.spawn().expect("spawn opgate"))
    }
}

impl Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        // Already exited when the test got this far; otherwise stop it now.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends SIGTERM and waits (at most 30 s) for the process to exit; returns its status.
pub fn terminate(child: &mut Child, what: &str) -> ExitStatus {
    let pid = child.id().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(sent.success(), "kill -TERM {pid}");
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what} did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
