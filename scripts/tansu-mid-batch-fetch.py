"""Minimal check: consume a topic from an offset inside a stored record batch.

Produces 3,000 records in two flushes (librdkafka packs them into a few large record
batches), then assigns the partition at offset START and prints the first offset the
broker returns. A Kafka broker answers a fetch with the batch that contains START and the
client drops the records before it, so the first offset must be START.

    python3 -m venv /tmp/ck && /tmp/ck/bin/pip install "confluent-kafka==2.12.*"
    /tmp/ck/bin/python scripts/tansu-mid-batch-fetch.py 127.0.0.1:9092 1200

Seen on tansu 0.6.0 (memory storage), 2026-12-01: from offset 0 all 3,000 records; from
100 or 1200 the first offset returned is 1501 (the next batch: the rest of the batch
holding START is skipped); from 1600 nothing. A consumer that resumes inside a batch
(pause/resume, a seek, a restart from a committed offset, a fetch response cut at its
size limit) loses records there: `opgate bench e2e --brokers` on tansu does (BENCHMARKS.md).
"""
import sys, uuid
from confluent_kafka import Producer, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

brokers = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:9092"
n, start = 3000, int(sys.argv[2]) if len(sys.argv) > 2 else 1200
topic = f"midbatch-{uuid.uuid4().hex[:8]}"
admin = AdminClient({"bootstrap.servers": brokers})
admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
p = Producer({"bootstrap.servers": brokers, "linger.ms": 50, "batch.num.messages": 10000})
# Two flushes: at least two record batches, so there is a later batch to jump to.
for i in range(n):
    p.produce(topic, value=str(i).encode())
    if i == n // 2:
        p.flush(30)
p.flush(30)
c = Consumer({"bootstrap.servers": brokers, "group.id": "g-" + topic, "enable.auto.commit": False})
c.assign([TopicPartition(topic, 0, start)])
seen = []
while len(seen) < n - start:
    m = c.poll(10)
    if m is None:
        break
    if m.error():
        print("error", m.error()); break
    seen.append(m.offset())
print(f"asked from offset {start}: first offset returned {seen[0] if seen else None}, "
      f"{len(seen)} records returned of {n - start} expected, "
      f"missing {sorted(set(range(start, n)) - set(seen))[:3]}...")
