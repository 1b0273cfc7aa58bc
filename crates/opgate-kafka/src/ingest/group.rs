//! Group commit of ingest across partitions: the lanes' batches that are ready while the
//! ledger is busy with earlier ones go into it together, in one transaction.
//!
//! A lane hands its batch to [`Group::ingest`] and waits for its own outcomes. The
//! committer takes the oldest batch waiting and, with it, every other batch already
//! waiting, up to `max_messages` proposals, and ingests them in one transaction, one group
//! in the ledger at a time, a second beside it only once it has been there for
//! [`SECOND_AFTER`] ([`IN_FLIGHT`] at most). Nothing waits for a group to fill: a
//! batch that finds the ledger idle goes alone, at once; batches gather only while earlier
//! groups are being committed, which is when one transaction instead of several pays
//! (at a steady rate every partition's lane hands in what has arrived while its
//! previous batch was stored).
//!
//! A failed group is each batch's own to settle: every lane of the group gets no answer
//! ([`Group::ingest`] returns `None`) and ingests its batch alone, at once, on the lane's
//! usual path (retried while the ledger is down, a refused record split out), so a
//! refusal or a stall stays its partition's. A group waits at most [`LOCK_WAIT`] for a
//! lock another transaction holds: one batch held up by a lock holds up the rest of its
//! group only that long, and no batch keeps one of the [`IN_FLIGHT`] places, which every
//! partition shares, for longer (alone, outside the group, it waits as long as it must).
//! A panic in the ledger call drops the group's answers, and the lanes waiting for them
//! panic in turn: the member stops, as it did when a lane's own ledger call panicked.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opgate_core::IngestItem;
use opgate_store::{Handoff, IngestOutcome, Ledger, SharedLedger};
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::debug;

/// Groups in the ledger at once, at most: while one commits, the next gathers. A second
/// goes in only beside a group that has been in the ledger for [`SECOND_AFTER`] (one that
/// waits for a lock, or a ledger that is slow; [`place`]): as long as groups commit sooner, one
/// at a time leaves the ledger's time to dispatch, which is where a backlog's operations
/// wait (two at once ingested a third faster alone, but made the whole path ~5% slower and
/// its CPU per operation ~7% higher on this 2-core host; BENCHMARKS.md, 2026-12-04).
pub(super) const IN_FLIGHT: usize = 2;

/// How long the groups in the ledger have been there before another may join them.
pub(super) const SECOND_AFTER: Duration = Duration::from_millis(250);

/// The longest a group waits for a lock.
pub(super) const LOCK_WAIT: Duration = Duration::from_secs(1);

/// A batch's outcomes, one per proposal, in order.
pub(super) type Answer = Vec<IngestOutcome>;

/// One lane's batch, and where its answer goes (with the batch, handed back).
struct Request {
    items: Vec<IngestItem>,
    reply: oneshot::Sender<(Vec<IngestItem>, Option<Answer>)>,
}

/// The lanes' side: hands batches to the committer.
#[derive(Clone)]
pub(super) struct Group {
    tx: mpsc::UnboundedSender<Request>,
}

/// The committer's side, started by [`Committer::run`] on the worker's runtime.
pub(super) struct Committer {
    rx: mpsc::UnboundedReceiver<Request>,
    max_messages: usize,
    /// A dispatcher in this process that takes claims made at ingest.
    pub(super) handoff: Option<Arc<dyn Handoff>>,
}

/// A group commit for batches of at most `max_messages` proposals in all.
pub(super) fn group_commit(max_messages: usize) -> (Group, Committer) {
    let (tx, rx) = mpsc::unbounded_channel();
    let committer = Committer {
        rx,
        max_messages,
        handoff: None,
    };
    (Group { tx }, committer)
}

impl Group {
    /// Ingests `items` with whatever other batches are waiting. Returns the items and the
    /// batch's outcomes; `None` when its group failed: then ingest it alone. Panics when
    /// the group ended without an answer (its ledger call panicked) or the committer is
    /// gone.
    pub(super) async fn ingest(&self, items: Vec<IngestItem>) -> (Vec<IngestItem>, Option<Answer>) {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Request { items, reply }).is_err() {
            panic!("the ingest group commit has stopped");
        }
        match answer.await {
            Ok(answer) => answer,
            Err(_) => panic!("an ingest group ended without an answer: its ledger call panicked"),
        }
    }
}

