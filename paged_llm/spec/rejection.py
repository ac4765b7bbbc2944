"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Accept draft token x with probability min(1, p(x) / q(x)); at the first rejection sample from
norm(max(0, p - q)); if every draft is accepted, sample one bonus token from p. The output has
exactly the target's distribution; with greedy decoding it is exactly the target's argmax chain.
"""

from __future__ import annotations

import torch


def verify_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Greedy: keep drafts while they equal the target's argmax; then the target's own token.

    target_logits: [k + 1, V] at the positions after the last verified token and each draft.
    Returns the accepted drafts followed by one token from the target (k + 1 at most).
    """
    return accept_greedy(target_logits.argmax(-1).tolist(), drafts)


def accept_greedy(best: list[int], drafts: list[int]) -> list[int]:
    """``verify_greedy`` given the target's argmax at each of the k + 1 positions."""
    out = []
    for i, d in enumerate(drafts):
        if best[i] != d:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def verify_sampled(
    target_probs: torch.Tensor,  # [k + 1, V], the target's (processed) distribution per position
    draft_probs: torch.Tensor | None,  # [k, V]; None for a deterministic drafter (one-hot q)
    drafts: list[int],
    generator: torch.Generator,
) -> list[int]:
    """Rejection sampling; returns the accepted drafts plus one corrected or bonus token."""
    out = []
    for i, d in enumerate(drafts):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, float(p[d]) / q_d):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q: any sample from p is exact
            residual, total = p, float(p.sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator)))
    return out


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): expected tokens per target step at acceptance rate a."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
