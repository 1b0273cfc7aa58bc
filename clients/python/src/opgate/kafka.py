"""Propose over Kafka and wait for the answers on `opgate.results`, matched by event id
(needs the `kafka` extra: `pip install "opgate[kafka]"`).

A proposal's record is keyed `{entity_type}:{entity_id}` (one entity's proposals stay in
order on one partition). Every proposal is answered on `opgate.results` with its
`event_id`: the decision, then each state change of the operation it created or was
merged into.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping, Optional

from .client import SETTLED, proposal

try:
    from confluent_kafka import Consumer, Producer
except ImportError as e:  # pragma: no cover - the extra is optional
    raise ImportError('opgate.kafka needs confluent-kafka: pip install "opgate[kafka]"') from e


class KafkaProposer:
    """Publishes proposals to `{topic_prefix}opgate.proposals`."""

    def __init__(self, bootstrap_servers: str, *, topic_prefix: str = "", namespace: str = "default", config: Optional[dict] = None):
        self.topic = f"{topic_prefix}opgate.proposals"
        self.namespace = namespace
        self.producer = Producer({"bootstrap.servers": bootstrap_servers, "enable.idempotence": True, **(config or {})})

    def propose(self, tool: str, entity: tuple[str, str], args: Mapping[str, Any], **fields: Any) -> str:
        """Publishes and waits for the broker's acknowledgement; returns the event id."""
        fields.setdefault("namespace", self.namespace)
        body = proposal(tool, entity, args, **fields)
        errors: list = []
        self.producer.produce(
            self.topic,
            key=f"{entity[0]}:{entity[1]}",
            value=json.dumps(body).encode(),
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
        self.producer.flush(30)
        if errors:
            raise RuntimeError(f"proposal not acknowledged: {errors[0]}")
        return body["event_id"]


class ResultWaiter:
    """Reads `{topic_prefix}opgate.results` and answers by event id.

    The first result of a proposal carries its event id and the operation it created or
    was merged into; later state changes of that operation carry the event id that
    created it. So the waiter follows each event to its operation and returns the
    operation's latest result (highest `seq`)."""

    def __init__(self, bootstrap_servers: str, *, topic_prefix: str = "", group_id: Optional[str] = None, config: Optional[dict] = None):
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": group_id or f"opgate-py-{time.time_ns()}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                **(config or {}),
            }
        )
        self.consumer.subscribe([f"{topic_prefix}opgate.results"])
        self._operation_of_event: dict[str, Optional[str]] = {}
        self._first_of_event: dict[str, dict] = {}
        self._latest_of_operation: dict[str, dict] = {}

    def _take(self, result: dict) -> None:
        event, op = result.get("event_id"), result.get("operation_id")
        if event not in self._operation_of_event:
            self._operation_of_event[event] = op
            self._first_of_event[event] = result
        if op is not None:
            latest = self._latest_of_operation.get(op)
            if latest is None or result.get("seq", 0) >= latest.get("seq", 0):
                self._latest_of_operation[op] = result

    def _current(self, event_id: str) -> Optional[dict]:
        if event_id not in self._operation_of_event:
            return None
        op = self._operation_of_event[event_id]
        return self._first_of_event[event_id] if op is None else self._latest_of_operation[op]

    def wait(self, event_id: str, timeout: float = 30.0, settled: bool = True) -> dict:
        """The latest result of `event_id`'s operation once settled (any result, with
        `settled=False`). Raises `TimeoutError` when none comes in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self._current(event_id)
            if current is not None and (not settled or current.get("status") in SETTLED):
                return current
            message = self.consumer.poll(0.2)
            if message is None or message.error():
                continue
            self._take(json.loads(message.value()))
        raise TimeoutError(f"no {'settled ' if settled else ''}result for event {event_id} in {timeout} s")

    def close(self) -> None:
        self.consumer.close()
