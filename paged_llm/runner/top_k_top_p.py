"""The distribution a sampled (non-greedy) row is drawn from: its logits scaled by the
temperature, masked to its top-k / top-p / min-p tokens (many rows at once, each with its own
settings), then softmaxed. Greedy rows take the argmax and never come here (runner/sampler.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged_llm.runner.batch import int_tensor, to_device
from paged_llm.sampling_params import SamplingParams


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Mask one row of temperature-scaled logits [V] to the allowed tokens (the readable
    reference of ``mask_rows``, which the sampler uses)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p; the most likely token
        # always stays (a top_p below float32's smallest number would otherwise compare as 0)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


# top-p first looks at each row's most likely tokens; it sorts a whole row only when they hold
# less than top_p of its mass (a flat distribution). Sorting a 32k vocabulary for 64 rows takes
# ~0.1 s on a CPU; a top 256 is what a trained model's nucleus usually fits in.
NUCLEUS_CANDIDATES = 256


def mask_rows(
    logits: torch.Tensor,  # [R, V] temperature-scaled logits
    top_k: Sequence[int],  # [R]; 0, -1 or >= V: no limit
    top_p: Sequence[float],  # [R]; 1: no limit
    min_p: Sequence[float],  # [R]; 0: no limit
    may_wait: bool = True,
) -> torch.Tensor:
    """``apply_top_k_top_p_min_p`` for many rows at once, each with its own settings.

    Every path is chosen from the host's settings, so nothing waits for the device, except
    the check that each nucleus lay among its row's candidates. Without ``may_wait`` (async
    scheduling on a GPU, where such a wait would stall the host for the whole forward) rows
    with a top_p are sorted whole instead, as vLLM's PyTorch sampler always does: more device
    work, no wait."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    rows = [i for i, (k, p) in enumerate(zip(ks, top_p)) if k < vocab or p < 1.0]
    if rows:
        # candidates per row: its top-k limit, else enough for a nucleus (a nucleus lies
        # within the row's top k, unless logits tie with its k-th: bfloat16 logits often do)
        nucleus = any(top_p[i] < 1.0 for i in rows)
        width = max(ks[i] if ks[i] < vocab else NUCLEUS_CANDIDATES * (top_p[i] < 1.0)
                    for i in rows)  # fmt: skip
        if 2 * width > vocab or (nucleus and not may_wait):  # sort whole rows at once
            width = vocab
        every = len(rows) == len(ks)  # usually: one setting for the whole batch
        kk, pp = to_device(
            torch.tensor([[ks[i], top_p[i]] for i in rows], dtype=torch.float64), logits.device
        ).unbind(1)  # doubles hold every k and float32 top_p exactly
        kk, pp = kk.long(), pp.float()
        index = None if every else to_device(int_tensor(rows), logits.device)
        sub = logits if index is None else logits[index]
        masked, wide = _keep_top(sub, kk, pp, width, nucleus)
        if width < vocab and nucleus and bool(wide.any()):  # wider nuclei: sort those rows
            masked[wide] = _keep_top(sub[wide], kk[wide], pp[wide], vocab, True)[0]
        logits = masked if index is None else logits.index_put((index,), masked)
    if any(m > 0.0 for m in min_p):
        floor = to_device(torch.tensor(min_p, dtype=torch.float64), logits.device).float()
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < floor[:, None] * probs.amax(-1, keepdim=True),
                                    float("-inf"))  # fmt: skip
    return logits


def _keep_top(
    logits: torch.Tensor,  # [R, V]
    k: torch.Tensor,  # [R]: the top-k limit (V: none)
    top_p: torch.Tensor,  # [R]
    width: int,  # candidates per row: at least the largest limited k
    any_nucleus: bool,  # whether some top_p < 1 (known on the host)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask each row to its k largest logits, then to its top-p nucleus among its ``width``
    most likely tokens; also say which rows' nuclei reach past them ([R] bool, to redo)."""
    vocab = logits.shape[-1]
    vals, idx = torch.topk(logits, width)  # [R, W], most likely first
    kth = vals.gather(1, (k.clamp(max=width) - 1)[:, None])  # [R, 1]: the k-th largest logit
    kth = kth.masked_fill((k > width)[:, None], float("-inf"))  # limits past the width: none
    logits = logits.masked_fill(logits < kth, float("-inf"))
    nucleus = top_p < 1.0
    if not any_nucleus:
        return logits, nucleus
    vals = vals.masked_fill(vals < kth, float("-inf"))
    if width == vocab:  # whole rows, as apply_top_k_top_p_min_p computes them
        probs = vals.softmax(-1)
        wide = torch.zeros_like(nucleus)
    else:  # the candidates' share of the whole (masked) row's mass, computed as softmax does
        top = vals[:, :1]
        probs = (vals - top).exp() / (logits - top).exp().sum(-1, keepdim=True)
        wide = nucleus & (probs.sum(-1) < top_p)
    # drop a token once the mass before it already reaches top_p; the most likely token always
    # stays (a top_p below float32's smallest number would otherwise compare as 0). Tokens
    # past the candidates come after at least top_p of the mass.
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0] = False
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, ~drop)
    return logits.masked_fill(~kept & nucleus[:, None], float("-inf")), wide


def sampling_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], may_wait: bool = True
) -> torch.Tensor:
    """The distributions sampling draws from: row i of logits [R, V] (float32, on any device)
    scaled by params[i].temperature and masked by its top_k / top_p / min_p (``mask_rows``,
    which says what ``may_wait`` changes), then softmaxed."""
    temperature = to_device(torch.tensor([p.temperature for p in params]), logits.device)
    top_k, top_p, min_p = ([getattr(p, s) for p in params] for s in ("top_k", "top_p", "min_p"))
    return mask_rows(logits / temperature[:, None], top_k, top_p, min_p, may_wait).softmax(-1)
