"""Which waiting request is admitted next and which running one is preempted first (vLLM's
``scheduling_policy``): first come first served, or by priority. Plain Python, no torch.

The scheduler asks its queue policy four things and decides nothing else by it: where a new
request joins the waiting queue, where a preempted group goes back, where a swapped-out group
waits, and which running request gives up its blocks when the pool runs out. A new policy is a
subclass of ``QueuePolicy`` with these four methods, named in ``QUEUE_POLICIES`` or given by its
dotted path (``scheduling_policy="mypkg.MyPolicy"``).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from typing import ClassVar

from paged_llm.core.request import Request
from paged_llm.utils.registry import import_target


class QueuePolicy(ABC):
    """The order of the waiting and swapped queues, and who is preempted first."""

    name: ClassVar[str]
    orders_by_priority: ClassVar[bool] = False  # whether requests' ``priority`` means anything

    @abstractmethod
    def add(self, waiting: deque[Request], request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def requeue(self, waiting: deque[Request], group: list[Request]) -> None:
        """Put a group preempted for recomputation back."""

    @abstractmethod
    def add_swapped(self, swapped: deque[list[Request]], group: list[Request]) -> None:
        """Queue a swapped-out group for swapping back in."""

    @abstractmethod
    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt (with its group) when the pool is out of blocks."""


class FCFS(QueuePolicy):
    """Arrival order. A preempted group goes back to the front of the waiting queue, and the
    most recently admitted running request is preempted first (the paper's and vLLM's)."""

    name = "fcfs"

    def add(self, waiting: deque[Request], request: Request) -> None:
        """Queue a new request."""
        waiting.append(request)

    def requeue(self, waiting: deque[Request], group: list[Request]) -> None:
        """Put a group preempted for recomputation back, in its order."""
        waiting.extendleft(reversed(group))

    def add_swapped(self, swapped: deque[list[Request]], group: list[Request]) -> None:
        """Queue a swapped-out group for swapping back in."""
        swapped.append(group)

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt (with its group) when the pool is out of blocks."""
        return running[-1]


class Priority(FCFS):
    """vLLM's ``scheduling_policy="priority"``: lower ``priority`` values are admitted and swapped
    back in first, ties by arrival time, and the running request with the highest (priority,
    arrival time) is preempted first. As in vLLM's V1 engine, a waiting request never preempts
    a running one; it goes first once blocks free up."""

    name = "priority"
    orders_by_priority = True

    @staticmethod
    def key(request: Request) -> tuple[int, float]:
        """Sort key: smaller runs sooner."""
        return (request.priority, request.arrival_time)

    def add(self, waiting: deque[Request], request: Request) -> None:
        """Insert after every request with a smaller or equal key."""
        bisect.insort_right(waiting, request, key=self.key)

    def requeue(self, waiting: deque[Request], group: list[Request]) -> None:
        """Insert before requests with an equal key (they were preempted, so they go first)."""
        for request in reversed(group):
            bisect.insort_left(waiting, request, key=self.key)

    def add_swapped(self, swapped: deque[list[Request]], group: list[Request]) -> None:
        """Keep swapped groups ordered by their first member's key."""
        keys = [self.key(g[0]) for g in swapped]
        swapped.insert(bisect.bisect_right(keys, self.key(group[0])), group)

    def victim(self, running: list[Request]) -> Request:
        """The largest key; among equal keys, the most recently admitted."""
        return max(reversed(running), key=self.key)


QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {"fcfs": FCFS, "priority": Priority}


def queue_policy_class(name: str) -> type[QueuePolicy]:
    """The queue policy ``name`` (a key of ``QUEUE_POLICIES`` or a dotted class path)."""
    if name in QUEUE_POLICIES:
        return QUEUE_POLICIES[name]
    cls = import_target(name) if "." in name else None
    if not (isinstance(cls, type) and issubclass(cls, QueuePolicy)):
        raise ValueError(
            f"scheduling_policy must be one of {sorted(QUEUE_POLICIES)} or the dotted path of "
            f"a paged_llm.core.queue_policy.QueuePolicy subclass, got '{name}'"
        )
    return cls
