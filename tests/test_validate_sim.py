"""paper_repro.validate_sim: the linear step law's fit, the calibration format, and the CI-size
real-vs-simulated run."""

from __future__ import annotations

import json
import random

import pytest

from paged_llm.sim.calibration import calibrate
from paged_llm.sim.cost_model import RooflineCostModel, StepShape
from paged_llm.sim.hardware import GPUSpec
from paged_llm.sim.model_shapes import get_model_shape
from paged_llm.sim.step_law import LinearCostModel, LinearStepLaw, fit_linear_law

KNOWN = LinearStepLaw(
    fixed_s=0.010, per_seq_s=2e-4, per_kv_token_s=3e-7, per_attn_pair_s=2e-6,
    token_knots=(4, 16), per_token_s=(1.2e-3, 3e-4, 1e-4),
)  # fmt: skip


def _grid_shapes() -> list[StepShape]:
    """Decode and mixed steps like the measured grid's."""
    shapes = []
    for b in (0, 1, 2, 4, 8, 12, 16, 24):
        for ctx in (16, 48, 112):
            for pre in (0, 24, 96, 192):
                if b == 0 and pre == 0:
                    continue
                seqs, new = b + (pre > 0), b + pre
                kv = b * (ctx + 1) + pre
                pairs = b * (ctx + 1) + pre * (pre + 1) // 2
                shapes.append(StepShape(seqs, new, kv, -(-kv // 16), pairs))
    return shapes


def test_fit_recovers_a_known_law() -> None:
    shapes = _grid_shapes()
    law = fit_linear_law(shapes, [KNOWN.step_time(s) for s in shapes], (4, 16))
    for got, want in zip(law.coefficients(), KNOWN.coefficients()):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_with_noise_stays_close_and_non_negative() -> None:
    rng = random.Random(0)
    shapes = _grid_shapes()
    times = [KNOWN.step_time(s) * (1 + rng.gauss(0, 0.02)) for s in shapes]
    law = fit_linear_law(shapes, times, (4, 16))
    assert min(law.coefficients()) >= 0
    for s in shapes:  # 2% noise on each point: the fitted law within 3% everywhere
        assert law.step_time(s) == pytest.approx(KNOWN.step_time(s), rel=0.03)


def test_law_validates_its_coefficients() -> None:
    with pytest.raises(ValueError, match="one slope per segment"):
        LinearStepLaw(token_knots=(4,), per_token_s=(1.0,))
    with pytest.raises(ValueError, match=">= 0"):
        LinearStepLaw(fixed_s=-1.0)
    with pytest.raises(ValueError, match="increase"):
        LinearStepLaw(token_knots=(8, 4), per_token_s=(1.0, 1.0, 1.0))


def test_linear_calibration_file_loads_into_the_cost_model(tmp_path) -> None:
    """A calibration file with law=linear gives a LinearCostModel pricing steps by the law."""
    shapes = _grid_shapes()
    points = [
        {"num_seqs": s.num_seqs, "num_new_tokens": s.num_new_tokens,
         "kv_tokens_read": s.kv_tokens_read, "kv_blocks_read": s.kv_blocks_read,
         "attn_pairs": s.attn_pairs, "step_time_s": KNOWN.step_time(s)}
        for s in shapes
    ]  # fmt: skip
    hw = GPUSpec("test cpu", 0.0, 1.0, 1.0, 1.0)
    data = {"law": "linear", "token_knots": [4, 16], "hardware": "test cpu", "points": points}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    cm = calibrate(RooflineCostModel(hw, get_model_shape("opt-13b")), path)
    assert isinstance(cm, LinearCostModel)
    step = StepShape.decode(7, 100)
    assert cm.step_time(step) == pytest.approx(KNOWN.step_time(step), rel=1e-6)
    path.write_text(json.dumps({**data, "law": "cubic"}))
    with pytest.raises(ValueError, match="unknown law"):
        calibrate(RooflineCostModel(hw, get_model_shape("opt-13b")), path)


@pytest.mark.slow
@pytest.mark.alone  # the calibration and the real runs must see the same machine
def test_ci_size_run_writes_real_beside_simulated(tmp_path) -> None:
    """The CI-size run: calibration, real and simulated values per quantity and policy.

    Tolerance: 25% relative / 6 pp, not the issue's 10% / 3 pp. The CI run is ~20 requests per
    run, so one request more or less in the averaging window moves a mean by 5-10%, and the
    step-time grid is 3 steps a cell on a 2-core machine shared with other jobs (the process
    clock removes their time slices, not their cache and memory-bandwidth pressure). The full
    run (docs/paper_repro.md) is the one held to the issue's goals.
    """
    from paper_repro.common import compose
    from paper_repro.validate_sim import run

    cfg = compose("validate_sim_quick")
    paths = run(cfg, tmp_path)
    names = {p.name for p in paths}
    assert {"validate_sim.json", "validate_sim.csv", "validate_sim.png", "calibration.json"} <= (
        names
    )
    out = json.loads((tmp_path / "validate_sim.json").read_text())
    assert set(out["run_info"]) == {"real", "simulated"}
    assert out["run_info"]["real"]["mode"] == "real"
    assert out["run_info"]["simulated"]["mode"] == "simulated"
    rows = out["comparison"]
    assert {r["quantity"] for r in rows} == {
        "sustained_rate", "mean_batched_requests", "token_states"
    }  # fmt: skip
    for r in rows:
        assert r["real"] > 0 and r["simulated"] > 0
        limit = 0.25 if r["error_kind"] == "relative" else 6.0
        assert abs(r["error"]) <= limit, r
    cal = json.loads((tmp_path / "calibration.json").read_text())
    assert cal["law"] == "linear" and len(cal["points"]) >= 6


def test_process_clock_skips_idle_time_and_auto_follows_the_device() -> None:
    from paged_llm.sim.clocks import ProcessClock, WallClock, make_clock

    clock = ProcessClock()
    t = clock.now()
    clock.wait(5.0)  # an idle server: no CPU time passes, the clock jumps
    assert 5.0 <= clock.now() - t < 5.5
    assert isinstance(make_clock("auto", "cpu"), ProcessClock)
    assert isinstance(make_clock("auto", "cuda"), WallClock)
    with pytest.raises(ValueError, match="unknown clock"):
        make_clock("sundial", "cpu")


def test_grid_keeps_only_cells_that_fit_the_pool() -> None:
    from experiments.measure_step_times import grid_cells

    cells = grid_cells([0, 4, 24], [16, 112], [0, 192], steps=5, blocks=64, block_size=16)
    assert (0, 16, 0) not in cells and (0, 112, 192) not in cells  # batch 0: prefills, once
    assert (0, 16, 192) in cells and (4, 112, 192) in cells
    assert (24, 112, 0) not in cells  # 24 x 8 blocks > 64


def test_drift_correction_scales_every_coefficient() -> None:
    from paper_repro.validation.drift import scaled

    step = StepShape(5, 40, 300, 20, 900)
    assert scaled(KNOWN, 1.1).step_time(step) == pytest.approx(1.1 * KNOWN.step_time(step))
