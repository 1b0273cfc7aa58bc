//! Helpers shared by the process tests of the `opgate` binary.

#![allow(dead_code)]

use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

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
