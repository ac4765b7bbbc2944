"""Section 2, ``kernels``: every Triton kernel against its torch reference on the device."""

from __future__ import annotations

from typing import Any

import torch

from experiments.common.timing import Deadline
from experiments.gpu.plans import DTYPE_NAMES, TOL, Plan


def paged_cache(seq_lens, block_size, hkv, head_dim, dtype, device, seed=0):
    """Random K/V caches with shuffled block tables for ``seq_lens`` (as tests/test_kernels.py)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used : used + n])
        used += n
    shape = (num_blocks, block_size, hkv, head_dim)
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    width = max(needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k, v, padded.to(device)


def _compare(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, **tol) -> dict:
    """Max error of ``out`` vs ``ref`` and whether it is within tolerance."""
    tol = tol or TOL[dtype]
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    limit = tol["atol"] + tol["rtol"] * ref.abs()
    ok = bool(torch.isfinite(out).all()) and bool((err <= limit).all())
    return {
        "check": name,
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs_err": float(err.max()) if err.numel() else 0.0,
        **tol,
        "pass": ok,
    }


def kernel_checks(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every Triton kernel against its reference in one dtype; a kernel that raises is recorded
    as a failed check and the others still run."""
    results = []
    checks = (check_store_kv, check_store_kv_quantized, check_decode, check_prefill,
              check_copy_blocks, check_quant_matmul, check_fp8_linear,
              check_elementwise, check_lora, check_moe)  # fmt: skip
    for check in checks:
        torch.manual_seed(0)
        try:
            results.extend(check(plan, device, dtype))
        except Exception as err:
            results.append({"check": check.__name__.removeprefix("check_"), "dtype": dtype,
                            "pass": False, "error": f"{type(err).__name__}: {err}"})  # fmt: skip
    return results


