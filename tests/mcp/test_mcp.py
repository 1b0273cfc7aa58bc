"""The official MCP Python client (`mcp` on PyPI) against `opgate mcp --dev`, over
streamable HTTP and stdio: tools with their schemas, a call that settles once, a repeated
call answered with the same operation, a refusal naming the argument, and a provider that
commits then times out still causing exactly one effect.

Run: OPGATE_BIN=target/debug/opgate python -m pytest tests/mcp
"""

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import anyio
import httpx2
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

BIN = os.environ.get("OPGATE_BIN", str(Path(__file__).resolve().parents[2] / "target/debug/opgate"))


def start_http_server():
    """`opgate mcp --dev --http` on a free port; returns (process, ready dict)."""
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    proc = subprocess.Popen(
        [BIN, "mcp", "--dev", "--http", "127.0.0.1:0", "--ready-file", str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(ready.with_suffix(".log"), "w"),
    )
    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, f"opgate mcp exited; see {ready.with_suffix('.log')}"
        assert time.time() < deadline, "opgate mcp never got ready"
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def sim(ready, path, body=None):
    request = urllib.request.Request(
        ready["sim"] + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read()
        return json.loads(text) if text else None


def payments_effects(ready, entity):
    report = sim(ready, "/effects")
    return sum(e["count"] for e in report["effects"] if e["provider"] == "payments" and entity in e["key"])


async def settle(session, answer):
    """Follows `next` with opgate_wait_for_result until the operation settles."""
    result = answer.structured_content
    for _ in range(20):
        if result["retry_recommendation"] not in ("wait_for_result", "reconcile_before_retry"):
            return result
        answer = await session.call_tool(
            "opgate_wait_for_result", {"operation_id": result["operation_id"], "wait_seconds": 10}
        )
        result = answer.structured_content
    raise AssertionError(f"never settled: {result}")


async def exercise(session, ready):
    await session.initialize()
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert "capture_payment" in tools and "opgate_wait_for_result" in tools, tools.keys()
    schema = tools["capture_payment"].input_schema
    assert schema["required"] == ["entity_id", "args"], schema
    amount = schema["properties"]["args"]["properties"]["amount"]
    assert amount["exclusiveMinimum"] == 0, amount
    assert "charges" in tools["capture_payment"].description

    call = {"entity_id": "order_mcp_1", "args": {"amount": "49.00", "currency": "usd"}}
    first = await session.call_tool("capture_payment", call)
    assert not first.is_error, first
    done = await settle(session, first)
    assert done["status"] == "completed_success", done
    # The model retries the same call (a timeout on its side, a re-plan): same operation.
    again = await session.call_tool("capture_payment", call)
    assert not again.is_error, again
    assert again.structured_content["operation_id"] == done["operation_id"], again.structured_content
    assert again.structured_content["deduplicated"] is True
    assert payments_effects(ready, "order_mcp_1") == 1

    # A negative amount is refused before any work, naming the argument.
    refused = await session.call_tool(
        "capture_payment", {"entity_id": "order_mcp_2", "args": {"amount": "-49.00", "currency": "usd"}}
    )
    assert refused.is_error, refused
    assert refused.structured_content["reason"] == "args_schema", refused.structured_content
    assert "/amount" in refused.structured_content["message"]
    assert refused.structured_content["retry_recommendation"] == "do_not_retry"


async def commit_then_timeout(session, ready, entity):
    """The provider commits, then hangs past the adapter's timeout: opgate does not know
    whether the charge happened; it resends with the same key (the provider honours it)
    and the charge happens once."""
    # Keys reach providers scoped by namespace: `default/payment:{entity}:...`.
    sim(ready, "/faults", {"provider": "payments", "fault": "timeout_after_commit", "times": 1,
                           "match": "default/payment:" + entity})
    answer = await session.call_tool("capture_payment", {"entity_id": entity, "args": {"amount": "5.00", "currency": "usd"}})
    assert not answer.is_error, answer
    done = await settle(session, answer)
    assert done["status"] == "completed_success", done
    # A model that impatiently calls again gets the same operation.
    again = await session.call_tool("capture_payment", {"entity_id": entity, "args": {"amount": "5.00", "currency": "usd"}})
    assert again.structured_content["operation_id"] == done["operation_id"]
    assert payments_effects(ready, entity) == 1, sim(ready, "/effects")
    # The fault did happen: the provider was called twice with the same key (its key
    # retention makes the resend safe: the timeout was a retryable failure, not an
    # ambiguity), and charged once.
    history = api(ready, f"/v1/operations/{done['operation_id']}/events")
    states = [e["to"] for e in history["events"]]
    assert states.count("dispatched") == 2, states
    assert "failed_retryable" in states or "unknown_outcome" in states, states


async def email_commit_then_timeout(session, ready):
    """The email provider has no idempotency key: after a commit-then-timeout opgate does
    not resend blindly; the outcome is unknown until the reconciler finds the email by its
    client reference. One email."""
    sim(ready, "/faults", {"provider": "emails", "fault": "timeout_after_commit", "times": 1})
    call = {"entity_id": "user_mcp_1", "workflow_id": "wf-mcp-1", "step": 1,
            "args": {"to": "Ada@Example.com", "template": "welcome"}}
    answer = await session.call_tool("send_email", call)
    assert not answer.is_error, answer
    done = await settle(session, answer)
    assert done["status"] == "completed_success", done
    again = await session.call_tool("send_email", call)
    assert again.structured_content["operation_id"] == done["operation_id"]
    history = api(ready, f"/v1/operations/{done['operation_id']}/events")
    states = [e["to"] for e in history["events"]]
    assert "unknown_outcome" in states, states
    report = sim(ready, "/effects")
    emails = [e for e in report["effects"] if e["provider"] == "emails"]
    assert [e["count"] for e in emails] == [1], report


def api(ready, path):
    request = urllib.request.Request(
        ready["api"] + path, headers={"authorization": "Bearer " + ready["tokens"]["viewer"]}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_mcp_over_streamable_http():
    proc, ready = start_http_server()
    try:
        # Without a bearer token the endpoint answers 401.
        assert httpx2.post(ready["mcp"], json={}).status_code == 401

        async def main():
            headers = {"Authorization": "Bearer " + ready["tokens"]["agent"]}
            async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
                async with streamable_http_client(ready["mcp"], http_client=http) as (read, write):
                    async with ClientSession(read, write) as session:
                        await exercise(session, ready)
                        await commit_then_timeout(session, ready, "order_mcp_http_ambiguous")
                        await email_commit_then_timeout(session, ready)

        anyio.run(main)
        assert sim(ready, "/effects")["duplicates"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_mcp_over_stdio():
    ready_file = Path(tempfile.mkdtemp()) / "ready.json"

    async def main():
        params = StdioServerParameters(command=BIN, args=["mcp", "--dev", "--ready-file", str(ready_file)])
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                ready = json.loads(ready_file.read_text())
                await exercise(session, ready)

    anyio.run(main)
