"""vLLM's development endpoints, served only with ``VLLM_SERVER_DEV_MODE=1``: sleep mode
(``/sleep``, ``/wake_up``, ``/is_sleeping``; the engine needs ``--enable-sleep-mode``) and
``/collective_rpc``. They change the whole server's state (an RL trainer frees the GPU between
rollouts with them), so they are for trusted clients only; with ``--api-key`` they need it."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from paged_llm.serve.async_engine import AsyncEngine
from paged_llm.serve.errors import Conflict
from paged_llm.serve.protocol import read_request


class CollectiveRPCRequest(BaseModel):
    """``POST /collective_rpc``: a ModelRunner method by name, run on every rank."""

    model_config = ConfigDict(extra="forbid")
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def dev_routes(engine: AsyncEngine) -> APIRouter:
    """The routes; each runs on the engine thread between steps."""
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        """Free the engine's memory (level 1: offload weights; 2: discard them); 409 while
        requests run, 400 for a bad level or without --enable-sleep-mode."""

        def go(e: Any) -> None:
            if e.has_unfinished_requests():
                raise Conflict("requests are running; put the engine to sleep when it is idle")
            e.sleep(level)

        await engine.with_engine(go)
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        """Restore the memory of ``tags`` (repeat ``?tags=weights&tags=kv_cache``; none: all)."""
        await engine.with_engine(lambda e: e.wake_up(tags))
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.with_engine(lambda e: e.is_sleeping())}

    @router.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict[str, Any]:
        """``{"results": [...]}``, one per rank (a result JSON cannot hold is sent as its
        ``repr``); an error on any rank is a 400 with its message."""
        req = await read_request(request, CollectiveRPCRequest)
        results = await engine.with_engine(
            lambda e: e.collective_rpc(req.method, req.timeout, tuple(req.args), req.kwargs)
        )
        return {"results": [_jsonable(r) for r in results]}

    return router


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value
