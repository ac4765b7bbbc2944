"""AWQ (Lin et al., 2024): activation-aware weight quantization. A few input channels carry
large activations; scaling their weight columns up by ``s`` (and the activations down by
``1/s``) before rounding protects them. ``s = mean|x|^alpha`` with alpha picked per layer group
by a grid search that minimises the group's output error on calibration inputs; ``1/s`` is
folded into the preceding norm or linear layer, so inference costs nothing extra. Optionally
each group's weight range is then clipped to the error-minimising value (AWQ's auto-clip).
Writes the same packed int4 format as RTN and GPTQ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_llm.quant.base import Int4GroupCheck, QuantMethod, linears_by_block, set_module
from paged_llm.quant.calibration import BlockwiseCalibration
from paged_llm.quant.int4 import fake_quantize, rtn_quantize
from paged_llm.quant.layers import Int4Linear

Plan = list[tuple[str, tuple[str, ...]]]  # (layer whose output feeds the group, its linears)
QKV = ("q_proj", "k_proj", "v_proj")


def _under(prefix: str, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{prefix}.{n}" for n in names)


def _homogeneous(act: object) -> bool:
    """Whether ``act(x / s) == act(x) / s`` for s > 0 (ReLU), so a scale can cross it; GELU and
    SiLU do not allow it (AWQ then leaves that pair unscaled)."""
    return act is F.relu


def _norm_folds(norm: nn.Module) -> bool:
    """A norm can take a scale only if it has a weight (elementwise affine)."""
    return getattr(norm, "weight", None) is not None


def _llama_plan(layer: nn.Module) -> Plan:
    return [
        ("input_layernorm", _under("self_attn", QKV)),
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),  # down(act(gate) * up): up's rows scale linearly
    ]


def _opt_plan(layer: nn.Module) -> Plan:
    # Post-LN blocks (OPT-350m) feed the raw residual to q/k/v and fc1: no norm to fold into.
    pre = layer.do_layer_norm_before and _norm_folds(layer.self_attn_layer_norm)
    plan = [("self_attn_layer_norm", _under("self_attn", QKV))] if pre else []
    plan.append(("self_attn.v_proj", ("self_attn.out_proj",)))
    if pre:
        plan.append(("final_layer_norm", ("fc1",)))
    if _homogeneous(layer.activation_fn):
        plan.append(("fc1", ("fc2",)))
    return plan


def _gpt2_plan(layer: nn.Module) -> Plan:
    plan = [("ln_1", _under("attn", QKV)), ("attn.v_proj", ("attn.c_proj",)),
            ("ln_2", ("mlp.c_fc",))]  # fmt: skip
    if _homogeneous(layer.mlp.act):
        plan.append(("mlp.c_fc", ("mlp.c_proj",)))
    return plan


def _gpt_neox_plan(layer: nn.Module) -> Plan:
    plan = [("input_layernorm", _under("attention", QKV)),
            ("attention.v_proj", ("attention.dense",)),
            ("post_attention_layernorm", ("mlp.dense_h_to_4h",))]  # fmt: skip
    if _homogeneous(layer.mlp.act):
        plan.append(("mlp.dense_h_to_4h", ("mlp.dense_4h_to_h",)))
    return plan


# For each block type, its scaling plan: the pairs (layer whose output feeds a group, the
# linears sharing that input) where a scale on the group's inputs can be folded into that layer
# without changing the block's function. Groups whose shapes do not line up (v_proj -> o_proj
# under grouped-query attention, where heads are shared) are skipped at run time, as in AWQ.
SCALING_PLANS: dict[str, Callable[[nn.Module], Plan]] = {
    "LlamaDecoderLayer": _llama_plan,  # also Mistral, Qwen2 and Qwen3 (dense)
    "OPTDecoderLayer": _opt_plan,
    "GPT2Block": _gpt2_plan,
    "GPTNeoXLayer": _gpt_neox_plan,
}


def _out_channels(module: nn.Module) -> int:
    """Size of a norm's or linear's output (what the scale divides)."""
    return module.out_features if isinstance(module, nn.Linear) else module.weight.numel()


@torch.no_grad()
def fold_inverse_scale(prev: nn.Module, scale: torch.Tensor) -> None:
    """Divide ``prev``'s output channels by ``scale`` (norm weight/bias or linear rows)."""
    prev.weight.div_(scale.view(-1, *([1] * (prev.weight.dim() - 1))).to(prev.weight.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(scale.to(prev.bias.dtype))


@torch.no_grad()
def apply_scale(prev: nn.Module, linears: list[nn.Module], scale: torch.Tensor) -> None:
    """Scale the group's input channels up by ``scale`` and ``prev``'s outputs down by it: the
    same function, with the channels that matter larger before rounding."""
    fold_inverse_scale(prev, scale)
    for lin in linears:
        lin.weight.mul_(scale.to(lin.weight.dtype))


def search_scale(
    x: torch.Tensor,  # [T, K] calibration inputs
    weight: torch.Tensor,  # [N, K] the group's weights stacked
    group_size: int,
    grid: int = 20,
) -> torch.Tensor:  # [K]
    """The per-input-channel scale ``mean|x|^alpha`` (normalised) with the smallest output MSE."""
    y_ref = x @ weight.t()
    x_mean = x.abs().mean(dim=0)
    best_err, best = float("inf"), torch.ones_like(x_mean)
    for i in range(grid):  # alpha = 0 is plain round-to-nearest, so AWQ never does worse here
        s = x_mean.pow(i / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1
        wq = fake_quantize(weight * s, group_size) / s
        err = (x @ wq.t() - y_ref).pow(2).mean().item()
        if err < best_err:
            best_err, best = err, s
    return best


def search_clip(
    x: torch.Tensor,  # [T, K] inputs (already divided by the layer's AWQ scale)
    weight: torch.Tensor,  # [N, K]
    group_size: int,
    grid: int = 20,
    max_shrink: float = 0.5,
    max_tokens: int = 512,
    chunk: int = 64,
) -> torch.Tensor:  # [N, K] the clipped weight
    """Per (output row, group) clip ``|w| <= r * max|w|`` with the ratio r minimising that
    group's partial output error on ``x`` (AWQ's auto-clip, on up to ``max_tokens`` rows)."""
    n, k = weight.shape
    if x.shape[0] > max_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, max_tokens, device=x.device).long()]
    g = k // group_size
    xg = x.t().reshape(g, group_size, -1)  # [G, g, T]
    out = weight.clone()
    for r0 in range(0, n, chunk):  # rows in chunks bound the [rows, G, T] temporaries
        w = weight[r0 : r0 + chunk].reshape(-1, g, group_size)  # [R, G, g]
        ref = torch.einsum("rgc,gct->rgt", w, xg)
        max_abs = w.abs().amax(dim=-1, keepdim=True)  # [R, G, 1]
        best_err = torch.full_like(max_abs, float("inf"))
        best_max = max_abs.clone()
        for i in range(int(max_shrink * grid)):
            m = max_abs * (1 - i / grid)
            wc = torch.maximum(torch.minimum(w, m), -m)
            wq = fake_quantize(wc.reshape(w.shape[0], k), group_size).reshape(w.shape)
            err = (torch.einsum("rgc,gct->rgt", wq, xg) - ref).pow(2).mean(-1, keepdim=True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, m, best_max)
        out[r0 : r0 + chunk] = torch.maximum(torch.minimum(w, best_max), -best_max).reshape(-1, k)
    return out


class AWQ(Int4GroupCheck, QuantMethod):
    """int4 group-wise AWQ: activation-aware scaling search (+ optional clip search)."""

    name = "int4_awq"
    needs_calibration = True

    def __init__(
        self,
        group_size: int = 128,
        grid: int = 20,
        clip: bool = True,
        no_clip: tuple[str, ...] = ("q_proj", "k_proj"),
        num_samples: int = 64,
        seq_len: int = 256,
        max_search_tokens: int = 4096,
    ) -> None:
        self.group_size = group_size
        self.grid = grid
        self.clip = clip
        # As in AWQ: q/k errors are damped by the softmax, and clipping them was found to hurt.
        self.no_clip = tuple(no_clip)
        self.num_samples = num_samples  # calibration windows (when the caller gives none)
        self.seq_len = seq_len
        self.max_search_tokens = max_search_tokens  # inputs kept per layer for the searches

    def _plan(self, model: nn.Module, block: str) -> Plan:
        layer = model.get_submodule(block)
        kind = type(layer).__name__
        if kind not in SCALING_PLANS:
            raise ValueError(
                f"AWQ has no scaling plan for {kind} (block '{block}'); known: "
                f"{sorted(SCALING_PLANS)}. Use int4_gptq or int4_rtn for this model."
            )
        return SCALING_PLANS[kind](layer)

    @torch.no_grad()
    def quantize(self, model: nn.Module, calibration: torch.Tensor | None) -> nn.Module:
        """Per block: capture inputs, search and fold scales, clip, round."""
        if calibration is None:
            raise ValueError("AWQ needs calibration token ids [N, L]")
        self.check_model(model)
        blocks = linears_by_block(model)
        calib = BlockwiseCalibration(model, calibration, next(iter(blocks)))
        for block, names in blocks.items():
            plan = self._plan(model, block)
            inputs = self._capture(calib, block, names)
            input_scale: dict[str, torch.Tensor] = {}
            for prev_name, group in plan:
                prev = model.get_submodule(f"{block}.{prev_name}")
                linears = [model.get_submodule(f"{block}.{n}") for n in group]
                if any(_out_channels(prev) != lin.in_features for lin in linears):
                    continue  # e.g. GQA: v_proj has fewer outputs than o_proj has inputs
                x = inputs[f"{block}.{group[0]}"]
                stacked = torch.cat([lin.weight.float() for lin in linears])
                s = search_scale(x, stacked, self.group_size, self.grid)
                apply_scale(prev, linears, s)
                for n in group:
                    input_scale[f"{block}.{n}"] = s
            for name in names:
                lin = model.get_submodule(name)
                w = lin.weight.float()
                if self.clip and not name.endswith(self.no_clip):
                    x = inputs[name]
                    if name in input_scale:
                        x = x / input_scale[name]
                    w = search_clip(x, w, self.group_size, self.grid)
                codes, scales, zeros = rtn_quantize(w, self.group_size)
                set_module(
                    model,
                    name,
                    Int4Linear.from_quantized(codes, scales, zeros, self.group_size, lin.bias),
                )
            calib.advance(block)  # the next block sees this quantized block's outputs
        return model

    def _capture(
        self, calib: BlockwiseCalibration, block: str, names: list[str]
    ) -> dict[str, torch.Tensor]:
        """Inputs [T, K] of each linear in ``names`` on the calibration windows (subsampled)."""
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}

        def keep(name: str):
            return lambda x: seen[name].append(x)

        calib.run(block, {n: keep(n) for n in names})
        out = {}
        for name, chunks in seen.items():
            x = torch.cat(chunks)
            if x.shape[0] > self.max_search_tokens:  # an even spread keeps every window
                idx = torch.linspace(0, x.shape[0] - 1, self.max_search_tokens, device=x.device)
                idx = idx.long()
                x = x[idx]
            out[name] = x
        return out
