"""The client against a real `opgate dev`."""

import asyncio
import uuid

import pytest

from opgate import AsyncClient, Client, OpgateError, guarded_tool

from conftest import sim_effects


def order():
    return f"order_{uuid.uuid4().hex[:8]}"


def test_a_proposal_settles_once_and_a_retry_is_the_same_operation(dev):
    client = Client(dev["api"], dev["tokens"]["agent"])
    o = order()
    first = client.propose_and_wait("capture_payment", ("order", o), {"amount": "49.00", "currency": "usd"})
    assert first.decision == "accepted", first
    assert first.operation.status == "completed_success", first.operation
    assert first.operation.agent_id == dev["agent"]["agent_id"], "the agent id comes from the token"
    # The agent retries after a timeout with a re-planned event id and re-spelled args.
    again = client.propose_and_wait("capture_payment", ("order", o), {"amount": 49, "currency": " USD "})
    assert again.decision == "deduplicated" and again.reason == "key", again
    assert again.operation.operation_id == first.operation.operation_id
    assert sim_effects(dev, "payments", o) == 1
    # wait() by event id or operation id.
    assert client.wait(first.event_id).status == "completed_success"
    assert client.wait(first.operation.operation_id).operation_id == first.operation.operation_id


def test_refusals_say_why(dev):
    agent = Client(dev["api"], dev["tokens"]["agent"])
    refused = agent.propose("capture_payment", ("order", order()), {"amount": "-49.00", "currency": "usd"})
    assert refused.decision == "rejected" and refused.reason == "args_schema", refused
    assert "`/amount`" in refused.message
    assert refused.for_model()["retry_recommendation"] == "do_not_retry"
    with pytest.raises(OpgateError) as spoof:
        agent.propose("capture_payment", ("order", order()), {"amount": "1", "currency": "usd"}, agent_id="someone-else")
    assert spoof.value.status == 403 and "agent_id" in spoof.value.message
    viewer = Client(dev["api"], dev["tokens"]["viewer"])
    with pytest.raises(OpgateError) as read_only:
        viewer.propose("capture_payment", ("order", order()), {"amount": "1", "currency": "usd"})
    assert read_only.value.status == 403
    with pytest.raises(OpgateError) as unknown:
        Client(dev["api"], "not-a-token-0123456789").tools()
    assert unknown.value.status == 401


def test_the_async_client(dev):
    async def main():
        client = AsyncClient(dev["api"], dev["tokens"]["agent"])
        tools = await client.tools()
        assert any(t["name"] == "capture_payment" for t in tools)
        o = order()
        answers = await asyncio.gather(*[
            client.propose_and_wait("capture_payment", ("order", o), {"amount": "5.00", "currency": "usd"})
            for _ in range(5)
        ])
        return o, {a.operation.operation_id for a in answers}

    o, ids = asyncio.run(main())
    assert len(ids) == 1, "five concurrent identical proposals are one operation"
    assert sim_effects(dev, "payments", o) == 1


def test_guarded_tool_returns_the_normalized_result_to_the_model(dev):
    client = Client(dev["api"], dev["tokens"]["agent"])

    @guarded_tool(client, entity=("order", "order_id"))
    def capture_payment(order_id: str, amount: str, currency: str) -> dict:
        """Charge the customer for an order."""
        raise AssertionError("the body of a guarded tool never runs")

    assert capture_payment.__doc__ == "Charge the customer for an order."
    o = order()
    result = capture_payment(order_id=o, amount="12.50", currency="eur")
    assert result["status"] == "completed_success", result
    assert set(result) >= {"operation_id", "result", "retry_recommendation", "safe_user_message"}
    again = capture_payment(o, "12.5", "EUR")
    assert again["operation_id"] == result["operation_id"] and again["deduplicated"] is True
    assert sim_effects(dev, "payments", o) == 1


def test_a_scripted_model_that_retries_like_a_real_one_causes_one_effect(dev):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import scripted_loop

    o = order()
    transcript = scripted_loop.run(dev["api"], dev["tokens"]["agent"], o)
    assert len(transcript) == 3
    assert transcript[0]["answer"] is None, "the first answer was lost"
    assert len({t["seen"]["operation_id"] for t in transcript}) == 1
    assert [t["seen"]["status"] for t in transcript] == ["completed_success"] * 3
    assert sim_effects(dev, "payments", o) == 1
