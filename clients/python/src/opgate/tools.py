"""`guarded_tool`: a function an agent framework exposes to the model, whose call becomes
an opgate proposal. The function's signature and docstring describe the tool to the
model (OpenAI Agents SDK `function_tool`, LangChain/LangGraph `tool`, or your own loop);
its body never runs — the effect happens once, at the provider, through opgate.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Optional, Union

from .client import AsyncClient, Client

EntitySpec = Union[tuple[str, str], Callable[[Mapping[str, Any]], tuple[str, str]]]


def guarded_tool(
    client: Union[Client, AsyncClient],
    tool: Optional[str] = None,
    *,
    entity: EntitySpec,
    timeout: float = 30.0,
    **fields: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a stub whose parameters are the tool's arguments.

    `entity` is `(type, argument)` — the entity's type and the name of the parameter
    holding its id (that parameter is not sent as an argument) — or a function of the
    call's arguments returning `(type, id)`. `tool` defaults to the function's name;
    `fields` are proposal fields (`intent`, `workflow_id`, `step`, ...). The wrapped
    function returns the normalized result for the model: `status`, `result`, `error`,
    `retry_recommendation`, `safe_user_message`, `operation_id` (and `next` when the
    operation is still in flight). With an `AsyncClient` the wrapper is a coroutine.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = tool or fn.__name__
        signature = inspect.signature(fn)

        def prepare(a: tuple, kw: dict) -> tuple[tuple[str, str], dict]:
            bound = signature.bind(*a, **kw)
            bound.apply_defaults()
            args = dict(bound.arguments)
            if callable(entity):
                return entity(args), args
            kind, argument = entity
            return (kind, str(args.pop(argument))), args

        if isinstance(client, AsyncClient):

            @functools.wraps(fn)
            async def call_async(*a: Any, **kw: Any) -> dict:
                ent, args = prepare(a, kw)
                answer = await client.propose_and_wait(name, ent, args, timeout=timeout, **fields)
                return answer.for_model()

            call_async.__opgate_tool__ = name  # type: ignore[attr-defined]
            return call_async

        @functools.wraps(fn)
        def call(*a: Any, **kw: Any) -> dict:
            ent, args = prepare(a, kw)
            return client.propose_and_wait(name, ent, args, timeout=timeout, **fields).for_model()

        call.__opgate_tool__ = name  # type: ignore[attr-defined]
        return call

    return wrap


__all__ = ["guarded_tool"]
