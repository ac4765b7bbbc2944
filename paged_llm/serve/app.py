"""The FastAPI app: OpenAI routes, /health, /metrics, API-key check and OpenAI-style errors."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_llm.metrics.run_info import hardware_info
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import AsyncEngine, RequestGroup, SubRequest, Update
from paged_llm.serve.beam_search import beam_params, beam_search
from paged_llm.serve.dev_routes import dev_routes
from paged_llm.serve.disconnect import unless_disconnected
from paged_llm.serve.errors import (
    APIError,
    BadRequest,
    Conflict,
    ModelNotFound,
    Unauthorized,
    error_body,
)
from paged_llm.serve.limits import RequestLimits
from paged_llm.serve.pooling_routes import pooling_routes
from paged_llm.serve.prompts import chat_prompt, completion_prompt, text_prompt
from paged_llm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    chat_messages,
    completion_prompts,
    max_tokens_unset,
    read_request,
    requested_max_tokens,
    sampling_params,
)
from paged_llm.serve.render import (
    Choices,
    chat_chunks,
    completion_chunk,
    usage_chunk,
    whole_response,
)
from paged_llm.serve.replies import ChatReply
from paged_llm.serve.responses import (
    EventSequence,
    ResponseRun,
    ResponsesRequest,
    ResponseStore,
    input_messages,
    to_chat_request,
)
from paged_llm.serve.tool_calls import Tool, ToolParser, parse_tools, tool_mode

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """What the app needs beyond the engine."""

    served_model_names: list[str]
    model_root: str = ""  # the --model argument, shown as ``root`` in /v1/models
    api_key: str | None = None
    chat_template: str | None = None  # overrides the tokenizer's
    max_logprobs: int = 20
    log_requests: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # --lora-modules: served name -> LoRARequest; a request selects one by its "model" field
    lora_modules: dict[str, Any] = field(default_factory=dict)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    allow_runtime_lora_updating: bool = False
    # --enable-auto-tool-choice with --tool-call-parser: how "auto" finds calls (None: refused)
    tool_parser: ToolParser | None = None
    # /v1/responses kept for previous_response_id and GET (in memory; the oldest forgotten)
    max_stored_responses: int = 1000
    # vLLM's VLLM_SERVER_DEV_MODE: /sleep, /wake_up, /is_sleeping, /collective_rpc
    dev_mode: bool = False
    # body size, JSON depth and list lengths a request may have (docs/serving.md, "Limits")
    limits: RequestLimits = field(default_factory=RequestLimits)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="paged-llm OpenAI-compatible server", lifespan=lifespan)
    app.state.engine = engine
    app.state.settings = settings
    _add_error_handlers(app)
    app.include_router(_public_routes(engine))
    app.include_router(_tokenizer_routes(engine, settings))
    routers = _openai_routes(engine, settings)
    if settings.dev_mode:
        routers.append(dev_routes(engine))
    for router in routers:
        app.include_router(router, dependencies=[Depends(_api_key_check(settings))])
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        body = error_body(str(err.detail), "invalid_request_error", code=str(err.status_code))
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s", request.url.path)
        body = error_body(f"internal server error: {err!r}", "internal_server_error")
        return JSONResponse(body, status_code=500)


def _api_key_check(settings: ServerSettings) -> Any:
    expected = settings.api_key.encode() if settings.api_key is not None else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), expected
        ):
            raise Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')")

    return check


def _public_routes(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()
    hardware = hardware_info(str(engine.engine.device))

    @router.get("/health")
    async def health() -> Response:
        """200 while the engine loop runs and keeps up; 503 once it failed, shuts down, or one
        step has run longer than ``--engine-stall-timeout`` (a hung loop)."""
        if not engine.is_running:
            body = error_body("the engine is not running", "service_unavailable")
            return JSONResponse(body, status_code=503)
        stalled = engine.stalled_for()
        if stalled is not None:
            message = (f"the engine loop has been inside one step for {stalled:.1f} s (limit "
                       f"{engine.stall_timeout:g} s, --engine-stall-timeout)")  # fmt: skip
            return JSONResponse(error_body(message, "service_unavailable"), status_code=503)
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = engine.metrics.render(engine.gauges)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's: drop every cached prefix block (e.g. between benchmark runs)."""
        if not await engine.with_engine(lambda e: e.reset_prefix_cache()):
            raise Conflict("requests are running and hold cached blocks; retry when idle")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict[str, Any]:
        """vLLM's version field, plus the hardware the engine runs on (for benchmark records)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("paged-llm")
        except PackageNotFoundError:
            number = "unknown"
        return {"version": number, "hardware": hardware}

    return router


def _chat_render(req: Any, settings: ServerSettings, tools: list[Tool]) -> Any:
    """The prompt renderer of a request's ``messages`` (chat, ``/tokenize``) and the tools the
    model is offered, with the server's or the tokenizer's chat template."""
    return chat_prompt(chat_messages(req.messages), settings.chat_template,
                       req.add_generation_prompt, req.continue_final_message,
                       req.chat_template_kwargs, [t.raw for t in tools])  # fmt: skip


def _check_model(settings: ServerSettings, requested: str | None) -> None:
    known = (*settings.served_model_names, *settings.lora_modules)
    if requested is not None and requested not in known:
        raise ModelNotFound(f"The model `{requested}` does not exist.", param="model")


def _lora_admin_routes(router: APIRouter, engine: AsyncEngine, settings: ServerSettings) -> None:
    """vLLM's run-time adapter loading (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set, as it
    reads any path the server can)."""

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        from paged_llm.lora.request import LoRARequest

        req = await read_request(request, LoadLoRAAdapterRequest)
        name = req.lora_name
        if name in settings.lora_modules or name in settings.served_model_names:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.")
        known = [lora.lora_int_id for lora in settings.lora_modules.values()]
        lora = LoRARequest(name, max(known, default=0) + 1, req.lora_path)
        await engine.with_engine(lambda e: e.add_lora(lora))  # checks it; ValueError -> 400
        if name in settings.lora_modules:  # a concurrent load of the same name won
            await engine.with_engine(lambda e: e.remove_lora(lora.lora_int_id))
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.")
        settings.lora_modules[name] = lora
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await read_request(request, UnloadLoRAAdapterRequest)
        lora = settings.lora_modules.get(req.lora_name)
        if lora is None:
            raise ModelNotFound(f"The lora adapter '{req.lora_name}' cannot be found.")
        await engine.with_engine(lambda e: e.remove_lora(lora.lora_int_id))  # in use -> 400
        settings.lora_modules.pop(req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _tokenizer_routes(engine: AsyncEngine, settings: ServerSettings) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize`` (outside ``/v1``, so without the API key, as
    in vLLM). The tokenizer runs on a tokenizer thread, never the engine's."""
    router = APIRouter()
    max_model_len = engine.engine.max_model_len
    vocab_size = engine.engine.vocab_size

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await read_request(request, TokenizeRequest)
        _check_model(settings, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.messages is not None:
            render = _chat_render(req, settings, parse_tools(req.tools))
        else:
            render = text_prompt(req.prompt, req.add_special_tokens)
        ids = (await engine.with_tokenizer(render))["prompt_token_ids"]
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_request(request, DetokenizeRequest)
        _check_model(settings, req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary", param="tokens")

        def decode(tokenizer: Any) -> str:
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer")
            return tokenizer.decode(req.tokens)

        return {"prompt": await engine.with_tokenizer(decode)}

    return router


def _openai_routes(engine: AsyncEngine, settings: ServerSettings) -> list[APIRouter]:
    """The /v1 routes, and vLLM's unprefixed aliases of some of them (``/score``,
    ``/rerank``, ``/classify``; and ``/v2/rerank``)."""
    router = APIRouter(prefix="/v1")
    aliases = APIRouter()
    max_model_len = engine.engine.max_model_len
    defaults = engine.engine.generation_defaults.sampling  # fill the fields a request leaves unset

    def model_name(requested: str | None) -> str:
        _check_model(settings, requested)
        return settings.served_model_names[0] if requested is None else requested

    @router.get("/models")
    async def models() -> dict[str, Any]:
        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": settings.created,
                    "owned_by": "paged-llm", "root": root, "parent": parent,
                    "max_model_len": max_model_len}  # fmt: skip

        base = settings.served_model_names[0]
        data = [card(name, settings.model_root or name, None)
                for name in settings.served_model_names]  # fmt: skip
        data += [card(name, lora.lora_path, lora.base_model_name or base)
                 for name, lora in settings.lora_modules.items()]  # fmt: skip
        return {"object": "list", "data": data}

    if settings.allow_runtime_lora_updating:
        _lora_admin_routes(router, engine, settings)

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        req = await read_request(request, CompletionRequest)
        model = model_name(req.model)
        # echo shows token prompts as text
        renders = [completion_prompt(p, req.add_special_tokens, decode=req.echo)
                   for p in completion_prompts(req.prompt)]  # fmt: skip
        if req.use_beam_search:
            return await _beam_response(request, req, renders, model, chat=False)
        params = sampling_params(req, settings.max_logprobs, defaults, limits=settings.limits)
        # one engine request per prompt; the engine samples its n choices itself
        subs = [
            SubRequest(
                render,
                params,
                default_max_tokens=max_tokens_unset(req),
                priority=req.priority,
                lora_request=settings.lora_modules.get(model),
            )
            for render in renders
        ]
        choices = Choices(
            [s.params for s in subs],
            echo=req.echo,
            prompt_only=req.echo and req.max_tokens == 0,
            return_token_ids=req.return_token_ids,
        )
        return await _generate(request, req, subs, choices, model, chat=False)

    def _chat_work(
        req: ChatCompletionRequest, model: str, always_reply: bool = False
    ) -> tuple[list[SubRequest], Choices]:
        """The engine request of a chat request, and its choices' progress (with a ChatReply
        when reasoning or tools need one, or ``always_reply``)."""
        tools = parse_tools(req.tools)
        mode = tool_mode(tools, req.tool_choice, settings.tool_parser, req.parallel_tool_calls)
        forced = mode.structured_output() if mode is not None else None
        params = sampling_params(req, settings.max_logprobs, defaults, forced, settings.limits)
        if mode is not None and mode.keeps_special_tokens():  # e.g. Mistral's [TOOL_CALLS]
            params = dataclasses.replace(params, skip_special_tokens=False)
        render = _chat_render(req, settings, tools)  # offered even with tool_choice "none"
        unset = max_tokens_unset(req)
        lora = settings.lora_modules.get(model)
        subs = [SubRequest(render, params, default_max_tokens=unset, priority=req.priority,
                           lora_request=lora)]  # fmt: skip
        reasoning = engine.engine.reasoning
        needed = reasoning or mode or always_reply
        reply = ChatReply(reasoning, mode) if needed else None  # None: plain text
        return subs, Choices([params], reply=reply, return_token_ids=req.return_token_ids)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await read_request(request, ChatCompletionRequest)
        model = model_name(req.model)
        if req.use_beam_search:  # (with tools it is a 400: beam_params)
            render = _chat_render(req, settings, [])
            return await _beam_response(request, req, [render], model, chat=True)
        subs, choices = _chat_work(req, model)
        return await _generate(request, req, subs, choices, model, chat=True)

    store = ResponseStore(settings.max_stored_responses)
    running: dict[str, tuple[asyncio.Task, ResponseRun]] = {}  # background ones, still running

    @router.post("/responses")
    async def responses(request: Request) -> Response:
        req = await read_request(request, ResponsesRequest)
        model = model_name(req.model)
        if req.background and store.capacity == 0:
            raise BadRequest("background responses need the response store "
                             "(--max-stored-responses > 0)", param="background")  # fmt: skip
        earlier = store.conversation(req.previous_response_id) if req.previous_response_id else []
        conversation = earlier + input_messages(req.input)
        subs, choices = _chat_work(to_chat_request(req, conversation), model, always_reply=True)
        group = await engine.submit(subs, request_id=f"resp_{uuid.uuid4().hex}")
        tags = engine.engine.reasoning_tags
        run = ResponseRun(group.request_id, model, req, choices, conversation,
                          tags[1] if tags else None)  # fmt: skip
        if settings.log_requests:
            logger.info("request %s: a response", group.request_id)
        if req.background:  # answered now; GET polls, /cancel aborts
            body = run.store_unfinished(store, "queued")
            task = asyncio.create_task(_background_response(group, run, store))
            running[run.rid] = (task, run)
            task.add_done_callback(lambda _, rid=run.rid: running.pop(rid, None))
            return JSONResponse(body)
        if req.stream:
            return _GroupStream(group, _response_sse(group, run, store))
        try:
            done = await unless_disconnected(request, _whole_response(group, run, store))
        finally:
            group.close()
        if not done:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(run.final)

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id)

    @router.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        """Abort a background response still running; one that finished is returned as is."""
        entry = running.get(response_id)
        if entry is None:
            body = store.get(response_id)
            if not body.get("background"):
                raise BadRequest("only background responses can be cancelled")
            return body
        task, run = entry
        if not task.cancel():  # it finished just now (its done callback has not run yet)
            return store.get(response_id)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return run.store_unfinished(store, "cancelled")

    @router.get("/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, order: str = "desc", limit: str = "20", after: str | None = None
    ) -> dict[str, Any]:
        if not limit.isdigit():  # checked here, so the error has OpenAI's shape
            raise BadRequest(f"limit must be an integer, got {limit!r}", param="limit")
        return store.input_items(response_id, order, int(limit), after)

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def _beam_response(
        request: Request, req: Any, renders: list[Any], model: str, chat: bool
    ) -> Response:
        """vLLM's ``use_beam_search``: the ``n`` best beams of each prompt as its choices."""
        unset = max_tokens_unset(req)
        params = beam_params(req, requested_max_tokens(req)[0])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        lora = settings.lora_modules.get(model)
        searches = [
            beam_search(
                engine, r, dataclasses.replace(params), f"{rid}-{i}", unset, req.priority, lora
            )  # fmt: skip
            for i, r in enumerate(renders)
        ]
        outputs = await unless_disconnected(request, asyncio.gather(*searches))
        if outputs is False:
            return Response(status_code=499)  # nobody is listening any more
        choices = Choices([SamplingParams(n=params.beam_width) for _ in outputs],
                          return_token_ids=req.return_token_ids)  # fmt: skip
        updates = [Update(i, output=out) for i, out in enumerate(outputs)]
        created = int(time.time())
        if req.stream:
            # beams are only final when the search ends: the stream carries every beam's
            # whole text in one chunk each, then usage (when asked) and [DONE], so streaming
            # clients work unchanged (vLLM's completions endpoint answers it unstreamed)
            events = _sse(_replay(updates), rid, choices, model, created, chat, req)
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        for update in updates:
            choices.apply(update)
        return JSONResponse(whole_response(rid, created, model, choices, chat))

    async def _generate(
        request: Request,
        req: Any,
        subs: list[SubRequest],
        choices: Choices,
        model: str,
        chat: bool,
    ) -> Response:
        prefix = "chatcmpl" if chat else "cmpl"
        group = await engine.submit(subs, request_id=f"{prefix}-{uuid.uuid4().hex}")
        if settings.log_requests:
            logger.info(
                "request %s: %d engine request(s), n=%d", group.request_id, len(subs), req.n
            )
        created = int(time.time())
        if req.stream:
            events = _sse(group.updates(), group.request_id, choices, model, created, chat, req)
            return _GroupStream(group, events)
        try:
            done = await unless_disconnected(request, _collect(group, choices))
        finally:
            group.close()
        if not done:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(whole_response(group.request_id, created, model, choices, chat))

    return [router, aliases, *pooling_routes(engine, settings, model_name)]


