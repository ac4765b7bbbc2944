"""The checks ``SamplingParams.validate`` runs on construction: every field in range, with an
error naming the first that is not (vLLM's limits)."""

from __future__ import annotations

import inspect
import math
from typing import Any

from paged_llm.sampling_params import RequestOutputKind, SamplingParams
from paged_llm.structured_output_params import GuidedDecodingParams
from paged_llm.utils.checks import is_int


def check_sampling_params(params: SamplingParams) -> None:
    """Raise ValueError naming the first out-of-range field; normalises the float fields (and
    logit bias values) to floats in place."""
    if not isinstance(params.n, int) or params.n < 1:
        raise ValueError(f"n must be a positive integer, got {params.n}")
    if not is_int(params.best_of) or params.best_of < params.n:
        raise ValueError(f"best_of must be an integer >= n ({params.n}), got {params.best_of!r}")
    for name in ("top_k", "max_tokens", "min_tokens"):  # counts: a float fails late
        value = getattr(params, name)
        if value is not None and not is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    # numbers used as floats: an int too large for a float fails here, not in a step
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):  # fmt: skip
        setattr(params, name, _as_float(name, getattr(params, name)))
    if not 0 <= params.temperature < math.inf:  # NaN fails too
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k is None or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {params.top_k}")
    if params.seed is not None and (not is_int(params.seed) or not -(2**63) <= params.seed < 2**63):
        # torch generators take 64-bit seeds; sample i of n uses seed + i
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {params.seed!r}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    if not 0 < params.repetition_penalty < math.inf:
        raise ValueError(
            f"repetition_penalty must be a finite number > 0, got {params.repetition_penalty}"
        )
    for token, bias in (params.logit_bias or {}).items():
        params.logit_bias[token] = bias = _as_float("logit_bias values", bias)
        if not is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {token}")
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        bad = [t for t in params.allowed_token_ids if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"allowed_token_ids must be token ids (ints >= 0), got {bad[:5]}")
    if params.guided_decoding is not None and not isinstance(
        params.guided_decoding, GuidedDecodingParams
    ):
        raise ValueError("structured_outputs must be a StructuredOutputsParams")
    if any(not isinstance(w, str) or not w.strip() for w in params.bad_words or []):
        raise ValueError("bad_words must be non-empty strings")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if params.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {params.min_tokens}")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise ValueError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and (not is_int(value) or value < 0):
            raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
    k = params.truncate_prompt_tokens
    if k is not None and (not is_int(k) or k < 1):
        raise ValueError(f"truncate_prompt_tokens must be None or an integer >= 1, got {k!r}")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise ValueError(f"stop must be non-empty strings, got {params.stop!r}")
    if not all(map(is_int, params.stop_token_ids)):
        raise ValueError(f"stop_token_ids must be token ids, got {params.stop_token_ids!r}")
    for fn in params.logits_processors or []:
        logits_processor_arity(fn)  # raises for anything but a 2- or 3-argument callable
    if not isinstance(params.output_kind, RequestOutputKind):
        raise ValueError(f"output_kind must be a RequestOutputKind, got {params.output_kind!r}")
    if params.output_kind is RequestOutputKind.DELTA and params.best_of > params.n:
        # the best n can change while the request runs; deltas could not follow them
        raise ValueError("best_of > n needs output_kind CUMULATIVE or FINAL_ONLY")
    for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(params, name)!r}")
    if params.extra_args is not None and not isinstance(params.extra_args, dict):
        raise ValueError(f"extra_args must be a dict or None, got {params.extra_args!r}")
    if not params.detokenize and params.stop:
        raise ValueError("stop strings need detokenize=True (use stop_token_ids instead)")


def _as_float(name: str, value: Any) -> float:
    """``value`` as a float (ints and floats only; bools count as neither)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float ({str(value)[:20]}...)") from None


def logits_processor_arity(fn: Any) -> int:
    """2 (``fn(output_ids, logits)``) or 3 (``fn(prompt_ids, output_ids, logits)``), as vLLM
    tells them apart; ValueError for anything else."""
    if not callable(fn):
        raise ValueError(f"logits_processors must be callables, got {fn!r}")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: vLLM's default form
        return 2
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keywords = [p for p in parameters if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(positional) not in (2, 3) or required_keywords:
        raise ValueError(
            "a logits processor takes (output_ids, logits) or (prompt_ids, output_ids, "
            f"logits), got {getattr(fn, '__name__', fn)!r}{inspect.signature(fn)}"
        )
    return len(positional)
