"""A linear step-time law for devices whose step is no roofline (a CPU), and its fit from
measured steps (plain Python, no numpy).

On a CPU a small model's step is not ``max(bytes, FLOPs)``: the matmuls, the attention over
the cached tokens, the per-request bookkeeping and the fixed Python cost all add up. The law
prices each part of a :class:`StepShape` separately::

    t = fixed + per_seq * seqs + rows(new tokens) + per_kv_token * KV tokens read
          + per_attn_pair * causal (query, key) pairs

``rows`` is piecewise linear with breaks at ``token_knots``: a matmul's cost per row falls as
rows grow until the weights' reads are shared (measured on 2 CPU cores for a 25M Llama: ~1.4
ms per row from 1 to 4 rows, ~0.3 ms beyond 12). Every slope is >= 0, so it never decreases.
A decode-only grid cannot tell ``per_seq`` from the row cost (both count the batch), so the
grid behind a fit should include prefill steps (``experiments.measure_step_times``'s mixed
grid does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from paged_llm.sim.cost_model import RooflineCostModel, StepShape


@dataclass(frozen=True)
class LinearStepLaw:
    """Seconds per step as a non-negative sum over the step's parts."""

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    per_kv_token_s: float = 0.0
    per_attn_pair_s: float = 0.0
    token_knots: tuple[int, ...] = ()  # where the per-row cost changes, increasing
    per_token_s: tuple[float, ...] = (0.0,)  # one slope per segment: len(token_knots) + 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_knots", tuple(int(k) for k in self.token_knots))
        object.__setattr__(self, "per_token_s", tuple(float(c) for c in self.per_token_s))
        if len(self.per_token_s) != len(self.token_knots) + 1:
            raise ValueError("per_token_s needs one slope per segment: len(token_knots) + 1")
        if (
            list(self.token_knots) != sorted(set(self.token_knots))
            or min(self.token_knots, default=1) <= 0
        ):
            raise ValueError(f"token_knots must increase and be > 0, got {self.token_knots}")
        if min(self.coefficients()) < 0:
            raise ValueError(f"step-law coefficients must be >= 0, got {self}")

    def coefficients(self) -> list[float]:
        """The coefficients in ``features`` order."""
        head = [self.fixed_s, self.per_seq_s, self.per_kv_token_s, self.per_attn_pair_s]
        return head + list(self.per_token_s)

    def step_time(self, step: StepShape) -> float:
        """Seconds one step of this shape takes."""
        return sum(c * x for c, x in zip(self.coefficients(), features(step, self.token_knots)))

    def to_dict(self) -> dict[str, object]:
        """Plain dict for result files."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def features(step: StepShape, token_knots: tuple[int, ...] = ()) -> list[float]:
    """What the coefficients multiply: 1, seqs, KV tokens read, pairs, then the new tokens
    falling in each segment between knots."""
    head = [1.0, float(step.num_seqs), float(step.kv_tokens_read), float(step.attn_pairs)]
    edges = [0, *token_knots]
    n = step.num_new_tokens
    segs = [max(0, min(n, hi) - lo) for lo, hi in zip(edges, [*token_knots, n])]
    return head + [float(x) for x in segs]


def fit_linear_law(
    shapes: list[StepShape], times: list[float], token_knots: tuple[int, ...] = ()
) -> LinearStepLaw:
    """Least squares on relative error with non-negative coefficients.

    Relative error: the measured steps span 10x in duration, and a simulated run's time is a
    sum over mostly short (decode) steps, so each point should count alike. Non-negativity by
    an active set: solve, drop the most negative term, solve again (no cost is negative).
    """
    if len(shapes) != len(times) or not shapes:
        raise ValueError("need as many step times as shapes, and at least one")
    knots = tuple(token_knots)
    rows = [[x / t for x in features(s, knots)] for s, t in zip(shapes, times)]
    ones = [1.0] * len(rows)
    # terms no point exercises (a segment past the largest step) cannot be fitted: left at 0
    active = [j for j in range(len(rows[0])) if any(r[j] for r in rows)]
    while True:
        coef = _least_squares([[r[j] for j in active] for r in rows], ones)
        worst = min(range(len(active)), key=lambda i: coef[i])
        if coef[worst] >= 0:
            break
        del active[worst]
    values = [0.0] * len(rows[0])
    for j, c in zip(active, coef):
        values[j] = c
    return LinearStepLaw(*values[:4], token_knots=knots, per_token_s=tuple(values[4:]))


def _least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """argmin |A x - b| by the normal equations on unit-scaled columns (Gaussian elimination
    with partial pivoting); the columns differ by ~1e6 in scale (1 vs attention pairs)."""
    n = len(a[0])
    scale = [max(abs(r[j]) for r in a) or 1.0 for j in range(n)]
    cols = [[r[j] / scale[j] for r in a] for j in range(n)]
    m = [[sum(x * y for x, y in zip(cols[i], cols[j])) for j in range(n)] for i in range(n)]
    v = [sum(x * y for x, y in zip(cols[i], b)) for i in range(n)]
    for k in range(n):
        p = max(range(k, n), key=lambda i: abs(m[i][k]))
        if abs(m[p][k]) < 1e-12:
            raise ValueError("the measured steps do not determine the step law (singular fit)")
        m[k], m[p], v[k], v[p] = m[p], m[k], v[p], v[k]
        for i in range(k + 1, n):
            f = m[i][k] / m[k][k]
            m[i] = [x - f * y for x, y in zip(m[i], m[k])]
            v[i] -= f * v[k]
    x = [0.0] * n
    for k in reversed(range(n)):
        x[k] = (v[k] - sum(m[k][j] * x[j] for j in range(k + 1, n))) / m[k][k]
    return [xi / s for xi, s in zip(x, scale)]


@dataclass(frozen=True)
class LinearCostModel(RooflineCostModel):
    """The roofline's memory planning, swaps and all-reduces, with each step's compute priced
    by a fitted :class:`LinearStepLaw` instead of ``max(bytes, FLOPs)``."""

    law: LinearStepLaw = LinearStepLaw()

    @classmethod
    def from_roofline(cls, cm: RooflineCostModel, law: LinearStepLaw) -> LinearCostModel:
        """``cm``'s hardware, model and settings with ``law`` for the steps."""
        return cls(**{f.name: getattr(cm, f.name) for f in fields(cm)}, law=law)

    def step_time(self, step: StepShape) -> float:
        """Seconds one iteration takes."""
        if step.num_new_tokens == 0:  # only swaps: priced as the roofline does
            return super().step_time(step)
        return (
            self.law.step_time(step) + self.allreduce_time(step) + self.swap_time(step.swap_blocks)
        )

    def least_busy_time(self, total: StepShape, steps: int) -> float:
        """A lower bound on the summed ``step_time`` of any ``steps`` steps adding up to
        ``total``: the law's linear terms summed, its fixed cost per step, and the rows at their
        least: a concave row cost (slopes not increasing) is at least that of all the rows in
        one step; otherwise each row costs at least the smallest slope."""
        law = self.law
        x = features(total, law.token_knots)
        linear = sum(c * v for c, v in zip(law.coefficients()[:4], x[:4]))
        linear += (steps - 1) * law.fixed_s
        slopes = list(law.per_token_s)
        if slopes == sorted(slopes, reverse=True):
            rows = sum(c * v for c, v in zip(slopes, x[4:]))
        else:
            rows = min(slopes) * total.num_new_tokens
        return linear + rows + self._allreduce_over(total, steps)

    def breakdown(self, step: StepShape) -> dict[str, float]:
        """Every term of the step time, in seconds."""
        return {
            "law_s": self.law.step_time(step),
            "allreduce_s": self.allreduce_time(step),
            "swap_s": self.swap_time(step.swap_blocks),
        }
