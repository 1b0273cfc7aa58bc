//! The loop the dispatcher and the reconciler share: claim as many operations as there
//! is room for, handle each under a concurrency permit, pause when there is nothing to do
//! (or back off after a failed claim), and on cancellation stop claiming and wait until
//! everything in flight has been handled and recorded. A pause ends early when a handled
//! operation finishes: its permits are free again, so there may be room to claim (a
//! claim that found no room must not cost an idle pause per wave of work), and when the
//! ledger signals a commit that may have made work ([`Changes`]). Each claim says which of
//! these can be worth a new claim ([`Next`]): a claim that took less than it had room for
//! waits for a change only, since room given back finds nothing more to claim.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use opgate_store::Changes;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;

/// What a claim round says about the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// It took all it asked for: more may be waiting; claim again at once.
    Now,
    /// Room bounded it (permits, places ahead): claim again when room is given back or
    /// the ledger changes.
    Room,
    /// It took less than it had room for: what was claimable is claimed; claim again when
    /// the ledger changes (or the idle pause ends). Measured: with every call's end waking
    /// a claim, ~70% of a dispatcher's claims at 1,000 operations/s found nothing
    /// (BENCHMARKS.md).
    Change,
}

/// One claim: the claims and what it says about the next ([`Next`]).
pub(crate) struct Round<T> {
    pub claims: Vec<T>,
    pub next: Next,
}

/// How a worker claims and handles.
pub(crate) struct Loop {
    /// For log lines.
    pub name: &'static str,
    /// Bounds the operations handled at once.
    pub permits: Arc<Semaphore>,
    /// Most operations per claim.
    pub batch: usize,
    /// Pause when there is nothing to claim.
    pub idle: Duration,
    /// Ends a pause when the ledger changed ([`Changes::never`]: poll only).
    pub changes: Changes,
    /// Ends a pause when room to claim was given back: the loop notifies it when a
    /// handled operation finishes, a handler when it gives back a permit of its own early.
    pub freed: Arc<Notify>,
}

impl Loop {
    /// Runs until `cancel`, then drains. Claims made elsewhere and handed in on `handed`
    /// (claim at ingest, [`opgate_store::handoff`]) are handled as they arrive, each under
    /// a permit as the loop's own; the drain also waits until every sender of `handed` is
    /// gone and what they sent is handled.
    pub(crate) async fn run<T, C, CF, H, HF>(
        mut self,
        cancel: CancellationToken,
        mut claim: C,
        handle: H,
        handed: Option<Handed<T>>,
    ) where
        T: Send + 'static,
        C: FnMut(usize) -> CF,
        CF: Future<Output = opgate_store::Result<Round<T>>>,
        H: Fn(T) -> HF + Clone + Send + 'static,
        HF: Future<Output = ()> + Send + 'static,
    {
        let tracker = TaskTracker::new();
        if let Some(mut handed) = handed {
            let (tracker2, permits, freed, handle) = (
                tracker.clone(),
                self.permits.clone(),
                self.freed.clone(),
                handle.clone(),
            );
            tracker.spawn(async move {
                while let Some(batch) = handed.recv().await {
                    for c in batch {
                        let Ok(permit) = permits.clone().acquire_owned().await else {
                            return;
                        };
                        spawn_handled(&tracker2, handle(c), permit, freed.clone());
                    }
                }
            });
        }
        let mut backoff = Duration::from_millis(50);
        while !cancel.is_cancelled() {
            let room = self.permits.available_permits().min(self.batch);
            // A commit from here on wakes the pause below.
            self.changes.seen();
            // How long to pause, and whether room given back ends the pause.
            let (pause, next) = if room == 0 {
                (self.idle, Next::Room)
            } else {
                match claim(room).await {
                    Ok(Round { claims, next }) => {
                        if !claims.is_empty() {
                            backoff = Duration::from_millis(50);
                        }
                        for c in claims {
                            let Ok(permit) = self.permits.clone().acquire_owned().await else {
                                break;
                            };
                            spawn_handled(&tracker, handle(c), permit, self.freed.clone());
                        }
                        let pause = match next {
                            Next::Now => Duration::ZERO,
                            Next::Room | Next::Change => self.idle,
                        };
                        (pause, next)
                    }
                    Err(e) => {
                        warn!(worker = self.name, error = %e, "claim failed");
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        (backoff, Next::Room)
                    }
                }
            };
            if !pause.is_zero() {
                // With no room, new work cannot be claimed anyway: wait for room only.
                let changed = async {
                    if room == 0 {
                        std::future::pending().await
                    } else {
                        self.changes.changed().await
                    }
                };
                // With room left over, room given back cannot be worth a claim.
                let freed = async {
                    if next == Next::Change {
                        std::future::pending().await
                    } else {
                        self.freed.notified().await
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = freed => {}
                    () = changed => {}
                    () = cancel.cancelled() => {}
                }
            }
        }
        tracker.close();
        tracker.wait().await;
    }
}

/// Claims handed to the loop from outside it (claim at ingest).
pub(crate) type Handed<T> = mpsc::UnboundedReceiver<Vec<T>>;

/// Handles one claim under `permit`, then gives the permit back and says room was freed.
fn spawn_handled(
    tracker: &TaskTracker,
    work: impl Future<Output = ()> + Send + 'static,
    permit: OwnedSemaphorePermit,
    freed: Arc<Notify>,
) {
    tracker.spawn(async move {
        work.await;
        drop(permit);
        freed.notify_one();
    });
}

/// One round without the loop (tests): handle every claim and wait for all of them.
pub(crate) async fn handle_all<T, H, HF>(claims: Vec<T>, handle: H) -> usize
where
    H: Fn(T) -> HF,
    HF: Future<Output = ()> + Send + 'static,
{
    let n = claims.len();
    let mut tasks = tokio::task::JoinSet::new();
    for c in claims {
        tasks.spawn(handle(c));
    }
    while tasks.join_next().await.is_some() {}
    n
}
