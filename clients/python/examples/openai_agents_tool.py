"""The OpenAI Agents SDK: a guarded function as a `function_tool`. The Agent (and its
model) sees the tool's name, docstring and parameters; each call the model makes becomes
an opgate proposal, and the model gets the normalized result back.

    pip install openai-agents ./clients/python
"""

from __future__ import annotations

from agents import Agent, function_tool

from opgate import Client, guarded_tool


def payment_tool(client: Client):
    @function_tool
    @guarded_tool(client, entity=("order", "order_id"))
    def capture_payment(order_id: str, amount: str, currency: str) -> dict:
        """Charge the customer for an order. Amount in major units, e.g. "49.00"."""
        raise AssertionError("never runs: opgate calls the payment provider")

    return capture_payment


def agent(client: Client) -> Agent:
    return Agent(
        name="billing",
        instructions="Collect payment for the order the user names. If a result says wait_for_result, do not call the tool again.",
        tools=[payment_tool(client)],
    )