class _GroupStream(StreamingResponse):
    """An SSE response that closes (and so aborts, if unfinished) its group however it ends:
    finished, failed, or cancelled by the client's disconnect before it even started."""

    def __init__(self, group: RequestGroup, events: AsyncIterator[str]):
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.group = group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _event(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


async def _replay(updates: list[Update]) -> AsyncIterator[Update]:
    """Updates already at hand, as the async stream ``_sse`` reads."""
    for update in updates:
        yield update


async def _sse(
    updates: AsyncIterator[Update],
    rid: str,
    choices: Choices,
    model: str,
    created: int,
    chat: bool,
    req: Any,  # its stream_options
) -> AsyncIterator[str]:
    """The SSE events of a stream of updates to ``choices``: chunks, the usage chunk when
    ``stream_options`` asks, ``[DONE]``; ``continuous_usage_stats`` (vLLM's) puts the usage so
    far into every chunk too."""
    opts = req.stream_options
    usage = bool(opts and opts.include_usage)
    continuous_usage = usage and bool(opts and opts.continuous_usage_stats)
    async for update in updates:
        if update.error is not None:
            yield _event(update.error.body())
            break
        for delta in choices.apply(update):  # one chunk (chat: or two) per changed choice
            if chat:
                chunks = chat_chunks(rid, created, model, choices, delta)
            else:
                chunks = [completion_chunk(rid, created, model, choices, delta)]
            for chunk in chunks:
                if continuous_usage:
                    chunk["usage"] = choices.usage()
                yield _event(chunk)
    else:
        if usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield _event(usage_chunk(rid, created, model, obj, choices))
    yield "data: [DONE]\n\n"


async def _response_steps(
    group: RequestGroup, run: ResponseRun, store: ResponseStore
) -> AsyncIterator[dict[str, Any]]:
    """A response's events as its engine request runs (its error raised); the finished
    response is ``run.final``, and is stored unless the request says not to."""
    for event in run.opening_events():
        yield event
    async for update in group.updates():
        if update.error is not None:
            raise update.error
        for delta in run.choices.apply(update):
            for event in run.feed(delta.text, finished=delta.finish_reason is not None):
                yield event
    events = run.finish()
    run.store_in(store)
    for event in events:
        yield event


async def _background_response(group: RequestGroup, run: ResponseRun, store: ResponseStore):
    """Run a background response to its end, keeping its status in the store (the engine
    request is aborted if the task is cancelled)."""
    try:
        run.store_unfinished(store, "in_progress")
        await _whole_response(group, run, store)
    except APIError as err:
        error = {"code": err.code or err.error_type, "message": err.message}
        run.store_unfinished(store, "failed", error=error)
    finally:
        group.close()


async def _response_sse(
    group: RequestGroup, run: ResponseRun, store: ResponseStore
) -> AsyncIterator[str]:
    """A streamed response's SSE (no ``[DONE]``: the Responses API ends with
    ``response.completed``, ``.incomplete`` or ``.failed``)."""
    sequence = EventSequence()
    try:
        async for event in _response_steps(group, run, store):
            yield sequence.sse(event, _json)
    except APIError as err:
        for event in run.failed(err.code or err.error_type, err.message):
            yield sequence.sse(event, _json)


async def _whole_response(group: RequestGroup, run: ResponseRun, store: ResponseStore) -> bool:
    """Run a response that is not streamed through the same steps (``run.final``)."""
    async for _ in _response_steps(group, run, store):
        pass
    return True


async def _collect(group: RequestGroup, choices: Choices) -> bool:
    async for update in group.updates():
        if update.error is not None:
            raise update.error
        choices.apply(update)
    return True