impl Committer {
    /// Commits groups until every [`Group`] handle is dropped.
    pub(super) async fn run(mut self, ledger: SharedLedger) {
        // When each group now in the ledger went in; a group takes its own out when done.
        let in_ledger: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
        let done = Arc::new(Notify::new());
        let mut next = None;
        for id in 0u64.. {
            let first = match next.take() {
                Some(request) => request,
                None => match self.rx.recv().await {
                    Some(request) => request,
                    None => return,
                },
            };
            // While the groups in the ledger commit, the next one gathers.
            loop {
                let started: Vec<Instant> = lock(&in_ledger).iter().map(|(_, at)| *at).collect();
                match place(&started, Instant::now()) {
                    Place::Now => break,
                    Place::In(wait) => {
                        tokio::select! {
                            () = tokio::time::sleep(wait) => {}
                            () = done.notified() => {}
                        }
                    }
                    Place::WhenOneEnds => done.notified().await,
                }
            }
            lock(&in_ledger).push((id, Instant::now()));
            let mut size = first.items.len();
            let mut group = vec![first];
            while let Ok(request) = self.rx.try_recv() {
                if size + request.items.len() > self.max_messages {
                    next = Some(request);
                    break;
                }
                size += request.items.len();
                group.push(request);
            }
            // Out of the ledger however the commit ends (a panic unwinds through it, and a
            // task dropped unpolled drops it too).
            let out = Out(in_ledger.clone(), id, done.clone());
            let ledger = ledger.clone();
            let handoff = self.handoff.clone();
            tokio::spawn(async move {
                let _out = out;
                commit(ledger.as_ref(), handoff.as_deref(), group).await;
            });
        }
    }
}

/// When the next group may go into the ledger, given when each group now there went in.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// At once.
    Now,
    /// After this long (or sooner, when a group ends).
    In(Duration),
    /// When a group ends.
    WhenOneEnds,
}

/// The group commit's rule ([`IN_FLIGHT`], [`SECOND_AFTER`]): a group goes in at once when
/// the ledger has none, beside others only once every one of them has been there
/// `SECOND_AFTER`, and never beside `IN_FLIGHT` of them.
fn place(started: &[Instant], now: Instant) -> Place {
    let Some(youngest) = started.iter().max() else {
        return Place::Now;
    };
    if started.len() >= IN_FLIGHT {
        return Place::WhenOneEnds;
    }
    match (*youngest + SECOND_AFTER).checked_duration_since(now) {
        Some(wait) if !wait.is_zero() => Place::In(wait),
        _ => Place::Now,
    }
}

/// A group's place in the ledger, given back when dropped.
struct Out(Arc<Mutex<Vec<(u64, Instant)>>>, u64, Arc<Notify>);

