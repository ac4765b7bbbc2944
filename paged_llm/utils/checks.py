"""Type checks shared by the configuration and request validators."""

from __future__ import annotations

import numbers


def check_window(sliding_window: int | None) -> None:
    """A sliding window is None (none) or a positive number of positions."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def is_int(value: object) -> bool:
    """An integer (numpy's too) that is not a bool: what count and token-id fields take."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
