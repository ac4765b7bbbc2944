"""Read a PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors`` or
``.bin``) into per-module (A, B) pairs, checked against the base model before any use.

PEFT stores, for each adapted linear layer ``W`` [out, in], ``lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r]; the layer then computes ``W x + scaling * B (A x)`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). The scaling is folded into B here, so
the batched op is two plain matmuls.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_llm.lora.request import LoRARequest

# Prefix PEFT puts before the base model's own module names.
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights on the CPU, keyed by the base model's module name (its name and
    path stay on its LoRARequest)."""

    lora_int_id: int
    # module name -> (A [r, in] float32, B [out, r] float32 with the scaling folded in)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"LoRA adapter directory '{path}' has no adapter_config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot parse {file}: {err}") from err


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.is_file():  # weights only: never run code from a checkpoint
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(
        f"LoRA adapter directory '{path}' has neither adapter_model.safetensors nor "
        "adapter_model.bin"
    )


def _check_config(cfg: dict[str, Any], where: str) -> None:
    """Refuse PEFT features this engine does not compute, rather than ignore them.
    (``fan_in_fan_out``, set for GPT-2's Conv1D layers, only changes how PEFT merges the delta
    into the weight; A and B keep the usual layout and nothing is merged here.)"""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is '{cfg.get('peft_type')}', only LORA is supported")
    unsupported = {
        "use_dora": "DoRA (use_dora)",
        "lora_bias": "LoRA biases (lora_bias)",
        "modules_to_save": f"modules_to_save {cfg.get('modules_to_save')}",
        "layer_replication": "layer_replication",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ValueError(f"{where}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias='{cfg['bias']}' is not supported (only 'none')")
    if not isinstance(cfg.get("lora_alpha"), (int, float)) or not cfg.get("r"):
        raise ValueError(f"{where}: adapter_config.json needs numeric 'r' and 'lora_alpha'")


def _alpha_for(module: str, cfg: dict[str, Any]) -> float:
    """``lora_alpha``, or the ``alpha_pattern`` entry matching this module (PEFT's rule: the
    pattern matches the end of the module name)."""
    for pattern, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(cfg["lora_alpha"])


# (checkpoint module, A, B) -> [(model module, A, B)]: where a model splits a fused layer
LoRAPair = tuple[str, torch.Tensor, torch.Tensor]
LoRASplit = Callable[[str, torch.Tensor, torch.Tensor], list[LoRAPair]]


def load_adapter(
    request: LoRARequest,
    modules: dict[str, tuple[int, int]],  # adaptable module name -> (in_features, out_features)
    max_rank: int,
    split: LoRASplit | None = None,  # the model's lora_tensors, for fused q/k/v checkpoints
) -> LoRAAdapter:
    """Read and check the adapter of ``request`` against the base model's modules; raise a
    ValueError naming the problem (missing file, unsupported feature, unknown module, shape or
    rank) before anything is loaded onto the device."""
    path = Path(request.lora_path)
    where = f"LoRA adapter '{request.lora_name}' ({path})"
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory")
    cfg = _read_config(path)
    _check_config(cfg, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            raise ValueError(
                f"{where}: tensor '{key}' is not a lora_A/lora_B weight of a linear layer "
                "(embedding adapters and biases are not supported)"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    if not pairs:
        raise ValueError(f"{where}: the checkpoint holds no LoRA weights")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: module '{module}' lacks lora_{'B' if 'A' in ab else 'A'}")
        alpha = _alpha_for(module, cfg)
        a, b = ab["A"].float(), ab["B"].float()
        for name, a_part, b_part in split(module, a, b) if split else [(module, a, b)]:
            weights[name] = _checked(where, name, a_part, b_part, modules, max_rank, alpha, cfg)
    return LoRAAdapter(request.lora_int_id, weights)


def _checked(
    where: str,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    modules: dict[str, tuple[int, int]],
    max_rank: int,
    alpha: float,
    cfg: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B with the scaling folded in) of one model module, after checking it fits."""
    if module not in modules:
        raise ValueError(
            f"{where}: module '{module}' is not an adaptable linear layer of the base model "
            f"(adaptable: {', '.join(sorted({n.rsplit('.', 1)[-1] for n in modules}))})"
        )
    in_f, out_f = modules[module]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, rank):
        raise ValueError(
            f"{where}: '{module}' has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            f"the base layer needs [r, {in_f}] and [{out_f}, r]"
        )
    if rank > max_rank:
        raise ValueError(
            f"{where}: rank {rank} of '{module}' exceeds max_lora_rank={max_rank}; "
            "raise max_lora_rank"
        )
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return a.contiguous(), (b * scaling).contiguous()
