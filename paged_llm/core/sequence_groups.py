"""Sequences that run as one group (plain Python, no torch): a request's parallel samples or a
beam search's beams share their prompt's blocks and are scheduled and preempted together.
The scheduler inherits these methods; a step without groups never calls them.
"""

from __future__ import annotations

from paged_llm.core.kv.base import KVCacheManager
from paged_llm.core.request import Request, RequestStatus
from paged_llm.core.scheduler_limits import SchedulerLimits


class SequenceGroups:
    """Checks that a group can ever run together, and starts forked sequences: parallel
    samples and beams (the ``Scheduler``'s, whose state these methods read)."""

    kv: KVCacheManager
    limits: SchedulerLimits
    requests: dict[str, Request]
    running: list[Request]

    def check_group_size(self, num_seqs: int, what: str) -> None:
        """ValueError when more sequences must run together than ``max_num_seqs`` (a group is
        admitted whole, so it would wait, or be preempted, forever)."""
        max_seqs = self.limits.max_num_seqs
        if num_seqs > max_seqs:
            raise ValueError(
                f"this request has {num_seqs} sequences ({what}) that run together, more "
                f"than max_num_seqs ({max_seqs}); lower {what} or raise max_num_seqs"
            )

    def check_group_fits(self, requests: list[Request], what: str) -> None:
        """ValueError when sequences scheduled and preempted together could never all run: more
        of them than ``max_num_seqs``, or more blocks than the pool."""
        self.check_group_size(len(requests), what)
        if len(requests) > 1 and not self.kv.group_fits_ever(requests):
            raise ValueError(
                f"the {len(requests)} sequences of this request ({what}) need up to "
                f"{self.kv.group_blocks_needed(requests)} KV blocks together (policy "
                f"'{self.kv.name}'), more than the pool of {self.kv.num_blocks} blocks can hold; "
                f"lower max_tokens or {what}, or enlarge the KV cache"
            )

    def fork_request(self, parent: Request, child: Request) -> None:
        """Start ``child`` as a running sequence that shares the parent's blocks.

        The caller sets the child's tokens and ``num_computed_tokens`` (at most the parent's);
        both must carry the same ``group_id`` so they are preempted together.
        """
        if child.request_id in self.requests:
            raise ValueError(f"request id '{child.request_id}' is already in use")
        if parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"can only fork a running request, {parent.request_id} is not")
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        self.requests[child.request_id] = child
        self.running.append(child)

    def fork_sample(self, first: Request, sample: Request) -> None:
        """Start a parallel ``sample`` of ``first``, whose prefill completes in this step: it
        shares the prompt's blocks and recomputes only the last prompt token, so it draws its
        own first token (call between schedule and update)."""
        sample.num_computed_tokens = first.num_prompt_tokens - 1
        self.fork_request(first, sample)
