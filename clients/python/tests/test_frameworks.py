"""The framework examples, driven as the frameworks drive them (no language model: the
tool calls a model would emit are given directly)."""

import asyncio
import json
import sys
import uuid
from pathlib import Path

from opgate import Client

from conftest import sim_effects

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_openai_agents_function_tool(dev):
    from agents.tool_context import ToolContext

    import openai_agents_tool

    client = Client(dev["api"], dev["tokens"]["agent"])
    tool = openai_agents_tool.payment_tool(client)
    assert tool.name == "capture_payment"
    assert set(tool.params_json_schema["properties"]) == {"order_id", "amount", "currency"}
    assert [t.name for t in openai_agents_tool.agent(client).tools] == ["capture_payment"]
    o = f"order_{uuid.uuid4().hex[:8]}"

    async def invoke(arguments):
        ctx = ToolContext(context=None, tool_name=tool.name, tool_call_id=uuid.uuid4().hex, tool_arguments=arguments)
        return await tool.on_invoke_tool(ctx, arguments)

    first = asyncio.run(invoke(json.dumps({"order_id": o, "amount": "20.00", "currency": "usd"})))
    again = asyncio.run(invoke(json.dumps({"order_id": o, "amount": "20", "currency": "USD"})))
    assert first["status"] == "completed_success", first
    assert again["operation_id"] == first["operation_id"]
    assert sim_effects(dev, "payments", o) == 1


def test_langgraph_tool_node(dev):
    from langchain_core.messages import AIMessage

    import langgraph_tool

    graph = langgraph_tool.graph(Client(dev["api"], dev["tokens"]["agent"]))
    o = f"order_{uuid.uuid4().hex[:8]}"
    calls = [
        {"name": "capture_payment", "args": {"order_id": o, "amount": "30.00", "currency": "usd"}, "id": "call-1"},
        {"name": "capture_payment", "args": {"order_id": o, "amount": "30", "currency": "usd"}, "id": "call-2"},
    ]
    out = graph.invoke({"messages": [AIMessage(content="", tool_calls=calls)]})
    messages = out["messages"][1:]
    assert len(messages) == 2
    answers = [json.loads(m.content) for m in messages]
    assert {a["operation_id"] for a in answers} == {answers[0]["operation_id"]}
    assert all(a["status"] == "completed_success" for a in answers), answers
    assert sim_effects(dev, "payments", o) == 1
