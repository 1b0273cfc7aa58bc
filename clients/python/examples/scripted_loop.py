"""A function-calling loop with a scripted "model" that behaves like a real one under
failure: its first tool call times out on its side (the answer is lost), so it calls
again with a new id it made up and the amount spelled differently; then it calls a
third time, impatiently. opgate charges once and every call gets the same operation.

No dependencies beyond the client:
    python examples/scripted_loop.py http://127.0.0.1:8080 <agent token> [simulator url]
"""

from __future__ import annotations

import json
import sys
import urllib.request
import uuid

from opgate import Client, guarded_tool


class ScriptedModel:
    """Emits tool calls from a script, like a model reading its transcript."""

    def __init__(self, order_id: str):
        self.script = [
            {"tool": "capture_payment", "arguments": {"order_id": order_id, "amount": "49.00", "currency": "usd"}, "lose_answer": True},
            {"tool": "capture_payment", "arguments": {"order_id": order_id, "amount": 49, "currency": "USD"}},
            {"tool": "capture_payment", "arguments": {"order_id": order_id, "amount": "49.0", "currency": "usd"}},
        ]

    def next_call(self, transcript: list) -> dict | None:
        return self.script[len(transcript)] if len(transcript) < len(self.script) else None


def run(api_url: str, token: str, order_id: str) -> list[dict]:
    client = Client(api_url, token)

    @guarded_tool(client, entity=("order", "order_id"))
    def capture_payment(order_id: str, amount: str, currency: str) -> dict:
        """Charge the customer for an order."""
        raise AssertionError("never runs: opgate calls the payment provider")

    tools = {"capture_payment": capture_payment}
    model = ScriptedModel(order_id)
    transcript: list[dict] = []
    while (call := model.next_call(transcript)) is not None:
        answer = tools[call["tool"]](**call["arguments"])
        # A lost answer: the model saw a timeout, not the result.
        transcript.append({"call": call, "answer": None if call.get("lose_answer") else answer, "seen": answer})
    return transcript


def main() -> int:
    api_url, token = sys.argv[1], sys.argv[2]
    order_id = f"order_{uuid.uuid4().hex[:8]}"
    transcript = run(api_url, token, order_id)
    operations = {t["seen"]["operation_id"] for t in transcript}
    for t in transcript:
        print(json.dumps({"arguments": t["call"]["arguments"], "answer": t["answer"]}))
    print(f"{len(transcript)} calls, {len(operations)} operation(s)")
    if len(sys.argv) > 3:
        with urllib.request.urlopen(sys.argv[3] + "/effects") as r:
            effects = [e for e in json.loads(r.read())["effects"] if order_id in e["key"]]
        print(f"charges at the provider: {sum(e['count'] for e in effects)}")
    return 0 if len(operations) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