impl Drop for Out {
    fn drop(&mut self) {
        lock(&self.0).retain(|(id, _)| *id != self.1);
        // One waiter (the committer): a permit is kept if it is not waiting yet.
        self.2.notify_one();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Ingests a group in one transaction and answers each of its batches. With a dispatcher
/// beside it that has room, the same transaction claims the ready operations it creates
/// for that dispatcher, which gets them once it committed ([`opgate_store::handoff`]).
async fn commit(ledger: &dyn Ledger, handoff: Option<&dyn Handoff>, group: Vec<Request>) {
    let batches = group.len();
    let mut lengths = Vec::with_capacity(batches);
    let mut replies = Vec::with_capacity(batches);
    let mut items = Vec::with_capacity(group.iter().map(|r| r.items.len()).sum());
    for request in group {
        lengths.push(request.items.len());
        replies.push(request.reply);
        items.extend(request.items);
    }
    let started = Instant::now();
    let offer = handoff.and_then(|h| h.offer(&tools_wanted(&items)));
    let mut claimed = 0;
    let result = match offer {
        // A failed transaction drops the offer, and its room goes back with it.
        Some(offer) => ledger
            .ingest_and_claim(&items, LOCK_WAIT, &offer.request)
            .await
            .map(|(outcomes, claims)| {
                claimed = claims.len();
                offer.take(claims);
                outcomes
            }),
        None => ledger.ingest_waiting_at_most(&items, LOCK_WAIT).await,
    };
    debug!(
        batches,
        proposals = items.len(),
        claimed,
        ms = started.elapsed().as_secs_f64() * 1000.0,
        error = result.as_ref().err().map(tracing::field::display),
        "ingest group"
    );
    let answers = split_answers(result, &lengths);
    // Hand each batch back with its answer, last batch first (split_off from the end).
    for ((reply, length), answer) in replies.into_iter().zip(lengths).zip(answers).rev() {
        let own = items.split_off(items.len() - length);
        // A lane stopped meanwhile (its partition revoked) no longer listens.
        let _ = reply.send((own, answer));
    }
}

/// How many proposals of each tool a batch holds: the room a claim at ingest could use.
fn tools_wanted(items: &[IngestItem]) -> BTreeMap<String, usize> {
    let mut wanted = BTreeMap::new();
    for item in items {
        if let IngestItem::Accepted(env) = item {
            *wanted.entry(env.tool.clone()).or_default() += 1;
        }
    }
    wanted
}

/// Each batch's answer from the group's result, in order: its own outcomes; `None` for
/// every batch of a failed group (or of outcomes that do not match the proposals one for
/// one): ingest alone.
fn split_answers(
    result: opgate_store::Result<Vec<IngestOutcome>>,
    lengths: &[usize],
) -> Vec<Option<Answer>> {
    let total: usize = lengths.iter().sum();
    match result {
        Ok(outcomes) if outcomes.len() == total => {
            let mut outcomes = outcomes.into_iter();
            lengths
                .iter()
                .map(|&n| Some(outcomes.by_ref().take(n).collect()))
                .collect()
        }
        _ => lengths.iter().map(|_| None).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opgate_store::IngestDecision;

    fn outcome(event_id: &str) -> IngestOutcome {
        IngestOutcome {
            event_id: event_id.into(),
            decision: IngestDecision::Accepted,
            inbox_hit: false,
            operation: None,
        }
    }

    fn ids(answer: &Option<Answer>) -> Vec<String> {
        match answer {
            Some(outcomes) => outcomes.iter().map(|o| o.event_id.clone()).collect(),
            None => vec!["alone".into()],
        }
    }

    #[test]
    fn a_group_goes_in_alone_or_beside_groups_that_have_been_in_long_enough() {
        let now = Instant::now();
        let ago = |ms: u64| now - Duration::from_millis(ms);
        assert_eq!(place(&[], now), Place::Now);
        // One young group: wait for it to have been there SECOND_AFTER (or to end).
        assert_eq!(
            place(&[ago(100)], now),
            Place::In(Duration::from_millis(150))
        );
        assert_eq!(place(&[ago(250)], now), Place::Now);
        assert_eq!(place(&[ago(900)], now), Place::Now);
        // Never beside IN_FLIGHT groups, however old.
        assert_eq!(place(&[ago(900), ago(800)], now), Place::WhenOneEnds);
    }

    #[test]
    fn after_a_slow_group_ends_the_next_waits_for_the_young_one_beside_it() {
        // A slow group let a second in; it has ended, the second has been there 50 ms:
        // the next group waits until that one has been there SECOND_AFTER.
        let now = Instant::now();
        let second = now - Duration::from_millis(50);
        assert_eq!(place(&[second], now), Place::In(Duration::from_millis(200)));
    }

    #[test]
    fn each_batch_gets_its_own_outcomes_in_order() {
        let result = Ok(["a1", "a2", "b1", "c1", "c2", "c3"].map(outcome).to_vec());
        let answers = split_answers(result, &[2, 1, 3]);
        assert_eq!(
            answers.iter().map(ids).collect::<Vec<_>>(),
            [vec!["a1", "a2"], vec!["b1"], vec!["c1", "c2", "c3"]]
        );
    }

    #[test]
    fn a_failed_group_sends_every_batch_alone() {
        let failed = || Err(opgate_store::Error::Corrupt("down".into()));
        assert_eq!(
            split_answers(failed(), &[2, 1])
                .iter()
                .map(ids)
                .collect::<Vec<_>>(),
            [vec!["alone"], vec!["alone"]]
        );
        // A group of one too: alone, outside the group, it may wait as long as it must.
        assert_eq!(
            split_answers(failed(), &[3])
                .iter()
                .map(ids)
                .collect::<Vec<_>>(),
            [vec!["alone"]]
        );
        // Outcomes that do not match the proposals one for one are not handed out.
        let short = Ok(["a1", "b1"].map(outcome).to_vec());
        assert_eq!(
            split_answers(short, &[2, 1])
                .iter()
                .map(ids)
                .collect::<Vec<_>>(),
            [vec!["alone"], vec!["alone"]]
        );
    }
}
