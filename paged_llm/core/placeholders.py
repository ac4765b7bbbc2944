"""Async scheduling's placeholders (plain Python, no torch): with async scheduling the engine
plans step N + 1 before step N's sampled tokens reach the host, so ``update_from_output`` is
given a placeholder (``request.PLACEHOLDER_TOKEN``) for each, and ``resolve_placeholders``
writes the real token over it a step later. A step without async scheduling never calls this
module's functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_llm.core.request import PLACEHOLDER_TOKEN, Request

if TYPE_CHECKING:
    from paged_llm.core.scheduler import Scheduler


def hold_placeholder(req: Request) -> None:
    """Append a placeholder for a token still on the device; a request it brings to its
    length limit is not scheduled again until the token is known."""
    req.output_token_ids.append(PLACEHOLDER_TOKEN)
    req.final_token_pending = req.num_output_tokens >= req.max_output_tokens


def resolve_placeholders(
    sched: Scheduler, tokens: list[tuple[Request, int]], now: float
) -> list[Request]:
    """Write each request's sampled token over its placeholder (the next step already planned
    and launched) and finish the requests it stops; return the finished. A request aborted or
    finished since keeps its outputs as they are."""
    finished = []
    for req, token in tokens:
        if req.is_finished:
            continue
        if req.output_token_ids[-1] != PLACEHOLDER_TOKEN:
            raise RuntimeError(f"request {req.request_id} has no placeholder to resolve")
        req.output_token_ids.pop()
        req.final_token_pending = False
        sched.append_tokens(req, [token], now)
        if req.is_finished:
            finished.append(req)
    return finished
