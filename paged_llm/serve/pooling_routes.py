"""The pooling routes: OpenAI's ``/v1/embeddings``, and vLLM's ``/score``, ``/rerank`` and
``/classify`` (each also under ``/v1``, rerank under ``/v2`` too), for a server started with
``--runner pooling`` (docs/pooling.md)."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paged_llm.pooling.scoring import check_cross_encoder, cosine_scores, score_pairs
from paged_llm.serve.async_engine import AsyncEngine, SubRequest
from paged_llm.serve.disconnect import unless_disconnected
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.prompts import completion_prompt, pair_prompt
from paged_llm.serve.protocol import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    completion_prompts,
    pooling_params,
    read_request,
)

if TYPE_CHECKING:
    from paged_llm.serve.app import ServerSettings


def pooling_routes(
    engine: AsyncEngine, settings: ServerSettings, model_name: Callable[[str | None], str]
) -> tuple[APIRouter, APIRouter]:
    """(the ``/v1`` routes, the unprefixed aliases); ``model_name`` checks a request's model
    and names the one it gets."""
    router = APIRouter(prefix="/v1")
    aliases = APIRouter()

    def _pooler(what: str, classifier: bool | None = None) -> Any:
        """This server's pooler; 400 unless it pools the way ``what`` (the route) needs:
        ``classifier`` True a sequence classifier, False an embedding model, None either."""
        pooler = engine.engine.pooler
        if pooler is None:
            raise BadRequest("this server generates text; start it with --runner pooling to "
                             "serve embeddings, scores and classes")  # fmt: skip
        if classifier is True and pooler.head is None:
            raise BadRequest(f"{what} needs a sequence-classification model; this server "
                             "embeds (/v1/embeddings, /score, /rerank)")  # fmt: skip
        if classifier is False and pooler.head is not None:
            raise BadRequest(f"{what} needs an embedding model; this server classifies "
                             "(/classify, and /score, /rerank with a cross-encoder)")  # fmt: skip
        try:
            pooler.require_one_vector(what)
        except ValueError as err:
            raise BadRequest(str(err)) from None
        return pooler

    def _pooling_subs(prompts: list[Any], req: Any, model: str) -> list[SubRequest]:
        """One pooling engine request per prompt (text, token ids or a prompt renderer)."""
        params = pooling_params(req)
        lora = settings.lora_modules.get(model)

        renders = [p if callable(p) else completion_prompt(p, req.add_special_tokens)
                   for p in prompts]  # fmt: skip
        return [SubRequest(render, params, priority=req.priority, lora_request=lora)
                for render in renders]  # fmt: skip

    async def _pool(request: Request, subs: list[SubRequest], prefix: str) -> tuple[str, Any]:
        """Run the pooling requests; (request id, outputs in order), or None outputs if the
        client went away."""
        group = await engine.submit(subs, request_id=f"{prefix}-{uuid.uuid4().hex}")
        try:
            outputs = await unless_disconnected(request, group.final_outputs())
        finally:
            group.close()
        return group.request_id, (None if outputs is False else outputs)

    async def _pool_inputs(
        request: Request, req: Any, what: str, classifier: bool, prefix: str
    ) -> tuple[str, list[Any]] | None:
        """Pool each of the request's ``input`` prompts on a server of the right kind (see
        ``_pooler``); (request id, outputs in order), or None if the client went away."""
        _pooler(what, classifier)
        subs = _pooling_subs(completion_prompts(req.input), req, model_name(req.model))
        request_id, outputs = await _pool(request, subs, prefix)
        return None if outputs is None else (request_id, outputs)

    @router.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        req = await read_request(request, EmbeddingRequest)
        model = model_name(req.model)
        pooled = await _pool_inputs(request, req, "/v1/embeddings", False, "embd")
        if pooled is None:
            return Response(status_code=499)  # nobody is listening any more
        request_id, outputs = pooled
        data = [{"object": "embedding", "index": i,
                 "embedding": _embedding_json(out.outputs.data, req.encoding_format)}
                for i, out in enumerate(outputs)]  # fmt: skip
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": model, "data": data, "usage": _usage(outputs)})  # fmt: skip

    async def _scores(
        request: Request, req: Any, firsts: list[Any], seconds: list[Any], what: str
    ) -> tuple[str, list[float], list[Any]] | None:
        """(request id, one score per pair, the outputs that count as usage), or None if the
        client went away. An embedding model scores the cosine of the two embeddings (each
        distinct input embedded once); a cross-encoder scores each pair as one input."""
        model = model_name(req.model)
        pooler = _pooler(what)
        try:
            distinct, pairs = score_pairs(firsts, seconds)
            if pooler.head is not None:
                check_cross_encoder(pooler.head.num_labels, what, "/classify")
        except ValueError as err:
            raise BadRequest(str(err)) from None
        if pooler.head is not None:
            joined = [pair_prompt(distinct[a], distinct[b]) for a, b in pairs]
            request_id, outputs = await _pool(request, _pooling_subs(joined, req, model), "score")
            if outputs is None:
                return None
            return request_id, [float(out.outputs.data[0]) for out in outputs], outputs
        request_id, outputs = await _pool(request, _pooling_subs(distinct, req, model), "score")
        if outputs is None:
            return None
        scores = cosine_scores([out.outputs.data for out in outputs], pairs)
        return request_id, scores, [outputs[j] for pair in pairs for j in pair]

    async def score(request: Request) -> Response:
        req = await read_request(request, ScoreRequest)
        result = await _scores(request, req, completion_prompts(req.text_1),
                               completion_prompts(req.text_2), "/score")  # fmt: skip
        if result is None:
            return Response(status_code=499)
        request_id, scores, counted = result
        data = [{"object": "score", "index": i, "score": value} for i, value in enumerate(scores)]
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": model_name(req.model), "data": data,
                             "usage": _usage(counted)})  # fmt: skip

    router.add_api_route("/score", score, methods=["POST"])
    aliases.add_api_route("/score", score, methods=["POST"])

    async def rerank(request: Request) -> Response:
        req = await read_request(request, RerankRequest)
        if not req.documents:
            raise BadRequest("documents must not be empty", param="documents")
        if req.top_n is not None and req.top_n < 0:
            raise BadRequest(f"top_n must be >= 0, got {req.top_n}", param="top_n")
        result = await _scores(request, req, [req.query], list(req.documents), "/rerank")
        if result is None:
            return Response(status_code=499)
        request_id, scores, counted = result
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    "document": {"text": d if isinstance(d := req.documents[i], str) else None}}
                   for i in order]  # fmt: skip
        tokens = _usage(counted)["total_tokens"]
        return JSONResponse({"id": request_id, "model": model_name(req.model),
                             "usage": {"total_tokens": tokens}, "results": results})  # fmt: skip

    router.add_api_route("/rerank", rerank, methods=["POST"])
    aliases.add_api_route("/rerank", rerank, methods=["POST"])
    aliases.add_api_route("/v2/rerank", rerank, methods=["POST"])

    async def classify(request: Request) -> Response:
        req = await read_request(request, ClassifyRequest)
        model = model_name(req.model)
        pooled = await _pool_inputs(request, req, "/classify", True, "classify")
        if pooled is None:
            return Response(status_code=499)
        request_id, outputs = pooled
        labels = getattr(engine.engine.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs,
                         "num_classes": len(probs)})  # fmt: skip
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": model, "data": data, "usage": _usage(outputs)})  # fmt: skip

    router.add_api_route("/classify", classify, methods=["POST"])
    aliases.add_api_route("/classify", classify, methods=["POST"])

    return router, aliases


def _usage(outputs: list[Any]) -> dict[str, int]:
    """OpenAI's usage block of pooling requests: prompt tokens only."""
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _embedding_json(data: Any, encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI returns it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()
