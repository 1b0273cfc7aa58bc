"""The HTTP client of opgate's admin API: propose, wait, read. Standard library only.

The model proposes; opgate commits. A proposal names a registered tool, the entity it acts
on and the arguments; opgate derives the business key, executes the effect at most once,
and answers. Proposing the same thing again (a retry after a timeout, a re-planned event
id) returns the same operation instead of acting twice.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

#: States after which nothing more happens without a person.
SETTLED = {
    "completed_success",
    "completed_noop",
    "failed_permanent",
    "rejected",
    "cancelled",
    "compensated",
    "needs_attention",
}

_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


class OpgateError(Exception):
    """opgate refused a request (4xx/5xx) or could not be reached."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Operation:
    """An operation as the API shows it (the fields agents use; `raw` has them all)."""

    operation_id: str
    status: str
    tool: str
    idempotency_key: str
    retry_recommendation: str
    safe_user_message: str
    result: Any = None
    error: Any = None
    agent_id: Optional[str] = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, v: Mapping[str, Any]) -> "Operation":
        return cls(
            operation_id=v["operation_id"],
            status=v["status"],
            tool=v["tool"],
            idempotency_key=v["idempotency_key"],
            retry_recommendation=v["retry_recommendation"],
            safe_user_message=v["safe_user_message"],
            result=v.get("result"),
            error=v.get("error"),
            agent_id=v.get("agent_id"),
            raw=v,
        )

    @property
    def settled(self) -> bool:
        return self.status in SETTLED

    def for_model(self) -> dict:
        """The normalized result to hand back to a model."""
        out = {
            "operation_id": self.operation_id,
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "retry_recommendation": self.retry_recommendation,
            "safe_user_message": self.safe_user_message,
        }
        if not self.settled:
            out["next"] = "still in flight: wait for this operation_id; do not call the tool again"
        return out


@dataclass(frozen=True)
class Answer:
    """opgate's answer to a proposal."""

    event_id: str
    decision: str  # accepted | deduplicated | rejected
    reason: Optional[str]
    message: Optional[str]
    inbox_hit: bool
    operation: Optional[Operation]

    @classmethod
    def from_json(cls, v: Mapping[str, Any]) -> "Answer":
        op = v.get("operation")
        return cls(
            event_id=v["event_id"],
            decision=v["decision"],
            reason=v.get("reason"),
            message=v.get("message"),
            inbox_hit=bool(v.get("inbox_hit")),
            operation=Operation.from_json(op) if op else None,
        )

    def for_model(self) -> dict:
        if self.operation is None:
            return {
                "status": "rejected",
                "reason": self.reason,
                "message": self.message,
                "retry_recommendation": "do_not_retry",
                "safe_user_message": "The action was not accepted.",
            }
        out = self.operation.for_model()
        out["deduplicated"] = self.decision == "deduplicated"
        return out


def proposal(
    tool: str,
    entity: tuple[str, str],
    args: Mapping[str, Any],
    *,
    event_id: Optional[str] = None,
    namespace: str = "default",
    intent: Optional[str] = None,
    workflow_id: Optional[str] = None,
    run_id: Optional[str] = None,
    step: Optional[int] = None,
    agent_id: Optional[str] = None,
) -> dict:
    """A proposal message (the same JSON over HTTP and on the Kafka topic)."""
    p: dict[str, Any] = {
        "event_id": event_id or f"py-{uuid.uuid4()}",
        "namespace": namespace,
        "tool": tool,
        "entity": {"type": entity[0], "id": entity[1]},
        "args": dict(args),
    }
    for name, value in (
        ("intent", intent),
        ("workflow_id", workflow_id),
        ("run_id", run_id),
        ("step", step),
        ("agent_id", agent_id),
    ):
        if value is not None:
            p[name] = value
    return p


