"""AsyncEngine: the blocking LLMEngine behind asyncio handlers.

One dedicated thread owns the engine (and the tokenizer it detokenizes steps with); prompts are
tokenized before they reach it, on worker threads with their own tokenizer copies
(``serve/tokenization.py``). Between steps it drains a queue of add / abort / stop commands,
then runs ``step()`` while any request is unfinished, and hands each step's outputs to the event
loop with one ``call_soon_threadsafe``. Handlers never touch the engine; they submit a group of
engine requests (one per prompt, each sampling the request's ``n`` choices itself, sharing the
prompt's KV blocks) and read its updates from an asyncio queue. Closing a group that has not
finished aborts it, which frees its KV blocks: that is how a client
disconnect reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from paged_llm.engine.inputs import truncate_prompt
from paged_llm.engine.llm_engine import LLMEngine
from paged_llm.engine.sleep_mode import EngineAsleepError
from paged_llm.outputs import LogprobEntry, PoolingRequestOutput, RequestOutput
from paged_llm.pooling_params import PoolingParams
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.errors import APIError, BadRequest, EngineUnavailable, ServerBusy
from paged_llm.serve.metrics import EngineGauges, ServerMetrics, engine_gauges
from paged_llm.serve.prompts import PromptRenderer, check_fits
from paged_llm.serve.tokenization import TokenizerPool

logger = logging.getLogger(__name__)

_LIVENESS_S = 1.0  # how often waiting handlers check that the engine thread is still alive
DEFAULT_STALL_TIMEOUT_S = 60.0  # /health fails once one step (or command) runs longer


@dataclass
class SubRequest:
    """One engine request of a server request: its prompt renderer and sampling params
    (``params.n`` choices, sampled by the engine as one request), or pooling params (one
    embedding)."""

    render: PromptRenderer
    params: SamplingParams | PoolingParams
    # the server's rule: refuse prompt + max_tokens beyond the context (the offline engine,
    # and vLLM's AsyncLLMEngine, cap max_tokens instead)
    check_fits: bool = True
    # max_tokens is the model's recommended default (the request left it unset): capped to the
    # context like vLLM's default, not refused
    default_max_tokens: bool = False
    priority: int = 0  # with scheduling_policy="priority": smaller runs sooner
    lora_request: Any = None  # the LoRA adapter the request's "model" names (None: base model)

    @property
    def num_seqs(self) -> int:
        """Sequences this engine request runs: one per choice (one for an embedding)."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1


@dataclass
class Update:
    """Progress of one engine request: its latest output, or why it ended without one."""

    index: int  # position in the group's sub-requests
    output: RequestOutput | None = None  # every choice's cumulative text / token ids / logprobs
    token_strings: dict[int, str] = field(default_factory=dict)  # for logprob token ids
    aborted: bool = False
    error: APIError | None = None

    @property
    def finished(self) -> bool:
        """True for the last update of this sub-request."""
        return self.aborted or self.error is not None or bool(self.output and self.output.finished)


class RequestGroup:
    """Handler-side view of the engine requests behind one HTTP request."""

    def __init__(self, engine: AsyncEngine, request_id: str, subs: list[SubRequest]):
        self.engine = engine
        self.request_id = request_id
        self.subs = subs
        self.sub_ids = [f"{request_id}-{i}" for i in range(len(subs))]
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.unstarted = set(range(len(subs)))  # no output yet: n each against max_waiting
        self.unfinished = set(range(len(subs)))
        self.closed = False

    async def updates(self) -> AsyncIterator[Update]:
        """Yield updates until every sub-request has reported its last one."""
        pending = set(range(len(self.subs)))
        while pending:
            # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation that arrives
            # just as an update does, and then a disconnected client's request ran to the end.
            getter = asyncio.ensure_future(self.queue.get())
            try:
                done, _ = await asyncio.wait({getter}, timeout=_LIVENESS_S)
            except BaseException:
                getter.cancel()  # cancelled ourselves: stop waiting too
                raise
            if done:
                update = getter.result()
            else:
                getter.cancel()
                if self.engine.thread_alive:
                    continue
                # the engine thread is gone without telling us: end instead of hanging
                error = EngineUnavailable("the engine stopped")
                for i in sorted(pending):
                    yield Update(i, error=error)
                return
            if update.finished:
                pending.discard(update.index)
            yield update

    async def final_outputs(self) -> list[Any]:
        """Every sub-request's last output, in order; the first error is raised, and
        EngineUnavailable if the engine aborted one before its end (it is shutting down)."""
        outputs: list[Any] = [None] * len(self.subs)
        async for update in self.updates():
            if update.error is not None:
                raise update.error
            if update.aborted:
                raise EngineUnavailable("the engine stopped before the request finished")
            if update.output is not None:
                outputs[update.index] = update.output
        return outputs

    def close(self) -> None:
        """Forget the group; abort its unfinished engine requests. Idempotent."""
        self.engine._close(self)