def check_store_kv(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """KV store: bit-exact, padding slots (-1) skipped."""
    from paged_llm.attention.torch_backend import store_kv_reference
    from paged_llm.ops.kv_store.triton import store_kv_triton

    _, hkv, d = plan.kernel_heads
    k_ref, v_ref, _ = paged_cache([64], 16, hkv, d, dtype, device)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = torch.randperm(k_ref.shape[0] * 16, device=device)[:12]
    slots[3] = -1
    key, val = (torch.randn(12, hkv, d, device=device, dtype=dtype) for _ in range(2))
    store_kv_reference(key, val, k_ref, v_ref, slots)
    store_kv_triton(key, val, k_tri, v_tri, slots)
    out, ref = torch.stack([k_tri, v_tri]), torch.stack([k_ref, v_ref])
    return [_compare("store_kv", out, ref, dtype, atol=0.0, rtol=0.0)]


def check_store_kv_quantized(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Quantizing KV store (int8, and fp8 e4m3 where the GPU has it): dequantized values."""
    from paged_llm.attention.torch_backend import store_kv_reference
    from paged_llm.ops.kv_store.triton import store_kv_triton
    from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

    _, hkv, d = plan.kernel_heads
    key, val = (torch.randn(12, hkv, d, device=device, dtype=dtype) for _ in range(2))
    slots = torch.arange(12, device=device)
    fp8 = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
    results = []
    for name in ["int8"] + (["fp8_e4m3"] if fp8 else []):
        spec = KV_CACHE_DTYPES[name]
        caches = [torch.zeros(4, 16, hkv, d, device=device).to(spec.dtype) for _ in range(4)]
        scales = [torch.zeros(4, 16, hkv, device=device) for _ in range(4)]
        store_kv_reference(key, val, caches[0], caches[1], slots, scales[0], scales[1])
        store_kv_triton(key, val, caches[2], caches[3], slots, scales[2], scales[3])
        deq = [spec.dequantize(c, s, torch.float32) for c, s in zip(caches, scales)]
        # A division rounding differently can move a code one step: allow one step (int8),
        # or one step of the top fp8 binade (32 codes apart).
        step = float(scales[0].max()) * (1.0 if name == "int8" else 32.0)
        out, ref = torch.stack(deq[2:]), torch.stack(deq[:2])
        results.append(_compare(f"store_kv_{name}", out, ref, dtype, atol=step, rtol=0.0))
    return results


def check_decode(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Paged decode over shuffled blocks with GQA: split-K off, forced, automatic; and over an
    int8 cache."""
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton
    from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

    hq, hkv, d = plan.kernel_heads
    seq_lens, scale = plan.kernel_seq_lens, d**-0.5
    k, v, tables = paged_cache(seq_lens, 16, hkv, d, dtype, device)
    query = torch.randn(len(seq_lens), hq, d, device=device, dtype=dtype)
    ones = [1] * len(seq_lens)
    ref = paged_attention_reference(query, k, v, tables, ones, seq_lens, scale)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    results = []
    for splits in (1, 4, None):
        out = paged_decode_attention_triton(query, k, v, tables, lens, scale, num_splits=splits)
        results.append(_compare(f"paged_decode_splits_{splits or 'auto'}", out, ref, dtype))
    spec = KV_CACHE_DTYPES["int8"]
    (kq, ks), (vq, vs) = (spec.quantize(c.float().flatten(0, 1)) for c in (k, v))
    kq, vq, ks, vs = kq.view(k.shape), vq.view(k.shape), ks.view(k.shape[:3]), vs.view(k.shape[:3])
    ref = paged_attention_reference(query, kq, vq, tables, ones, seq_lens, scale, ks, vs)
    out = paged_decode_attention_triton(query, kq, vq, tables, lens, scale, k_scale=ks, v_scale=vs)
    results.append(_compare("paged_decode_int8_cache", out, ref, dtype))
    window = 100  # a sliding window inside the longer contexts, not a multiple of any tile
    ref = paged_attention_reference(
        query, k, v, tables, ones, seq_lens, scale, sliding_window=window
    )
    for splits in (1, None):
        out = paged_decode_attention_triton(
            query, k, v, tables, lens, scale, num_splits=splits, sliding_window=window
        )
        results.append(_compare(f"paged_decode_window_splits_{splits or 'auto'}", out, ref, dtype))
    return results


def check_prefill(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Paged prefill: each sequence's last query tokens over its cached prefix, causal."""
    from paged_llm.ops.paged_attention.reference import paged_attention_reference
    from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton

    hq, hkv, d = plan.kernel_heads
    seq_lens, scale = plan.kernel_seq_lens, d**-0.5
    k, v, tables = paged_cache(seq_lens, 16, hkv, d, dtype, device)
    q_lens = [min(s, q) for s, q in zip(seq_lens, [1, 9, 33, 70])]
    q = torch.randn(sum(q_lens), hq, d, device=device, dtype=dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    ref = paged_attention_reference(q, k, v, tables, q_lens, seq_lens, scale)
    out = paged_prefill_attention_triton(q, k, v, tables, starts.to(device), lens, scale)
    results = [_compare("paged_prefill", out, ref, dtype)]
    ref = paged_attention_reference(q, k, v, tables, q_lens, seq_lens, scale, sliding_window=21)
    out = paged_prefill_attention_triton(
        q, k, v, tables, starts.to(device), lens, scale, sliding_window=21
    )
    return results + [_compare("paged_prefill_window_21", out, ref, dtype)]


def check_copy_blocks(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Block copy (copy-on-write, in-device swaps): bit-exact."""
    from paged_llm.ops.copy_blocks.reference import copy_blocks_reference
    from paged_llm.ops.copy_blocks.triton import copy_blocks_triton

    _, hkv, d = plan.kernel_heads
    k, v, _ = paged_cache([64], 16, hkv, d, dtype, device)  # 4 + 2 spare blocks
    k_ref, v_ref = k.clone(), v.clone()
    src, dst = torch.tensor([0, 2], device=device), torch.tensor([1, 3], device=device)
    copy_blocks_reference(k_ref, v_ref, src, dst)
    copy_blocks_triton(k, v, src, dst)
    out, ref = torch.stack([k, v]), torch.stack([k_ref, v_ref])
    return [_compare("copy_blocks", out, ref, dtype, atol=0.0, rtol=0.0)]


def check_lora(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Multi-LoRA shrink/expand kernels against the torch reference: decode-sized (1 and 7
    rows) and prefill-sized (64 rows) batches mixing three adapters and base-model tokens."""
    from paged_llm.ops.lora.reference import add_lora_reference
    from paged_llm.ops.lora.triton import add_lora_triton

    hq, _, d = plan.kernel_heads
    k, n, rank, slots = hq * d, 2 * hq * d + 8, 16, 3  # an odd N: masked output tiles
    results = []
    for rows in (1, 7, 64):
        x = torch.randn(rows, k, device=device).to(dtype)
        y = torch.randn(rows, n, device=device).to(dtype)
        a = (torch.randn(slots, rank, k, device=device) / k**0.5).to(dtype)
        b = (0.1 * torch.randn(slots, n, rank, device=device)).to(dtype)
        token_slots = torch.randint(-1, slots, (rows,), device=device)
        ref = add_lora_reference(y.clone(), x, a, b, token_slots)
        out = add_lora_triton(y.clone(), x, a, b, token_slots)
        results.append(_compare(f"lora_rows_{rows}", out, ref, dtype))
    return results


def check_moe(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fused MoE grouped GEMMs against the torch reference: decode-sized (1 and 7 tokens) and
    prefill-sized (300 tokens) batches routed top-2 of 8 experts (Mixtral's routing)."""
    from paged_llm.ops.moe.reference import fused_experts_reference, select_experts
    from paged_llm.ops.moe.triton import fused_experts_triton

    hq, _, d = plan.kernel_heads
    hidden, inter, experts = hq * d, 2 * hq * d + 16, 8  # an odd I: masked tiles
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
    results = []
    for tokens in (1, 7, 300):
        x = torch.randn(tokens, hidden, device=device).to(dtype)
        weights, ids = select_experts(torch.randn(tokens, experts, device=device), 2, True)
        ref = fused_experts_reference(x, gate_up, down, weights, ids)
        out = fused_experts_triton(x, gate_up, down, weights, ids)
        results.append(_compare(f"fused_moe_tokens_{tokens}", out, ref, dtype))
    # int8 / fp8 experts (quantization="int8" / "fp8"): quantized tiles, per-channel scales
    # after the K loop; fp8 tiles need an FP8-capable GPU (compute capability >= 8.9)
    from paged_llm.quant.layers import fp8_matmul_supported, fp8_per_channel, int8_per_channel

    methods = {"int8": int8_per_channel}
    if fp8_matmul_supported(device):
        methods["fp8"] = fp8_per_channel
    x = torch.randn(7, hidden, device=device).to(dtype)
    weights, ids = select_experts(torch.randn(7, experts, device=device), 2, True)
    for name, per_channel in methods.items():
        (q_gate_up, s_gate_up), (q_down, s_down) = per_channel(gate_up), per_channel(down)
        args = (x, q_gate_up, q_down, weights, ids, s_gate_up, s_down)
        out, ref = fused_experts_triton(*args), fused_experts_reference(*args)
        results.append(_compare(f"fused_moe_{name}_tokens_7", out, ref, dtype))
    # int4 experts (quantization="int4_rtn"): packed tiles dequantized per group of 64 inputs
    from paged_llm.layers.moe import FusedExperts
    from paged_llm.quant.experts import quantize_experts_int4

    int4 = FusedExperts(experts, hidden, 2 * hidden).to(device)  # I = 2H: groups divide it
    with torch.no_grad():
        int4.gate_up_proj.normal_(std=hidden**-0.5)
        int4.down_proj.normal_(std=(2 * hidden) ** -0.5)
    quantize_experts_int4(int4, 64)
    args = (x, int4.gate_up_proj, int4.down_proj, weights, ids, int4.gate_up_scale,
            int4.down_scale, int4.gate_up_zero, int4.down_zero)  # fmt: skip
    out, ref = fused_experts_triton(*args), fused_experts_reference(*args)
    results.append(_compare("fused_moe_int4_tokens_7", out, ref, dtype))
    return results


def check_quant_matmul(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The int8, fp8 and int4 (GPTQ layout) decode matmul kernels against dequantize + matmul,
    on both paths: GEMV (1 row) and tl.dot (5 / 7 rows)."""
    from paged_llm.ops.quant_matmul.reference import int4_matmul_reference, int8_matmul_reference
    from paged_llm.ops.quant_matmul.triton import (
        fp8_matmul_triton,
        int4_matmul_triton,
        int8_matmul_triton,
    )
    from paged_llm.quant.packing import pack_int4

    # relative to the largest output, as tests/test_quant_layers.py does
    rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (80, 72), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(80, generator=gen) / 100).to(device)
    w_fp8 = (torch.randn(80, 72, generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    k, n, group = 256, 48, 64
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) / 50).to(device=device, dtype=torch.float16)
    qweight, qzeros = pack_int4(q, 0).to(device), pack_int4(zeros, 1).to(device)
    g_idx = (torch.arange(k) // group).to(device)
    fp8_ok = device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)
    results = []
    for rows in (1, 5):  # GEMV (rows <= gemv_rows = 4) and tl.dot
        x = torch.randn(rows, 72, generator=gen).to(device=device, dtype=dtype)
        x4 = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
        pairs = [
            ("int8_matmul", int8_matmul_triton(x, w, scale),
             int8_matmul_reference(x.float(), w, scale)),
            ("int4_matmul", int4_matmul_triton(x4, qweight, qzeros, scales, group, 1),
             int4_matmul_reference(x4.float(), qweight, qzeros, scales, g_idx, 1)),
        ]  # fmt: skip
        if fp8_ok:
            pairs.append(("fp8_matmul", fp8_matmul_triton(x, w_fp8, scale),
                          int8_matmul_reference(x.float(), w_fp8.float(), scale)))  # fmt: skip
        for name, out, ref in pairs:
            tol = rel * float(ref.abs().max())
            results.append(_compare(f"{name}_rows_{rows}", out, ref, dtype, atol=tol, rtol=rel))
    return results


def check_elementwise(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fused RMSNorm, rotary and SwiGLU-gate kernels against the torch reference (which rounds
    as transformers does); on a GPU both round to nearest, so they agree to a float32 ulp."""
    from paged_llm.ops.elementwise import reference as ref
    from paged_llm.ops.elementwise import triton as tri

    hq, _, d = plan.kernel_heads
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(7, hq * d, generator=gen)).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(hq * d, generator=gen)).to(device=device, dtype=dtype)
    angles = torch.rand(7, d // 2, generator=gen) * 6
    cos, sin = (f(torch.cat((angles, angles), -1)).to(device=device, dtype=dtype)
                for f in (torch.cos, torch.sin))  # fmt: skip
    q = x.view(7, hq, d)
    up = torch.randn(7, hq * d, generator=gen).to(device=device, dtype=dtype)
    # one rounding step of the dtype (interpreter runs truncate bf16: two)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    pairs = [
        ("rms_norm", tri.rms_norm_triton(x, w, 1e-6), ref.rms_norm_reference(x, w, 1e-6)),
        ("rotary", tri.rotary_triton(q, cos, sin), ref.rotary_reference(q, cos, sin)),
        ("silu_mul", tri.silu_mul_triton(x, up), ref.silu_mul_reference(x, up)),
    ]
    return [_compare(name, out, want, dtype, atol=tol, rtol=tol) for name, out, want in pairs]


def check_fp8_linear(plan: Plan, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fp8Linear against the dequantized weight in fp32 at decode (1 and 32 rows: the weight-only
    Triton kernel) and prefill (300 rows: torch._scaled_mm where the GPU has FP8, which rounds the
    activations to e4m3, hence a bound on the relative error norm)."""
    from paged_llm.quant.layers import Fp8Linear, fp8_matmul_supported

    if dtype == torch.float32:
        return []  # the FP8 path serves fp16/bf16 models
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(256, 384, bias=False)
    linear.weight.data = torch.randn(384, 256, generator=gen) / 16
    layer = Fp8Linear.from_float(linear).to(device)
    results = []
    for rows in (1, 32, 300):
        x = torch.randn(rows, 256, generator=gen).to(device=device, dtype=dtype)
        ref = x.float() @ layer.dequantize().t()
        out = layer.matmul(x).float()
        rel = float((out - ref).norm() / ref.norm())
        results.append({
            "check": f"fp8_linear_rows_{rows}",
            "dtype": str(dtype).removeprefix("torch."),
            "scaled_mm": fp8_matmul_supported(device),
            "relative_error": rel,
            "pass": bool(torch.isfinite(out).all()) and rel < 0.05,
        })  # fmt: skip
    return results


def section_kernels(plan: Plan, device: torch.device, deadline: Deadline) -> dict[str, Any]:
    """Kernel correctness in every planned dtype, while time allows."""
    checks, skipped = [], []
    for name in plan.kernel_dtypes:
        if deadline.left() <= 0:
            skipped.append(name)
            continue
        checks.extend(kernel_checks(plan, device, DTYPE_NAMES[name]))
    failed = [f"{c['check']}/{c['dtype']}" for c in checks if not c["pass"]]
    return {
        "checks": checks,
        "all_pass": not failed and not skipped,
        "failed": failed,
        "skipped_dtypes": skipped,
    }
