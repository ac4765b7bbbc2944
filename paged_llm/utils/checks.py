"""Type checks shared by the configuration and request validators."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    """An integer (numpy's too) that is not a bool: what count and token-id fields take."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