@dataclass
class _Add:
    group: RequestGroup
    prompts: list[dict[str, Any]]  # each sub-request's rendered prompt (token ids, text)
    future: asyncio.Future
    arrival_time: float


@dataclass
class _Abort:
    sub_ids: list[str]


@dataclass
class _Stop:
    pass


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread, between steps (the tokenizer's and the
    engine's only thread)."""

    fn: Any
    future: asyncio.Future


@dataclass
class _Live:
    """Engine-thread bookkeeping of one submitted engine request (all its samples)."""

    group: RequestGroup
    index: int
    wants_logprobs: bool
    num_samples: int
    started: bool = False  # prompt tokens counted
    num_tokens: dict[int, int] = field(default_factory=dict)  # sample -> tokens reported
    finished: set[int] = field(default_factory=set)  # samples whose finish was counted

    @property
    def num_unfinished(self) -> int:
        """Samples an abort would cut short."""
        return self.num_samples - len(self.finished)


class AsyncEngine:
    """Runs an LLMEngine on a background thread and serves it to asyncio code."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        max_waiting: int | None = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
        tokenizer_threads: int = 4,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if stall_timeout is not None and not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 (or None), got {stall_timeout}")
        self.engine = engine
        self.stall_timeout = stall_timeout  # None: a busy engine is never reported stalled
        self.tokenizers = TokenizerPool(engine.tokenizer, engine.max_model_len, tokenizer_threads)
        self._working_since: float | None = None  # engine thread: when its current work began
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.gauges = EngineGauges()
        self.num_unstarted = 0  # event-loop side: submitted sequences without output yet
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._groups: dict[str, RequestGroup] = {}  # event-loop side, by request id
        self._live: dict[str, _Live] = {}  # engine-thread side, by sub-request id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None

    # ---- lifecycle (event loop) ---------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine thread."""
        self._stopping = True
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout)
        self.tokenizers.shutdown()

    @property
    def started(self) -> bool:
        """True once ``start()`` ran (the thread may have stopped since)."""
        return self._thread is not None

    @property
    def thread_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_running(self) -> bool:
        """True while the engine thread accepts requests."""
        return self.thread_alive and not self._stopping and self.dead is None

    def stalled_for(self) -> float | None:
        """Seconds the engine thread has been inside one step or command, if that is longer
        than ``stall_timeout`` (a hung step, a deadlock); None while it keeps up or waits idle."""
        since = self._working_since
        if since is None or self.stall_timeout is None:
            return None
        busy = time.monotonic() - since
        return busy if busy > self.stall_timeout else None

    # ---- requests (event loop) ----------------------------------------------------------------
    async def submit(self, subs: list[SubRequest], request_id: str | None = None) -> RequestGroup:
        """Validate and queue engine requests; raise an APIError (nothing queued) if any is bad.

        The caller must ``close()`` the returned group when done (also on cancellation).
        """
        num_seqs = sum(sub.num_seqs for sub in subs)
        self._check_admission(num_seqs)
        # tokenized on a tokenizer thread, never the engine's; checked again after it
        prompts = await self.tokenizers.run(self._render_all, subs)
        self._check_admission(num_seqs)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._groups:
            raise BadRequest(f"request id '{request_id}' is already in use")
        group = RequestGroup(self, request_id, subs)
        self._groups[group.request_id] = group
        self.num_unstarted += num_seqs
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Add(group, prompts, future, self.engine.clock()))
        try:
            await self._engine_result(future)
        except BaseException:  # invalid input, or the handler was cancelled meanwhile
            group.close()
            raise
        return group

    def _check_admission(self, num_seqs: int) -> None:
        """An APIError if the engine is down or the waiting bound leaves no room."""
        if not self.is_running:
            raise EngineUnavailable("the engine is not running (shutting down or failed)")
        if self.max_waiting is not None and num_seqs > self.max_waiting:
            raise BadRequest(
                f"this request needs {num_seqs} sequences (prompts x n), more than the server's "
                f"waiting limit of {self.max_waiting}"
            )
        if self.max_waiting is not None and self.num_unstarted + num_seqs > self.max_waiting:
            raise ServerBusy(
                f"too many waiting requests ({self.num_unstarted} waiting, limit "
                f"{self.max_waiting}); retry later"
            )

    def _render_all(self, subs: list[SubRequest]) -> list[dict[str, Any]]:
        """A tokenizer thread: every sub-request's prompt; a text that cannot fit the context is
        refused before it is tokenized (unless the request keeps only its last tokens)."""
        prompts = []
        for sub in subs:
            truncated = getattr(sub.params, "truncate_prompt_tokens", None) is not None
            prompts.append(sub.render(self.tokenizers.guarded(check_length=not truncated)))
        return prompts

    async def render(self, render: PromptRenderer) -> dict[str, Any]:
        """One prompt rendered on a tokenizer thread (texts that cannot fit refused early)."""
        if not self.is_running:
            raise EngineUnavailable("the engine is not running (shutting down or failed)")
        return await self.tokenizers.run(lambda: render(self.tokenizers.guarded()))

    def abort(self, request_id: str) -> bool:
        """Abort a submitted request from outside its handler, whose updates then end with
        ``aborted``; False if no such request is in flight."""
        group = self._groups.get(request_id)
        if group is None:
            return False
        for i in sorted(group.unfinished):  # a closed group gets no more updates from the engine
            group.queue.put_nowait(Update(i, aborted=True))
        group.close()
        return True

    def _close(self, group: RequestGroup) -> None:
        if group.closed:
            return
        group.closed = True
        self._groups.pop(group.request_id, None)
        self.num_unstarted -= sum(group.subs[i].num_seqs for i in group.unstarted)
        group.unstarted.clear()
        if group.unfinished:
            # FIFO after the _Add, so a group closed while being added is aborted too
            self._commands.put(_Abort([group.sub_ids[i] for i in sorted(group.unfinished)]))

    def _deliver(self, batch: list[tuple[RequestGroup, Update]]) -> None:
        """Event-loop callback: route one step's updates to their groups."""
        for group, update in batch:
            if group.closed:
                continue
            if update.index in group.unstarted:
                # the prompt is computed once for all samples, so they all count as started
                group.unstarted.discard(update.index)
                self.num_unstarted -= group.subs[update.index].num_seqs
            if update.finished:
                group.unfinished.discard(update.index)
            group.queue.put_nowait(update)

    def _resolve(
        self, future: asyncio.Future, error: BaseException | None, result: Any = None
    ) -> None:
        if future.done():  # the handler was cancelled meanwhile
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    async def with_tokenizer(self, fn: Any) -> Any:
        """``fn(tokenizer)`` computed on a tokenizer thread (the engine keeps stepping); its
        APIError reaches the caller, any other exception as a BadRequest."""
        if not self.is_running:
            raise EngineUnavailable("the engine is not running (shutting down or failed)")
        return await self.tokenizers.run(lambda: fn(self.tokenizers.tokenizer()))

    async def with_engine(self, fn: Any) -> Any:
        """``fn(engine)`` computed on the engine thread between steps (e.g. loading an adapter);
        its APIError reaches the caller, any other exception as a BadRequest."""
        if not self.is_running:
            raise EngineUnavailable("the engine is not running (shutting down or failed)")
        future = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, future))
        return await self._engine_result(future)

    async def _engine_result(self, future: asyncio.Future) -> Any:
        """A command's result, or EngineUnavailable if the engine thread dies before it."""
        while not future.done():
            await asyncio.wait({future}, timeout=_LIVENESS_S)
            if not future.done() and not self.thread_alive:
                raise EngineUnavailable("the engine stopped")
        return future.result()

    # ---- engine thread ------------------------------------------------------------------------
    def _post(self, callback: Any, *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed first at interpreter exit
            self._loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished_requests()):
                    return
                if self.engine.has_unfinished_requests():
                    self._working_since = time.monotonic()
                    self._step()
                self._snapshot()
                self._working_since = None
        except BaseException as err:  # a bug in the engine: fail every request, stay down
            logger.exception("the engine loop failed; the server cannot serve requests")
            self.dead = err
            self._fail_all(EngineUnavailable(f"the engine failed: {err!r}"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if idle); False once told to stop."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        self._working_since = time.monotonic()  # cleared by _run after the step that follows
        while True:
            if isinstance(command, _Stop):
                self._abort_all()
                self._snapshot()
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.sub_ids)
            elif isinstance(command, _Call):
                self._call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        group, added = command.group, []
        try:
            for index, (sub_id, sub, prompt) in enumerate(
                zip(group.sub_ids, group.subs, command.prompts)
            ):
                # the engine truncates first, so the kept prompt must fit (pooling requests
                # generate nothing: the engine's own length check is the whole rule)
                if sub.check_fits and isinstance(sub.params, SamplingParams):
                    ids = truncate_prompt(
                        prompt["prompt_token_ids"], sub.params.truncate_prompt_tokens
                    )
                    asked = None if sub.default_max_tokens else sub.params.max_tokens
                    check_fits(len(ids), asked, self.engine.max_model_len)
                try:
                    self.engine.add_request(
                        sub_id, prompt, sub.params, command.arrival_time, sub.priority,
                        lora_request=sub.lora_request,
                    )  # fmt: skip
                except ValueError as err:
                    raise BadRequest(str(err)) from None
                except EngineAsleepError as err:
                    raise EngineUnavailable(str(err)) from None
                added.append(sub_id)
                wants = getattr(sub.params, "logprobs", None) is not None
                self._live[sub_id] = _Live(group, index, wants, sub.num_seqs)
        except Exception as err:
            self._abort(added, notify=False)  # all or nothing: no half-added request stays
            if not isinstance(err, APIError):
                logger.exception("unexpected error while adding request %s", group.request_id)
                err = BadRequest(f"could not process the prompt: {err}")
            self._post(self._resolve, command.future, err)
            return
        self._post(self._resolve, command.future, None)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as err:
            if not isinstance(err, APIError):
                err = BadRequest(str(err))
            self._post(self._resolve, command.future, err)
            return
        self._post(self._resolve, command.future, None, result)

    def _abort(self, sub_ids: list[str], notify: bool = True) -> None:
        live = [sid for sid in sub_ids if sid in self._live]
        if not live:
            return
        self.engine.abort_request(live)  # every sample of each request
        entries = [self._live.pop(sid) for sid in live]
        if notify:  # a rejected add was never visible to anyone: not counted, not delivered
            self.metrics.record_aborted(sum(e.num_unfinished for e in entries))
            self._post(self._deliver, [(e.group, Update(e.index, aborted=True)) for e in entries])

    def _abort_all(self) -> None:
        self._abort(list(self._live))

    def _fail_all(self, error: APIError) -> None:
        batch = [(e.group, Update(e.index, error=error)) for e in self._live.values()]
        self._live.clear()
        # release handlers whose add is still queued, too
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, (_Add, _Call)):
                self._post(self._resolve, command.future, error)
        if batch:
            self._post(self._deliver, batch)

    def _step(self) -> None:
        outputs = self.engine.step()
        # the engine keeps per-step stats for experiments; a server would grow them forever
        self.engine.iteration_stats.clear()
        batch = []
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            strings = self._account(entry, out)
            if out.finished:
                del self._live[out.request_id]
                self.metrics.record_latencies(out.metrics)
            batch.append((entry.group, Update(entry.index, out, strings)))
        if batch:
            self._post(self._deliver, batch)

    def _account(self, entry: _Live, out: RequestOutput | PoolingRequestOutput) -> dict[int, str]:
        """Count one output's new tokens and finished samples; return new logprob strings."""
        strings: dict[int, str] = {}
        if not entry.started:  # the samples share one prompt: count it once
            entry.started = True
            self.metrics.record_tokens(len(out.prompt_token_ids), 0)
            if entry.wants_logprobs and out.prompt_logprobs:  # echo: complete by the first token
                strings.update(self._token_strings(out.prompt_logprobs, out.prompt_token_ids))
        if isinstance(out, PoolingRequestOutput):  # an embedding: a prompt and nothing more
            return strings
        for completion in out.outputs:
            seen = entry.num_tokens.get(completion.index, 0)
            self.metrics.record_tokens(0, len(completion.token_ids) - seen)
            if entry.wants_logprobs and completion.logprobs:
                strings.update(self._token_strings(completion.logprobs[seen:]))
            entry.num_tokens[completion.index] = len(completion.token_ids)
            if completion.finish_reason is not None and completion.index not in entry.finished:
                entry.finished.add(completion.index)
                self.metrics.record_finish_reason(completion.finish_reason)
        return strings

    def _token_strings(
        self, entries: Sequence[LogprobEntry | None], extra_ids: Sequence[int] = ()
    ) -> dict[int, str]:
        """The text of every token in ``entries`` (the engine decoded them already, into each
        Logprob's ``decoded_token``) and of ``extra_ids``, decoding only what is missing."""
        strings = {t: lp.decoded_token for e in entries if e for t, lp in e.items()
                   if lp.decoded_token is not None}  # fmt: skip
        no_text = self.engine.tokenizer is None
        for t in {t for e in entries if e for t in e}.union(extra_ids) - strings.keys():
            strings[t] = f"token_id:{t}" if no_text else self.engine.token_text(t)
        return strings

    def _snapshot(self) -> None:
        # one immutable object, swapped in whole: /metrics never sees a half-updated state
        self.gauges = engine_gauges(self.engine)
