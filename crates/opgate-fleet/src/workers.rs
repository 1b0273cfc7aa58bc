//! `opgate run` worker processes the eval starts, kills and restarts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// A set of `opgate run --roles ingest,relay,dispatch,reconcile` child processes.
pub struct Workers {
    exe: PathBuf,
    config: PathBuf,
    dir: PathBuf,
    sim_url: String,
    children: Vec<Option<Child>>,
    started: u32,
}

impl Workers {
    /// No process yet; [`Self::spawn`] starts one.
    pub fn new(exe: &Path, config: &Path, dir: &Path, sim_url: &str) -> Self {
        Self {
            exe: exe.to_owned(),
            config: config.to_owned(),
            dir: dir.to_owned(),
            sim_url: sim_url.to_owned(),
            children: Vec::new(),
            started: 0,
        }
    }

    /// Starts a worker in slot `slot` (a new slot when `slot` is the slot count).
    pub fn spawn(&mut self, slot: usize) -> anyhow::Result<()> {
        self.started += 1;
        let log = self.dir.join(format!("worker-{slot}-{}.log", self.started));
        let log = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
        let child = Command::new(&self.exe)
            .args([
                "run",
                "--roles",
                "ingest,relay,dispatch,reconcile",
                "--config",
            ])
            .arg(&self.config)
            .env("OPGATE_SIM_URL", &self.sim_url)
            // `OPGATE_WORKER_LOG` sets the workers' log filter (for a look inside a run).
            .env(
                "RUST_LOG",
                std::env::var("OPGATE_WORKER_LOG").unwrap_or_else(|_| "warn,rdkafka=error".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} run", self.exe.display()))?;
        if slot == self.children.len() {
            self.children.push(Some(child));
        } else {
            self.children[slot] = Some(child);
        }
        Ok(())
    }

    /// Slots in use.
    pub fn slots(&self) -> usize {
        self.children.len()
    }

    /// SIGKILL: the process gets no chance to finish anything.
    pub fn kill(&mut self, slot: usize) {
        if let Some(mut child) = self.children.get_mut(slot).and_then(Option::take) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits up to `grace` for a clean exit (SIGKILL after it).
    pub fn terminate(&mut self, slot: usize, grace: Duration) {
        let Some(mut child) = self.children.get_mut(slot).and_then(Option::take) else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops the worker in the last slot (SIGTERM) and gives the slot up.
    pub fn retire(&mut self, slot: usize) {
        self.terminate(slot, Duration::from_secs(30));
        if slot + 1 == self.children.len() {
            self.children.pop();
        }
    }

    /// Restarts any worker that exited on its own (a crash is a finding: it is counted).
    pub fn restart_exited(&mut self) -> anyhow::Result<u32> {
        let mut exited = 0;
        for slot in 0..self.children.len() {
            let gone = match &mut self.children[slot] {
                Some(child) => matches!(child.try_wait(), Ok(Some(_))),
                None => false,
            };
            if gone {
                exited += 1;
                self.children[slot] = None;
                self.spawn(slot)?;
            }
        }
        Ok(exited)
    }

    /// Stops every worker (SIGTERM with a grace period).
    pub fn stop_all(&mut self) {
        for slot in 0..self.children.len() {
            self.terminate(slot, Duration::from_secs(30));
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::as_mut) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
