"""Proposals over Kafka (opgate dev's embedded broker, served over TCP) answered on
opgate.results and matched by event id."""

import uuid

from opgate.kafka import KafkaProposer, ResultWaiter

from conftest import sim_effects


def test_kafka_proposals_are_answered_by_event_id(dev):
    proposer = KafkaProposer(dev["kafka"])
    waiter = ResultWaiter(dev["kafka"])
    try:
        o = f"order_{uuid.uuid4().hex[:8]}"
        first = proposer.propose("capture_payment", ("order", o), {"amount": "7.00", "currency": "usd"}, agent_id="kafka-bot")
        done = waiter.wait(first, timeout=60)
        assert done["status"] == "completed_success", done
        # A re-planned duplicate is answered with the same operation, settled.
        second = proposer.propose("capture_payment", ("order", o), {"amount": 7, "currency": "USD"}, agent_id="kafka-bot")
        dup = waiter.wait(second, timeout=60)
        assert dup["operation_id"] == done["operation_id"], dup
        assert dup["status"] == "completed_success"
        assert sim_effects(dev, "payments", o) == 1
    finally:
        waiter.close()
