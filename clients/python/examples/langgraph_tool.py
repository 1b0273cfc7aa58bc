"""LangGraph: a guarded function as a LangChain tool in a `ToolNode`. When the model's
message carries a tool call, the node runs it: an opgate proposal, and the normalized
result goes back to the model as the ToolMessage.

    pip install langgraph ./clients/python
"""

from __future__ import annotations

from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from opgate import Client, guarded_tool


def tool_node(client: Client) -> ToolNode:
    @tool
    @guarded_tool(client, entity=("order", "order_id"))
    def capture_payment(order_id: str, amount: str, currency: str) -> dict:
        """Charge the customer for an order. Amount in major units, e.g. "49.00"."""
        raise AssertionError("never runs: opgate calls the payment provider")

    return ToolNode([capture_payment])


def graph(client: Client):
    """The smallest graph around the node: the model's tool calls in, the answers out.
    In an agent, an LLM node comes before it and reads the ToolMessages after it."""
    g = StateGraph(MessagesState)
    g.add_node("tools", tool_node(client))
    g.add_edge(START, "tools")
    g.add_edge("tools", END)
    return g.compile()
