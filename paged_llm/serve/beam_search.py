"""vLLM's ``use_beam_search`` for ``/v1/completions`` and ``/v1/chat/completions``.

The server runs beam search the way vLLM's server does (``EngineClient.beam_search``): at every
step each live beam is one engine request for one token with its top ``2 * width`` logprobs, and
the offline search's rule (``paged_llm.beam_search.rank_extensions``) keeps the best ``width``
extensions. Other requests keep running between the steps. Each step's requests compute their
whole beam again unless the prefix cache (``--enable-prefix-caching``) holds it, where beams of
one prompt share their common blocks; the offline ``LLM.beam_search`` forks block tables
instead and computes each token once.
"""

from __future__ import annotations

from typing import Any

from paged_llm.beam_search import (
    BeamSearchParams,
    BeamSearchSequence,
    rank_extensions,
    score_beam,
)
from paged_llm.outputs import CompletionOutput, RequestOutput
from paged_llm.sampling_params import SamplingParams
from paged_llm.serve.async_engine import AsyncEngine, SubRequest
from paged_llm.serve.errors import BadRequest
from paged_llm.serve.prompts import PromptRenderer, check_fits, token_prompt
from paged_llm.serve.protocol import MAX_N

# request fields beam search does not honour: refused rather than ignored
_NOT_WITH_BEAMS = (
    "logprobs", "top_logprobs", "echo", "best_of", "stop", "stop_token_ids",
    "min_tokens", "tools", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "prompt_logprobs",
)  # fmt: skip


def beam_params(req: Any, max_tokens: int | None) -> BeamSearchParams:
    """The request's BeamSearchParams (``n`` is the beam width, as in vLLM); a 400 for a field
    beam search cannot honour, or a bad value."""
    if not 1 <= req.n <= MAX_N:
        raise BadRequest(f"n (the beam width) must be between 1 and {MAX_N}, got {req.n}",
                         param="n")  # fmt: skip
    for name in _NOT_WITH_BEAMS:
        value = getattr(req, name, None)
        if value not in (None, False, 0, [], ""):
            raise BadRequest(f"'{name}' is not supported with use_beam_search", param=name)
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_tokens if max_tokens is not None else 1,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty,
        )
    except ValueError as err:
        raise BadRequest(str(err)) from None


async def beam_search(
    engine: AsyncEngine,
    render: PromptRenderer,
    params: BeamSearchParams,
    request_id: str,
    unset_max_tokens: bool = False,  # the request left max_tokens to the server: fill the context
    priority: int = 0,
    lora_request: Any = None,
) -> RequestOutput:
    """The best ``beam_width`` beams of one prompt as a RequestOutput (one completion per beam,
    best first; text decoded without the prompt)."""
    prompt = await engine.render(render)  # on the tokenizer thread, too-long texts refused
    prompt_ids: list[int] = prompt["prompt_token_ids"]
    max_model_len = engine.engine.max_model_len
    if unset_max_tokens:
        params.max_tokens = max(1, max_model_len - len(prompt_ids))
    check_fits(len(prompt_ids), params.max_tokens, max_model_len)
    width = params.beam_width
    one_token = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    live: list[tuple[list[int], list[float], float]] = [([], [], 0.0)]  # tokens, logprobs, sum
    done: list[BeamSearchSequence] = []
    for step in range(params.max_tokens):
        subs = [SubRequest(token_prompt(prompt_ids + tokens), one_token, priority=priority,
                           lora_request=lora_request) for tokens, _, _ in live]  # fmt: skip
        outputs = await _run(engine, subs, f"{request_id}-step{step}")
        tops = [_top(out, 2 * width) for out in outputs]
        ranked = rank_extensions([s for _, _, s in live], tops, width,
                                 engine.engine.eos_token_id, params.ignore_eos)  # fmt: skip
        for i, tok, lp, total in ranked.ended:
            tokens, lps, _ = live[i]
            done.append(BeamSearchSequence(tokens + [tok], lps + [lp], total, None, "stop"))
        live = [(live[i][0] + [tok], live[i][1] + [lp], total) for i, tok, lp, total in ranked.kept]
        if not live:  # every hypothesis ended
            break
    done += [BeamSearchSequence(t, lps, total) for t, lps, total in live]  # at max_tokens
    done.sort(key=lambda s: score_beam(s, 0, params.length_penalty), reverse=True)
    best = done[:width]

    def decode(tokenizer: Any) -> list[str]:
        if tokenizer is None:
            return ["" for _ in best]
        return [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in best]

    texts = await engine.with_tokenizer(decode)
    completions = [
        CompletionOutput(j, text, s.tokens, s.cum_logprob, finish_reason=s.finish_reason)
        for j, (s, text) in enumerate(zip(best, texts))
    ]
    return RequestOutput(request_id, prompt.get("prompt"), prompt_ids, completions, True)


async def _run(engine: AsyncEngine, subs: list[SubRequest], request_id: str) -> list[Any]:
    """Every sub-request's final output, in order (their error raised)."""
    group = await engine.submit(subs, request_id=request_id)
    try:
        return await group.final_outputs()
    finally:
        group.close()


def _top(out: RequestOutput, k: int) -> list[tuple[float, int]]:
    """The ``k`` most likely next tokens of a one-token request: (logprob, token id)."""
    entry = out.outputs[0].logprobs[0]  # the sampled token and the top ``k``
    best = sorted(entry.items(), key=lambda kv: -float(kv[1]))[:k]
    return [(float(lp), tok) for tok, lp in best]
