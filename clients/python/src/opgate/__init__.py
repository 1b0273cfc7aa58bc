"""opgate's Python client: propose side effects over HTTP (or Kafka, with the `kafka`
extra), wait for their one outcome, and guard the tools an agent framework gives a model.

    from opgate import Client, guarded_tool

    client = Client("http://127.0.0.1:8080", token)        # an agent token
    answer = client.propose_and_wait("capture_payment", ("order", "order_123"),
                                     {"amount": "49.00", "currency": "usd"})
    answer.operation.status    # "completed_success"; the same call again: the same operation
"""

from .client import SETTLED, Answer, AsyncClient, Client, Operation, OpgateError, proposal
from .tools import guarded_tool

__all__ = ["SETTLED", "Answer", "AsyncClient", "Client", "Operation", "OpgateError", "guarded_tool", "proposal"]
__version__ = "0.1.0"
