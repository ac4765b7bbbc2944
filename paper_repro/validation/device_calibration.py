"""Calibrate the simulator for the device the real engine runs on: time a grid of steps,
write the calibration file, and build the simulated executor that loads it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from experiments.measure_step_times import measure_grid
from paged_llm.metrics.run_info import hardware_info, run_info
from paged_llm.sim.clocks import make_clock
from paged_llm.sim.cost_model import StepShape
from paged_llm.sim.hardware import GPUSpec
from paged_llm.sim.model_shapes import ModelShape, from_hf_config
from paged_llm.sim.real_executor import RealExecutor
from paged_llm.sim.settings import ServingSettings
from paper_repro.validation.drift import DriftCorrectedExecutor, SpeedProbe

SHAPE_KEYS = ("num_seqs", "num_new_tokens", "kv_tokens_read", "kv_blocks_read", "attn_pairs")


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with its core count."""
    info = hardware_info(device)
    return info.get("gpu") or f"CPU {info['cpu']} ({info['cpu_count']} cores)"


def _threads(n: int | None) -> Any:
    """The real executor's intra-op thread count while timing (as its runs use)."""
    if not n:
        return contextlib.nullcontext()
    from paged_llm.recipes.training import torch_threads

    return torch_threads(n)


def measure_device(
    real: RealExecutor,
    settings: ServingSettings,
    grid: dict[str, Any],
    law: dict[str, Any],
    probe: dict[str, Any],
) -> tuple[dict[str, Any], SpeedProbe]:
    """Time the grid on a paged engine with the runs' settings and clock; the calibration
    file's contents (explicit points, and ``law``: the law to fit and its options) and the
    speed probe (``probe``: its batch, context, steps), timed before and after the grid."""
    engine = real.engine("paged", settings)
    clock = make_clock(real.clock, engine.device.type)
    speed = SpeedProbe(engine, clock.now, lambda: _threads(real.num_threads), **probe)
    with _threads(real.num_threads):
        measure_grid(engine, {**grid, "steps": 1}, clock.now, log=False)  # warm-up
        before = speed.time()
        points = measure_grid(engine, grid, clock.now)
        after = speed.time()
    speed.reference_s = (before + after) / 2
    device = str(engine.device)
    params = from_hf_config(engine.hf_config).num_params
    dtype_bytes = next(engine.model.parameters()).element_size()
    return {
        **law,
        "hardware": device_name(device),
        "model": f"{Path(real.model['model']).name} ({params / 1e6:.1f}M parameters)",
        "num_gpus": 1,
        "block_size": settings.block_size,
        "clock": clock.name,
        "source": f"paper_repro.validate_sim on {real.describe()}, {clock.name} clock",
        "run_info": run_info("real", device, real.describe()),
        "points": points,
        "speed_probe": {**probe, "before_grid_s": before, "after_grid_s": after},
        "hf_config": engine.hf_config.to_dict(),
        "dtype_bytes": dtype_bytes,
    }, speed


def write_calibration(data: dict[str, Any], path: Path) -> Path:
    """Write the calibration file (JSON) and return its path."""
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def simulated_executor(data: dict[str, Any], path: Path) -> DriftCorrectedExecutor:
    """The simulated executor of the measured device and model, loading the calibration file.
    The roofline's data-sheet fields are unused: the pool is given and the law prices steps."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**data["hf_config"])
    shape: ModelShape = from_hf_config(cfg, name=data["model"], dtype_bytes=data["dtype_bytes"])
    hardware = GPUSpec(data["hardware"], 0.0, 1.0, 1.0, 1.0)
    return DriftCorrectedExecutor(hardware=hardware, model=shape, calibration=str(path))


def fit_quality(sim: DriftCorrectedExecutor, data: dict[str, Any]) -> dict[str, Any]:
    """The fitted law and each grid point's measured vs modelled step time."""
    cm = sim.cost_model(data["block_size"])  # fitted to the file on load
    rows = []
    for p in data["points"]:
        model = cm.step_time(StepShape(*(int(p[k]) for k in SHAPE_KEYS)))
        rows.append({**p, "model_s": model, "relative_error": model / p["step_time_s"] - 1})
    errs = [abs(r["relative_error"]) for r in rows]
    return {
        "law": cm.to_dict().get("law"),
        "mean_abs_relative_error": sum(errs) / len(errs),
        "max_abs_relative_error": max(errs),
        "points": rows,
    }


def calibrate_here(c: dict[str, Any], out: Path) -> tuple[Any, dict[str, Any], SpeedProbe, Any]:
    """validate_sim's first steps from its resolved config ``c``: the real executor (a random
    Llama of ``c["random_llama"]``'s shape, cached), its experiment writing into ``out``, the
    measured grid (the calibration file's contents) with the speed probe, and the simulated
    executor loading ``out/calibration.json``."""
    import torch
    from hydra.utils import instantiate

    from experiments.bench_model import resolve_model_dir
    from paged_llm.metrics.loggers import NullLogger
    from paper_repro.common import Experiment

    real = instantiate(c["executor"], _convert_="all")
    if c.get("random_llama"):  # a random Llama of that shape, written once into the cache
        real.model["model"] = str(resolve_model_dir({"arch": c["random_llama"]}, torch.float32, 0))
    real_exp = Experiment(c, real, NullLogger(), out)
    data, probe = measure_device(
        real, real_exp.settings("paged"), c["calibration_grid"], c["calibration_law"],
        c["speed_probe"],
    )  # fmt: skip
    sim = simulated_executor(data, write_calibration(data, out / "calibration.json"))
    return real_exp, data, probe, sim
