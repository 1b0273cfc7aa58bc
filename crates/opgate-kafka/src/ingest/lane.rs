//! A partition's lane: its own batching, ledger retries and offset store, so one
//! partition's trouble (a ledger lock it waits on, a DLQ partition that is down) never
//! stops another's.
//!
//! The consumer loop ([`super::IngestWorker::run`]) hands each record to its partition's
//! lane over a bounded channel. A lane collects a batch ([`collect`]: what has arrived,
//! up to `max_messages`, waiting up to `max_wait` for more), dead-letters and ingests it ([`super::Shared::store_partition_batch`],
//! retried in place until it is stored), and only then stores and commits the
//! partition's offset. When a lane's channel is full, the loop parks the partition's
//! records and pauses the partition at the broker, so memory stays bounded and the other
//! partitions keep flowing; it resumes the partition once the lane has room.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{IngestContext, IngestStats, Record, Shared};

/// What the consumer loop holds for one partition.
pub(super) struct Lane {
    partition: i32,
    tx: mpsc::Sender<Record>,
    /// Records read while the lane was full, in order; the partition is paused meanwhile.
    parked: VecDeque<Record>,
    paused: bool,
    cancel: CancellationToken,
    pub(super) handle: JoinHandle<()>,
}

/// What a lane needs besides its records.
pub(super) struct LaneConfig {
    pub partition: i32,
    pub max_messages: usize,
    pub max_wait: Duration,
}

impl Lane {
    /// Starts the lane of a partition.
    pub(super) fn start(
        shared: Arc<Shared>,
        consumer: Arc<StreamConsumer<IngestContext>>,
        config: LaneConfig,
        cancel: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::channel(config.max_messages.saturating_mul(2).max(2));
        let partition = config.partition;
        let handle = tokio::spawn(run(shared, consumer, config, rx, cancel.clone()));
        Self {
            partition,
            tx,
            parked: VecDeque::new(),
            paused: false,
            cancel,
            handle,
        }
    }

    /// Hands a record to the lane, or parks it (and pauses the partition) while the lane
    /// is full. Records keep their order.
    pub(super) fn push(
        &mut self,
        record: Record,
        consumer: &StreamConsumer<IngestContext>,
        topic: &str,
    ) {
        if !self.parked.is_empty() {
            self.parked.push_back(record);
            return;
        }
        match self.tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(record) | TrySendError::Closed(record)) => {
                self.parked.push_back(record);
                self.pause(consumer, topic, true);
            }
        }
    }

    /// Moves parked records into the lane as it makes room; resumes the partition once
    /// none are left.
    pub(super) fn unpark(&mut self, consumer: &StreamConsumer<IngestContext>, topic: &str) {
        while let Some(record) = self.parked.pop_front() {
            match self.tx.try_send(record) {
                Ok(()) => {}
                Err(TrySendError::Full(record) | TrySendError::Closed(record)) => {
                    self.parked.push_front(record);
                    return;
                }
            }
        }
        if self.paused {
            self.pause(consumer, topic, false);
        }
    }

    fn pause(&mut self, consumer: &StreamConsumer<IngestContext>, topic: &str, pause: bool) {
        let partition = self.partition;
        let mut list = TopicPartitionList::new();
        list.add_partition(topic, partition);
        // librdkafka resumes a paused partition from the last record handed to the
        // application, so parked records are not fetched twice, and none is skipped.
        let done = if pause {
            consumer.pause(&list)
        } else {
            consumer.resume(&list)
        };
        match done {
            Ok(()) => self.paused = pause,
            Err(e) => debug!(error = %e, partition, pause, "pause or resume"),
        }
    }

    /// Stops the lane: a batch in flight is abandoned without storing its offset (it is
    /// redelivered and dedupes in the inbox).
    pub(super) fn stop(&self) {
        self.cancel.cancel();
    }
}

/// The lane's task: batch, store, then store and commit the offset.
async fn run(
    shared: Arc<Shared>,
    consumer: Arc<StreamConsumer<IngestContext>>,
    config: LaneConfig,
    mut rx: mpsc::Receiver<Record>,
    cancel: CancellationToken,
) {
    let partition = config.partition;
    loop {
        let first = tokio::select! {
            r = rx.recv() => r,
            () = cancel.cancelled() => return,
        };
        let Some(first) = first else { return };
        let Some(batch) = collect(
            first,
            &mut rx,
            config.max_messages,
            config.max_wait,
            &cancel,
        )
        .await
        else {
            return;
        };
        IngestStats::add(&shared.stats.records, batch.len() as u64);
        let last = batch.last().map(|r| r.offset);
        if !shared
            .store_partition_batch(partition, batch, &cancel)
            .await
        {
            return;
        }
        if shared.crash_point_reached() {
            return;
        }
        if let Some(last) = last {
            store_offset(&consumer, &shared.proposals, partition, last);
        }
    }
}

