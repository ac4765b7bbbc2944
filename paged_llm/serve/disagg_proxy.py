"""A proxy in front of prefill servers and decode servers (vLLM's disaggregated-serving example):
each completion or chat request goes first to a prefill server with ``max_tokens`` 1, whose
KV connector saves the prompt's KV, then unchanged to a decode server, whose connector loads it;
the decode server's answer, streamed or not, is the client's. Servers are taken round-robin.

    python -m paged_llm.serve --model DIR --port 8100 --kv-transfer-config \\
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}'
    python -m paged_llm.serve --model DIR --port 8200 --kv-transfer-config '{... "kv_consumer" ...}'
    python -m paged_llm.serve.disagg_proxy --port 8000 --prefill http://localhost:8100 \\
        --decode http://localhost:8200

See docs/kv_transfer.md.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

# fields that would make the prefill request longer or other than "compute the prompt"
_PREFILL_DROPS = ("stream_options", "min_tokens", "best_of", "use_beam_search", "logprobs",
                  "top_logprobs", "prompt_logprobs", "response_format", "structured_outputs",
                  "guided_json", "guided_regex", "guided_choice", "guided_grammar")  # fmt: skip


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request the prefill server gets: the same prompt, one token, one sample, no stream."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, n=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _error(message: str, kind: str, status: int) -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def build_app(prefill_urls: list[str], decode_urls: list[str], timeout: float = 600.0) -> FastAPI:
    """The proxy's FastAPI app over these servers' base URLs."""
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode server")
    prefill, decode = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="paged-llm disaggregated prefill proxy", lifespan=lifespan)

    def headers(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

    async def forward(request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", "BadRequestError", 400)
        try:
            return await relay(request, path, body)
        except httpx.RequestError as err:  # a server is down or timed out: say which, a 502
            return _error(f"cannot reach {err.request.url}: {err!r}", "BadGatewayError", 502)

    async def relay(request: Request, path: str, body: dict[str, Any]) -> Response:
        """Prefill, then decode; the decode server's answer, streamed if it was asked for."""
        first = await client.post(f"{next(prefill)}{path}", json=prefill_body(body),
                                  headers=headers(request))  # fmt: skip
        if first.status_code != 200:  # the prompt itself was refused: say so, do not decode
            return Response(first.content, first.status_code, media_type="application/json")
        upstream = client.build_request("POST", f"{next(decode)}{path}", json=body,
                                        headers=headers(request))  # fmt: skip
        answer = await client.send(upstream, stream=True)
        if body.get("stream") and answer.status_code == 200:
            return StreamingResponse(answer.aiter_raw(), media_type="text/event-stream",
                                     background=BackgroundTask(answer.aclose))  # fmt: skip
        content = await answer.aread()
        await answer.aclose()
        return Response(content, answer.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        answer = await client.get(f"{decode_urls[0]}/v1/models", headers=headers(request))
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in [*prefill_urls, *decode_urls]:
            try:
                if (await client.get(f"{url}/health")).status_code != 200:
                    return Response(status_code=503)
            except httpx.HTTPError:
                return Response(status_code=503)
        return Response(status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and serve the proxy with uvicorn."""
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", required=True, help="prefill servers' base URLs")
    p.add_argument("--decode", nargs="+", required=True, help="decode servers' base URLs")
    args = p.parse_args(argv)
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
