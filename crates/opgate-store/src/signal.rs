//! Wake-ups after commits: a worker that polls the ledger (the dispatcher, the results
//! relay) also waits on a [`Changes`] so that work committed by another task is picked
//! up at once instead of at its next poll.
//!
//! A signal only says "the ledger changed, look again"; it carries no data, may come
//! twice, and may be lost (a listener reconnecting): workers keep their poll, so a lost
//! signal costs latency, never work. In one process the ledger fires the signal after
//! each write transaction commits; across processes the PostgreSQL ledger sends a
//! `NOTIFY` inside the transaction (delivered on commit) and each process's listener
//! turns it into the same signal.

use std::sync::Arc;

use tokio::sync::watch;

/// The signal source a ledger fires after its write transactions commit: every commit
/// wakes [`Changes`] from [`Signal::subscribe`] (the relay: most commits leave results to
/// publish); only a commit that may have left an operation claimable wakes those from
/// [`Signal::subscribe_claimable`] (the dispatcher: a commit that made nothing claimable,
/// such as an ingest that claimed all it created, is not worth a claim).
#[derive(Debug, Clone)]
pub(crate) struct Signal {
    any: Arc<watch::Sender<()>>,
    claimable: Arc<watch::Sender<()>>,
}

impl Signal {
    pub(crate) fn new() -> Self {
        Self {
            any: Arc::new(watch::Sender::new(())),
            claimable: Arc::new(watch::Sender::new(())),
        }
    }

    /// Something changed that may have made any kind of work (another process's
    /// commit, a listener that reconnected).
    pub(crate) fn fire(&self) {
        self.commit(true);
    }

    /// A write transaction committed; `claimable`: it may have left an operation
    /// claimable now.
    pub(crate) fn commit(&self, claimable: bool) {
        self.any.send_replace(());
        if claimable {
            self.claimable.send_replace(());
        }
    }

    pub(crate) fn subscribe(&self) -> Changes {
        Changes(Some(self.any.subscribe()))
    }

    pub(crate) fn subscribe_claimable(&self) -> Changes {
        Changes(Some(self.claimable.subscribe()))
    }
}

/// A worker's view of the signal: [`Changes::changed`] returns once the ledger changed
/// after the last [`Changes::seen`] (or the last `changed`).
#[derive(Debug)]
pub struct Changes(Option<watch::Receiver<()>>);

impl Changes {
    /// A view that never fires (workers without a ledger signal: they poll).
    pub fn never() -> Self {
        Self(None)
    }

    /// Marks every change so far as seen: call it before looking at the ledger, so a
    /// commit that lands while looking wakes the next wait.
    pub fn seen(&mut self) {
        if let Some(rx) = &mut self.0 {
            rx.borrow_and_update();
        }
    }

    /// Waits for a change not yet seen; never returns when the signal is gone.
    pub async fn changed(&mut self) {
        if let Some(rx) = &mut self.0
            && rx.changed().await.is_ok()
        {
            return;
        }
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_change_during_a_look_wakes_the_next_wait() {
        let signal = Signal::new();
        let mut changes = signal.subscribe();
        changes.seen();
        signal.fire(); // lands while the worker looks at the ledger
        tokio::time::timeout(Duration::from_secs(1), changes.changed())
            .await
            .expect("the change made while looking wakes the wait");
        // Seen now: the next wait sleeps until another change.
        let idle = tokio::time::timeout(Duration::from_millis(50), changes.changed()).await;
        assert!(idle.is_err(), "no change, no wake-up");
    }

    #[tokio::test]
    async fn a_commit_that_left_nothing_claimable_wakes_only_the_any_change_view() {
        let signal = Signal::new();
        let (mut any, mut claimable) = (signal.subscribe(), signal.subscribe_claimable());
        any.seen();
        claimable.seen();
        signal.commit(false);
        let short = Duration::from_millis(50);
        assert!(tokio::time::timeout(short, any.changed()).await.is_ok());
        assert!(
            tokio::time::timeout(short, claimable.changed())
                .await
                .is_err(),
            "nothing claimable, no claim"
        );
        signal.commit(true);
        assert!(
            tokio::time::timeout(short, claimable.changed())
                .await
                .is_ok()
        );
        // Another process's change may be anything: both wake.
        signal.fire();
        assert!(tokio::time::timeout(short, any.changed()).await.is_ok());
        assert!(
            tokio::time::timeout(short, claimable.changed())
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn a_dropped_signal_never_wakes() {
        let signal = Signal::new();
        let mut changes = signal.subscribe();
        drop(signal);
        let woke = tokio::time::timeout(Duration::from_millis(50), changes.changed()).await;
        assert!(woke.is_err(), "a gone signal must not spin the worker");
        let mut never = Changes::never();
        let woke = tokio::time::timeout(Duration::from_millis(20), never.changed()).await;
        assert!(woke.is_err());
    }
}