/// A batch: `first`, every item already in `rx`, and, with a `max_wait` (counted from
/// now, when `first` was taken), what arrives within it; at most `max` in all. `None` when
/// cancelled while waiting. Without a wait it takes what is there and no more, at once.
/// The default wait is short (1 ms): the consumer loop hands a fetch's records over one
/// by one, and a lane that went with the first alone would leave the rest waiting for
/// its transaction (measured: no better than a 20 ms wait at 1,000 records/s). Under
/// load, records gather in the channel while the lane's previous batch is stored, and
/// the group commit gathers lanes' batches while the ledger is busy, so a long wait
/// would only add latency.
async fn collect<T>(
    first: T,
    rx: &mut mpsc::Receiver<T>,
    max: usize,
    max_wait: Duration,
    cancel: &CancellationToken,
) -> Option<Vec<T>> {
    let deadline = tokio::time::Instant::now() + max_wait;
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    if max_wait.is_zero() {
        return Some(batch);
    }
    while batch.len() < max {
        tokio::select! {
            item = rx.recv() => match item {
                Some(item) => batch.push(item),
                None => break,
            },
            () = tokio::time::sleep_until(deadline) => break,
            () = cancel.cancelled() => return None,
        }
    }
    Some(batch)
}

fn store_offset(consumer: &StreamConsumer<IngestContext>, topic: &str, partition: i32, last: i64) {
    let mut list = TopicPartitionList::new();
    if let Err(e) = list.add_partition_offset(topic, partition, Offset::Offset(last + 1)) {
        warn!(error = %e, partition, "building the offset list");
        return;
    }
    debug!(
        partition,
        offset = last + 1,
        "batch stored; storing its offset"
    );
    // A partition revoked meanwhile cannot be stored: its new owner re-reads the batch,
    // which dedupes in the inbox.
    if let Err(e) = consumer.store_offsets(&list) {
        debug!(error = %e, "storing offsets");
    }
    if let Err(e) = consumer.commit_consumer_state(CommitMode::Async) {
        debug!(error = %e, "committing offsets");
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// Without a wait, a batch is what has arrived, taken at once: the first poll of
    /// [`collect`] completes (no timer, nothing to wait for), and a later item goes into
    /// the next batch.
    #[tokio::test]
    async fn without_a_wait_a_batch_is_what_has_arrived_at_the_first_poll() {
        let (tx, mut rx) = mpsc::channel(16);
        for i in 1..=3 {
            tx.send(i).await.expect("send");
        }
        let cancel = CancellationToken::new();
        let first_poll = |rx: &mut mpsc::Receiver<i32>, first, max| {
            let mut batch = std::pin::pin!(collect(first, rx, max, Duration::ZERO, &cancel));
            match batch.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
                Poll::Ready(batch) => batch,
                Poll::Pending => panic!("a batch without a wait waited"),
            }
        };
        assert_eq!(first_poll(&mut rx, 0, 10), Some(vec![0, 1, 2, 3]));
        tx.send(4).await.expect("send");
        tx.send(5).await.expect("send");
        assert_eq!(first_poll(&mut rx, 9, 2), Some(vec![9, 4]), "at most max");
        assert_eq!(rx.try_recv().ok(), Some(5));
    }

    /// With a wait, items arriving within it join the batch; one arriving well after it
    /// does not; a cancel while waiting gives no batch.
    #[tokio::test]
    async fn with_a_wait_a_batch_takes_what_arrives_within_it() {
        let (tx, mut rx) = mpsc::channel(16);
        let cancel = CancellationToken::new();
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send(1).await.expect("send");
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            tx.send(2).await.expect("send");
        });
        let batch = collect(0, &mut rx, 10, Duration::from_millis(500), &cancel).await;
        assert_eq!(batch, Some(vec![0, 1]));
        sender.await.expect("sender");
        assert_eq!(
            rx.try_recv().ok(),
            Some(2),
            "the late item waits for the next batch"
        );

        let (_tx, mut empty) = mpsc::channel::<i32>(1);
        cancel.cancel();
        assert_eq!(
            collect(0, &mut empty, 10, Duration::from_secs(60), &cancel).await,
            None
        );
    }
}
