//! Group commit of dispatch outcomes: calls that finish at about the same time are
//! recorded in one ledger transaction instead of one each.
//!
//! Each dispatch task hands its [`Recording`] to the recorder and waits for the answer,
//! so an attempt is still logged with the state it was recorded in, and a draining
//! dispatcher still waits until every call in flight is recorded. The recorder takes
//! whatever is queued (up to `record_batch`), writes it with [`opgate_store::Ledger::record`]
//! (each item fenced by its own epoch, failing alone), and retries the batch a few times
//! on a database error — an outcome the provider reported must not be lost to a hiccup;
//! if it still fails, the leases expire and the reconciler looks the keys up. A batch the
//! database refuses for good (a value it cannot hold) is written item by item, so one
//! outcome never holds up another's.

use std::time::Duration;

use opgate_core::Operation;
use opgate_store::{Recording, SharedLedger};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

type Reply = oneshot::Sender<Option<Operation>>;

/// The handle dispatch tasks record through.
#[derive(Clone)]
pub(crate) struct Recorder {
    tx: mpsc::UnboundedSender<(Recording, Reply)>,
}

impl Recorder {
    /// Starts the recorder task; it ends when every handle is dropped.
    pub(crate) fn start(ledger: SharedLedger, max_batch: usize) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(ledger, rx, max_batch));
        Self { tx }
    }

    /// Records one outcome (in a batch with others); the operation as recorded, or
    /// `None` when it was not (stale epoch, illegal transition, the ledger down).
    pub(crate) async fn record(&self, recording: Recording) -> Option<Operation> {
        let (reply, answer) = oneshot::channel();
        let id = recording.operation_id;
        if self.tx.send((recording, reply)).is_err() {
            warn!(operation_id = %id, "the recorder is gone; the lease will expire");
            return None;
        }
        answer.await.ok().flatten()
    }
}

async fn run(
    ledger: SharedLedger,
    mut rx: mpsc::UnboundedReceiver<(Recording, Reply)>,
    max_batch: usize,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (recordings, replies): (Vec<Recording>, Vec<Reply>) = batch.into_iter().unzip();
        let answers = match write(&ledger, &recordings).await {
            Written::All(results) => results,
            Written::OneByOne => {
                let mut results = Vec::with_capacity(recordings.len());
                for rec in &recordings {
                    let one = match write(&ledger, std::slice::from_ref(rec)).await {
                        Written::All(mut r) => r.pop().flatten(),
                        Written::OneByOne => {
                            warn!(operation_id = %rec.operation_id, "the ledger refuses this outcome; the lease will expire");
                            None
                        }
                    };
                    results.push(one);
                }
                results
            }
        };
        for (reply, answer) in replies.into_iter().zip(answers) {
            let _ = reply.send(answer);
        }
    }
}

enum Written {
    /// Per recording, the operation as recorded (or `None`).
    All(Vec<Option<Operation>>),
    /// The database refuses the batch for good: write the items one by one.
    OneByOne,
}

async fn write(ledger: &SharedLedger, recordings: &[Recording]) -> Written {
    let mut delay = Duration::from_millis(50);
    for _ in 0..6 {
        match ledger.record(recordings).await {
            Ok(results) => {
                return Written::All(
                    results
                        .into_iter()
                        .zip(recordings)
                        .map(|(result, rec)| match result {
                            Ok(op) => Some(op),
                            Err(e) => {
                                warn!(operation_id = %rec.operation_id, error = %e, "outcome not recorded");
                                None
                            }
                        })
                        .collect(),
                );
            }
            Err(e) if e.is_deterministic() && recordings.len() > 1 => return Written::OneByOne,
            Err(e) if e.is_deterministic() => {
                warn!(operation_id = %recordings[0].operation_id, error = %e, "the ledger refuses this outcome");
                return Written::All(vec![None]);
            }
            Err(e) => {
                warn!(count = recordings.len(), error = %e, "recording failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
    Written::All(vec![None; recordings.len()])
}