class Client:
    """A synchronous client. `token` is an agent token for agents (its agent_id is used)."""

    def __init__(self, api_url: str, token: str, *, namespace: str = "default", timeout: float = 75.0):
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.namespace = namespace
        self.timeout = timeout
        self._operation_of_event: dict[str, str] = {}

    def _call(self, method: str, path: str, body: Any = None, query: Optional[dict] = None) -> tuple[int, Any]:
        url = self.api_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = None
            return e.code, payload
        except (urllib.error.URLError, OSError) as e:
            raise OpgateError(0, "unreachable", f"{url}: {e}") from e

    @staticmethod
    def _raise(status: int, payload: Any) -> None:
        err = (payload or {}).get("error") if isinstance(payload, dict) else None
        if err:
            raise OpgateError(status, err.get("code", "error"), err.get("message", ""))
        raise OpgateError(status, "error", str(payload))

    def propose(self, tool: str, entity: tuple[str, str], args: Mapping[str, Any], **fields: Any) -> Answer:
        """Proposes; a refused proposal is an `Answer` with decision `rejected` (not an
        exception): it says why. Errors of the request itself (token, role, a field at
        fault) raise `OpgateError`."""
        fields.setdefault("namespace", self.namespace)
        body = proposal(tool, entity, args, **fields)
        status, payload = self._call("POST", "/v1/proposals", body)
        if status in (200, 201) or (status in (409, 422) and isinstance(payload, dict) and "decision" in payload):
            answer = Answer.from_json(payload)
            if answer.operation is not None:
                self._operation_of_event[answer.event_id] = answer.operation.operation_id
            return answer
        self._raise(status, payload)
        raise AssertionError("unreachable")

    def operation(self, operation_id: str, wait: float = 0.0) -> Operation:
        """One operation; with `wait`, long-polls up to that many seconds (at most 60)."""
        query = {"wait": f"{int(min(wait, 60) * 1000)}ms"} if wait > 0 else None
        status, payload = self._call("GET", f"/v1/operations/{operation_id}", query=query)
        if status != 200:
            self._raise(status, payload)
        return Operation.from_json(payload)

    def wait(self, id_or_event: str, timeout: float = 30.0) -> Operation:
        """Waits until an operation settles (or `timeout` passes) and returns it as it
        stands. Takes an operation id, or the event id of a proposal this client sent."""
        operation_id = id_or_event if _UUID.match(id_or_event) else self._operation_of_event.get(id_or_event)
        if operation_id is None:
            raise KeyError(f"event {id_or_event!r} was not proposed through this client")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            op = self.operation(operation_id, wait=max(0.0, min(left, 60.0)))
            if op.settled or left <= 0:
                return op

    def propose_and_wait(self, tool: str, entity: tuple[str, str], args: Mapping[str, Any], *, timeout: float = 30.0, **fields: Any) -> Answer:
        """Proposes, then waits for the operation to settle; the answer carries it."""
        answer = self.propose(tool, entity, args, **fields)
        if answer.operation is None or answer.operation.settled:
            return answer
        settled = self.wait(answer.operation.operation_id, timeout=timeout)
        return Answer(answer.event_id, answer.decision, answer.reason, answer.message, answer.inbox_hit, settled)

    def tools(self) -> list[dict]:
        """The tools this token may propose, with their argument schemas."""
        status, payload = self._call("GET", "/v1/tools")
        if status != 200:
            self._raise(status, payload)
        return payload["tools"]


class AsyncClient:
    """The same calls for asyncio code (each runs the blocking call in a thread)."""

    def __init__(self, api_url: str, token: str, *, namespace: str = "default", timeout: float = 75.0):
        self.sync = Client(api_url, token, namespace=namespace, timeout=timeout)

    async def propose(self, tool: str, entity: tuple[str, str], args: Mapping[str, Any], **fields: Any) -> Answer:
        return await asyncio.to_thread(self.sync.propose, tool, entity, args, **fields)

    async def wait(self, id_or_event: str, timeout: float = 30.0) -> Operation:
        return await asyncio.to_thread(self.sync.wait, id_or_event, timeout)

    async def propose_and_wait(self, tool: str, entity: tuple[str, str], args: Mapping[str, Any], *, timeout: float = 30.0, **fields: Any) -> Answer:
        return await asyncio.to_thread(self.sync.propose_and_wait, tool, entity, args, timeout=timeout, **fields)

    async def operation(self, operation_id: str, wait: float = 0.0) -> Operation:
        return await asyncio.to_thread(self.sync.operation, operation_id, wait)

    async def tools(self) -> list[dict]:
        return await asyncio.to_thread(self.sync.tools)
