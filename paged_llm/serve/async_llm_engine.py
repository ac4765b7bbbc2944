"""vLLM's ``AsyncLLMEngine``, for your own asyncio server: ``async for output in
engine.generate(prompt, sampling_params, request_id)``.

A thin front on the server's ``AsyncEngine`` (one thread owns the ``LLMEngine`` and steps it
while requests are unfinished; see ``async_engine.py``), with vLLM's method names and errors:
bad input raises ``ValueError`` before anything runs, leaving a ``generate`` loop early (or
``abort``) aborts the request and frees its KV blocks, and an engine that has failed raises
``RuntimeError`` (``errored`` / ``dead_error`` say why).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial
from typing import Any

from paged_llm.config import EngineArgs
from paged_llm.engine.inputs import to_token_ids
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.outputs import RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import AsyncEngine, SubRequest
from paged_llm.serve.errors import BadRequest, EngineUnavailable
from paged_llm.serve.metrics import ServerMetrics


class AsyncEngineArgs(EngineArgs):
    """vLLM's arguments of the async engine: the same as ``EngineArgs``."""


class AsyncLLMEngine:
    """An LLMEngine stepped on a background thread, streaming outputs to asyncio code."""

    def __init__(self, engine: LLMEngine, start_engine_loop: bool = True) -> None:
        self.engine = engine  # the synchronous engine, as in vLLM
        self.start_engine_loop = start_engine_loop  # start on the first generate()
        self._loop = AsyncEngine(engine, ServerMetrics(engine.config.model.model))

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs | None = None, start_engine_loop: bool = True, **kwargs: Any
    ) -> AsyncLLMEngine:
        """Build from ``AsyncEngineArgs`` (or ``EngineArgs``, or the same keyword arguments)."""
        return cls(LLMEngine.from_engine_args(engine_args, **kwargs), start_engine_loop)

    # ---- the background loop ------------------------------------------------------------------
    def start_background_loop(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._loop.start(asyncio.get_running_loop())

    @property
    def is_running(self) -> bool:
        """True while the engine thread accepts requests."""
        return self._loop.is_running

    @property
    def errored(self) -> bool:
        """True once the engine failed (every request then raises RuntimeError)."""
        return self._loop.dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine failed, if it did."""
        return self._loop.dead

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request and stop the engine thread."""
        await self._loop.shutdown(timeout)

    # ---- requests -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Any = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as it runs (cumulative unless its ``output_kind`` asks
        otherwise); the last one has ``finished`` set. ``prompt``: text, ``{"prompt": text}``
        or ``{"prompt_token_ids": [...]}``, as ``LLM.generate`` takes; ``lora_request``: a
        LoRARequest (with ``enable_lora``)."""
        if not self._loop.started and self.start_engine_loop:
            self.start_background_loop()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(sampling_params).__name__}")
        # tokenized on a tokenizer thread, as the server's prompts are, not the engine's
        sub = SubRequest(partial(_tokenized, prompt), sampling_params, check_fits=False,
                         priority=priority, lora_request=lora_request)  # fmt: skip
        try:
            group = await self._loop.submit([sub], str(request_id))
        except BadRequest as err:
            raise ValueError(err.message) from None
        except EngineUnavailable as err:
            raise RuntimeError(err.message) from None
        try:
            async for update in group.updates():
                if update.error is not None:
                    raise RuntimeError(update.error.message)
                if update.aborted:
                    return
                yield replace(update.output, request_id=group.request_id)
        finally:
            group.close()  # aborts the request unless it finished

    async def abort(self, request_id: str) -> None:
        """Abort a request: its ``generate`` loop ends, and its KV blocks are freed."""
        self._loop.abort(str(request_id))

    async def get_tokenizer(self) -> Any:
        """The model's tokenizer (None if it has none)."""
        return self.engine.tokenizer

    # ---- sleep mode, calls on every rank (vLLM's names) --------------------------------------
    async def _on_engine(self, fn: Any) -> Any:
        """``fn(engine)`` on the engine thread between steps; BadRequest -> ValueError."""
        if not self._loop.started and self.start_engine_loop:
            self.start_background_loop()
        try:
            return await self._loop.with_engine(fn)
        except BadRequest as err:
            raise ValueError(err.message) from None
        except EngineUnavailable as err:
            raise RuntimeError(err.message) from None

    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` (needs ``enable_sleep_mode=True`` and no running requests)."""
        await self._on_engine(lambda e: e.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLMEngine.wake_up``: restore ``tags`` ("weights", "kv_cache"; None: both)."""
        await self._on_engine(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        """True while any of the engine's memory is asleep."""
        return await self._on_engine(lambda e: e.is_sleeping())

    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold cached blocks."""
        return await self._on_engine(lambda e: e.reset_prefix_cache())

    async def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:  # fmt: skip
        """``LLMEngine.collective_rpc`` between steps: the results of every rank."""
        return await self._on_engine(lambda e: e.collective_rpc(method, timeout, args, kwargs))

    async def check_health(self) -> None:
        """Raise RuntimeError if the engine has failed or its loop has stopped."""
        if self.errored:
            raise RuntimeError(f"the engine failed: {self.dead_error!r}")
        if self._loop.started and not self.is_running:
            raise RuntimeError("the engine loop has stopped")


def _tokenized(prompt: Any, tokenizer: Any) -> dict[str, Any]:
    """``prompt`` (text, a prompt dict or token ids) as the engine's token-ids input, tokenized
    as the engine would (``to_token_ids``); a BadRequest for what it cannot take."""
    try:
        text, ids = to_token_ids(prompt, tokenizer)
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return {"prompt_token_ids": ids, "prompt": text}
