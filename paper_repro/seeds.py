"""Seeds and confidence: a figure measures once per seed and reports each quantity's mean with a
Student-t 95% interval over the seeds.

A seed is the workload's (``WorkloadSpec.seed``): it draws the arrival times and the sampled
lengths, and seeds the simulator's own random choices (which beam each new beam extends). The
configured ``seeds`` (a list, or a count n for seeds 0..n-1) replace ``workload.seed``.

The mean result keeps the one-seed layout, so acceptance checks, plots and readers see the
means where they saw one draw before; ``result["seeds"]["stats"]`` holds, per quantity path
(``"paged/token_states"``, ``"paged/points/3/normalized_latency"``), the per-seed values, the
mean and the interval."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

CONFIDENCE = 0.95


def seed_list(cfg: dict[str, Any]) -> list[int]:
    """The configured seeds: ``seeds: [0, 1, 2]``, or ``seeds: 3`` for 0..2; one seed (the
    workload's own) when the config has none."""
    seeds = cfg.get("seeds")
    if seeds is None:
        return [int((cfg.get("workload") or {}).get("seed", 0))]
    values = list(range(int(seeds))) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not values or len(set(values)) != len(values):
        raise ValueError(f"seeds must be a count >= 1 or a list of distinct seeds, got {seeds}")
    return values


def _two_sided_t_cdf(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...)
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The t with P(|T| < t) = confidence (12.706 at df 1, 2.776 at df 4), by bisection."""
    if df < 1:
        raise ValueError(f"need df >= 1, got {df}")
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _two_sided_t_cdf(mid, df) < confidence else (lo, mid)
    return (lo + hi) / 2


def summarize(values: list[float]) -> dict[str, Any]:
    """Mean and Student-t 95% interval of per-seed values; one value (or a non-finite one)
    gives no interval (low / high None)."""
    n = len(values)
    mean = math.fsum(values) / n
    low = high = None
    if n > 1 and all(math.isfinite(v) for v in values):
        sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
        half = t_quantile(n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    return {"mean": mean, "ci95_low": low, "ci95_high": high, "n": n, "per_seed": list(values)}


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def aggregate(trees: list[Any], path: str = "", stats: dict | None = None) -> Any:
    """The mean of per-seed results of one layout: numbers become their mean (their summary
    goes into ``stats`` under their path); other values are kept when every seed has the same,
    else listed per seed."""
    stats = {} if stats is None else stats
    first = trees[0]
    if isinstance(first, dict) and all(isinstance(t, dict) for t in trees):
        return {
            k: aggregate([t.get(k) for t in trees], f"{path}/{k}".lstrip("/"), stats) for k in first
        }
    if isinstance(first, list | tuple) and all(
        isinstance(t, list | tuple) and len(t) == len(first) for t in trees
    ):
        return [aggregate([t[i] for t in trees], f"{path}/{i}".lstrip("/"), stats)
                for i in range(len(first))]  # fmt: skip
    if all(_is_number(t) for t in trees):
        stats[path] = summarize([float(t) for t in trees])
        # a value every seed shares (a rate, a size) stays as given (an int stays an int)
        return first if all(t == first for t in trees) else stats[path]["mean"]
    return first if all(t == first for t in trees) else list(trees)


def seed_rows(seeds: list[int], per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """CSV rows: every seed's rows (column ``seed``), then per row its mean and interval ends
    (``seed`` = mean / ci95_low / ci95_high); ``n_seeds`` on all."""
    n = len(seeds)
    rows = [{"seed": s, "n_seeds": n, **r} for s, rs in zip(seeds, per_seed) for r in rs]
    if n < 2 or len({len(rs) for rs in per_seed}) != 1:
        return rows
    for group in zip(*per_seed):
        stats: dict[str, Any] = {}
        mean = aggregate(list(group), stats=stats)
        rows.append({"seed": "mean", "n_seeds": n, **mean})
        for end in ("ci95_low", "ci95_high"):
            ends = {k: stats[k][end] for k in mean if k in stats}
            rows.append({"seed": end, "n_seeds": n, **mean, **ends})
    return rows


Measure = Callable[[Any], tuple[dict[str, Any], list[dict[str, Any]], list[Any]]]


def over_seeds(exp: Any, measure: Measure) -> tuple[dict[str, Any], list[dict[str, Any]], list]:
    """Run ``measure(exp)`` (-> result, CSV rows, workloads) once per configured seed. Returns
    the mean result with ``result["seeds"]`` (seeds, n, per-quantity stats), the CSV rows of
    :func:`seed_rows` and every seed's workloads."""
    seeds = seed_list(exp.cfg)
    runs = []
    for seed in seeds:
        exp.seed = seed
        runs.append(measure(exp))
    exp.seed = None
    stats: dict[str, Any] = {}
    result = aggregate([r[0] for r in runs], stats=stats)
    interval = f"Student-t {CONFIDENCE:.0%} over seeds" if len(seeds) > 1 else "none: one seed"
    result["seeds"] = {"seeds": seeds, "n": len(seeds), "interval": interval, "stats": stats}
    rows = seed_rows(seeds, [r[1] for r in runs])
    return result, rows, [w for r in runs for w in r[2]]


def value_at(result: Any, path: str) -> Any:
    """The value at a quantity path of a result (``"paged/points/3/normalized_latency"``)."""
    for key in path.split("/"):
        result = result[int(key)] if isinstance(result, list) else result[key]
    return result


def stat(result: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The seed summary of the quantity at ``path`` (None for a one-draw result file)."""
    return (result.get("seeds") or {}).get("stats", {}).get(path)


def error_bars(result: dict[str, Any], paths: list[str], scale: float = 1.0) -> list[list[float]]:
    """Matplotlib's asymmetric ``yerr`` / ``xerr``: mean to each end of the interval, 0 where
    there is none (one seed)."""
    lows, highs = [], []
    for path in paths:
        s = stat(result, path) or {}
        has = s.get("ci95_low") is not None
        lows.append(scale * (s["mean"] - s["ci95_low"]) if has else 0.0)
        highs.append(scale * (s["ci95_high"] - s["mean"]) if has else 0.0)
    return [lows, highs]
