"""Per-request changes to the logits before a token is chosen, with vLLM's semantics.

In the order applied:

0. ``logits_processors``: the user's callables (vLLM's), each row with its own history, on the
   model's logits before anything else, as vLLM V0 runs them.
1. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked while the
   output is shorter than ``min_tokens``.
2. ``bad_words``: a word's last token is masked when the output ends with the rest of it (a
   one-token word always); each word counts as written and after a space.
3. ``allowed_token_ids``: every other token is masked.
4. ``logit_bias``: ``{token_id: bias}`` added to the logits (OpenAI's field).
5. ``repetition_penalty`` r (CTRL, Keskar et al. 2019; transformers' and vLLM's form): every
   token seen in the prompt or the output has a positive logit divided by r, a negative one
   multiplied by r.
6. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): ``logit -= f * count + p *
   (count > 0)``, with ``count`` the token's occurrences in the output only.

Temperature, top-k/p and min-p (``top_k_top_p.py``) come after. Every row of one call belongs
to one request; row i may have seen more output than row 0 (speculative verification scores a draft
after the drafts before it), so each row gets its own output history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paged_llm.core.request import PLACEHOLDER_TOKEN, Request
from paged_llm.runner.batch import int_tensor, to_device
from paged_llm.sampling_params import SamplingParams
from paged_llm.sampling_params_checks import logits_processor_arity


def min_tokens_ban(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    """Tokens masked while the output is shorter than ``params.min_tokens``."""
    ban = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        ban.append(eos_token_id)
    return ban


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Token sequences of each bad word, as written and after a space (as vLLM)."""
    if words and tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this model has none")
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def apply_allowed_token_ids(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask every token outside ``params.allowed_token_ids`` (none when it is None)."""
    if params.allowed_token_ids is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[to_device(int_tensor(params.allowed_token_ids), logits.device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    return logits


def process_logits(
    logits: torch.Tensor,  # [R, V] float32, changed in place
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    outputs: Sequence[Sequence[int]],  # per row: the output tokens that precede it
    eos_token_id: int | None,
    bad_words: Sequence[Sequence[int]] = (),  # token sequences (bad_words_token_ids)
    pending: torch.Tensor | None = None,  # [1] int64 on the device: a placeholder's token
) -> torch.Tensor:  # [R, V], the same tensor
    """Apply one request's bans, logit bias and penalties to its rows. Under async scheduling
    an output may end in a placeholder (core.request.PLACEHOLDER_TOKEN) whose token is still
    on the device, ``pending``: the penalties and bad words of several tokens read it there
    (the rest counts outputs; user processors, which take lists, never see a placeholder:
    ``async_tokens.can_defer``)."""
    if len(outputs) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(outputs)} histories")
    for fn in params.logits_processors or []:
        arity = logits_processor_arity(fn)  # inspects the signature: once per call, not per row
        for row, out in enumerate(outputs):
            logits[row] = apply_user_processor(fn, arity, prompt_token_ids, out, logits[row])
    ban = min_tokens_ban(params, eos_token_id)
    banned = None  # on the device, copied once (a host list as an index is a pageable copy)
    for row, out in enumerate(outputs):
        if len(out) < params.min_tokens and ban:
            banned = to_device(int_tensor(ban), logits.device) if banned is None else banned
            logits[row, banned] = float("-inf")
        for word in bad_words:
            _ban_word(logits[row], word, out, pending)
    apply_allowed_token_ids(logits, params)
    if params.logit_bias:
        ids = to_device(int_tensor(list(params.logit_bias)), logits.device)
        bias = to_device(torch.tensor(list(params.logit_bias.values())), logits.device)
        logits[:, ids] += bias.to(logits.dtype)
    if params.has_penalties:
        _apply_penalties(logits, params, prompt_token_ids, outputs, pending)
    return logits


def _ban_word(
    row: torch.Tensor,  # [V] one row's logits, changed in place
    word: Sequence[int],
    out: Sequence[int],  # the output before the row (it may end in a placeholder)
    pending: torch.Tensor | None,  # [1] on the device: the placeholder's token
) -> None:
    """Mask the word's last token if the output ends with the rest of it (a one-token word:
    always). A held last token is compared on the device, so nothing waits for it."""
    head = len(word) - 1
    if head > len(out):
        return
    tail = list(out[len(out) - head :])  # [] for a one-token word
    if not tail or tail[-1] != PLACEHOLDER_TOKEN:
        if tail == list(word[:-1]):
            row[word[-1]] = float("-inf")
        return
    if tail[:-1] != list(word[:-2]):
        return
    if pending is None:
        raise RuntimeError("bad words need the placeholder's token from the device")
    row[word[-1]] = torch.where(pending[0] == word[-2], float("-inf"), row[word[-1]])


def apply_user_processor(
    fn: Any,
    arity: int,  # logits_processor_arity(fn)
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
    row: torch.Tensor,  # [V] float32
) -> torch.Tensor:  # [V]
    """Call one user logits processor on one row (copies of the histories, so it cannot
    change them); a result that is not a NaN-free [V] tensor is a ValueError naming it."""
    if arity == 3:
        new = fn(list(prompt_token_ids), list(output_token_ids), row)
    else:
        new = fn(list(output_token_ids), row)
    name = getattr(fn, "__name__", fn)
    if not isinstance(new, torch.Tensor) or new.shape != row.shape:
        got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
        raise ValueError(
            f"logits processor {name!r} must return a tensor of shape {tuple(row.shape)}, got {got}"
        )
    if bool(torch.isnan(new).any()):
        raise ValueError(f"logits processor {name!r} returned NaN")
    return new


def _apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    outputs: Sequence[Sequence[int]],
    pending: torch.Tensor | None,
) -> None:
    dev = logits.device
    counts = torch.zeros_like(logits)  # [R, V] occurrences in each row's output
    for row, out in enumerate(outputs):
        held = bool(out) and out[-1] == PLACEHOLDER_TOKEN  # only the last token can be held
        ids = to_device(int_tensor(out[:-1] if held else out), dev)  # added on the device
        if held:  # the last token is still on the device
            if pending is None:
                raise RuntimeError("penalties need the placeholder's token from the device")
            ids = torch.cat([ids, pending])
        counts[row].index_add_(0, ids, torch.ones(len(ids), dtype=counts.dtype, device=dev))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, to_device(int_tensor(list(prompt_token_ids)), dev)] = True
        r = params.repetition_penalty
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    if params.frequency_penalty != 0.0:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def process_request_rows(
    logits: torch.Tensor,  # [R, V] float32 rows of one request, changed in place
    request: Request,
    outputs: Sequence[Sequence[int]],  # per row: the output tokens before it
    may_wait: bool = True,  # False: never read a device value (see below)
    pending: torch.Tensor | None = None,  # [1] on the device: a placeholder's token (penalties)
) -> torch.Tensor:
    """``logits_processors.process_logits`` for a request's rows (skipped when it is a no-op),
    then its grammar's mask (structured output).

    Every row keeps at least one token, so one request's conflicting constraints can never
    fail the batch it runs in. The whitelists win over the bans: a row the bans leave without
    any token (say ``allowed_token_ids=[eos]`` before ``min_tokens``) keeps the whitelists
    alone. If the two whitelists exclude each other mid-output (the engine refuses requests
    whose grammar accepts none of ``allowed_token_ids`` first), the grammar alone wins, so the
    output stays well-formed. Whether a row was left empty is a device value: without
    ``may_wait`` the weaker constraints are applied by ``torch.where`` without asking."""
    params = request.sampling_params
    processed = params.needs_logits_processing(min(len(o) for o in outputs))
    if request.guide is None and not processed:
        return logits
    raw = logits.clone()  # the grammar-only fallback, and the base of the whitelists' one
    if processed:
        _process(logits, request, outputs, pending)
    if request.guide is not None:
        accepted = request.num_output_tokens  # what the guide has seen; the rest is drafts
        allowed = torch.stack([request.guide.allowed(o[accepted:]) for o in outputs])  # [R, V]
        disallowed = ~allowed.to(logits.device)
        logits.masked_fill_(disallowed, float("-inf"))
        raw.masked_fill_(disallowed, float("-inf"))
    empty = ~torch.isfinite(logits).any(-1, keepdim=True)  # [R, 1]
    if not may_wait or bool(empty.any()):  # rare: build the weaker constraints only now
        whitelists = apply_allowed_token_ids(raw.clone(), params)
        for fallback in (whitelists, raw):  # the next-weaker constraint for rows left empty
            logits.copy_(torch.where(empty, fallback, logits))
            empty = ~torch.isfinite(logits).any(-1, keepdim=True)
            if may_wait and not bool(empty.any()):
                break
    return logits


def _process(
    logits: torch.Tensor,
    request: Request,
    outputs: Sequence[Sequence[int]],
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    params = request.sampling_params
    return process_logits(
        logits, params, request.prompt_token_ids, outputs, request.eos_token_id,
        request.bad_words_token_ids, pending,
    )  # fmt: skip
