"""Compile every Triton kernel for a GPU architecture on a machine without one, and report each
compiled variant's registers, spills, shared memory and the static instruction counts of its
hot loop (one JSON).

The CPU interpreter checks what the kernels compute, not that they compile: a kernel can pass
every interpreter test and still fail to lower for sm_90, or spill registers to local memory
there. This compiles the kernels exactly as the engine launches them (through the public
wrappers, with the tuned configs of ``paged_llm/ops/tuning.py`` for that architecture) against
a stand-in driver that reports the target GPU and never launches; the cubins' resource usage
and SASS come from the ``cuobjdump`` that Triton ships. The hot-loop counts (instructions,
barriers, shared-memory accesses, int->float conversions per iteration of the longest loop)
compare two versions of a kernel before any GPU time is spent on them; they are not timings.

    python -m experiments.kernel_compile_report [arch=[90,80]] [dtypes=[fp16,bf16]] [cases=[...]]
        # configs/kernel_compile_report.yaml; kernel_compile.json in the Hydra run directory
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from experiments.common.cli import hydra_app, settings
from paged_llm.metrics.run_info import write_json

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class _CompileOnlyDriver:
    """Reports a CUDA target of the given capability; Triton compiles but never launches."""

    def __init__(self, capability: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self) -> Any:
        return torch.cuda

    @staticmethod
    def is_active() -> bool:
        return True


@contextlib.contextmanager
def compile_only(capability: int, arch: str) -> Iterator[list[Any]]:
    """Within: Triton kernels compile for ``sm_<capability>`` and are not run; the tuned configs
    are those of ``arch``. Yields the list the compiled kernels are appended to."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from paged_llm.ops import tuning

    compiled: list[Any] = []
    original_run = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        self.device_caches.clear()  # its binders hold the target they were made for
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    original_arch, original_driver = tuning.arch_of, driver._active
    driver.set_active(_CompileOnlyDriver(capability))
    JITFunction.run = run
    tuning.arch_of = lambda device: arch
    try:
        yield compiled
    finally:
        JITFunction.run = original_run
        tuning.arch_of = original_arch
        driver._active = original_driver  # reset_active() would look for a real GPU driver


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of Triton's own ``cuobjdump <flag>`` on a cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [str(tool), flag, f.name], capture_output=True, text=True, check=True
        ).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the one function in a cubin (Triton's cuobjdump)."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split())
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "SHARED", "LOCAL")}


_SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
# opcode -> the hot-loop count it adds to: what makes a kernel's inner loop slow
_LOOP_CLASSES = {
    "barriers": ("BAR",),
    "shared_memory": ("LDS", "LDSM", "STS"),
    "global_loads": ("LDG", "LDGSTS"),  # LDGSTS: an asynchronous copy to shared memory
    "int_to_float": ("I2F", "I2FP"),  # conversions run at a quarter of the FMA rate
    "fma": ("FFMA", "HFMA2", "HMMA", "HGMMA", "IMMA"),
}


def hot_loop(sass: str) -> dict[str, int] | None:
    """Static counts of the longest loop (a backward branch) of one function's SASS: the main
    loop of these kernels, where an extra instruction costs once per tile. None if no loop."""
    ins = [(int(a, 16), op, rest) for a, op, rest in _SASS_LINE.findall(sass)]
    best: list[str] = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    if not best:
        return None
    counts = {"instructions": len(best)}
    for name, ops in _LOOP_CLASSES.items():
        counts[name] = sum(op in ops for op in best)
    return counts


# ---- the launches to compile: (case name, function launching the kernels for one dtype) -------
def _paged(batch: int, context: int, block_size: int, hkv: int, d: int, dtype: torch.dtype):
    per_seq = -(-context // block_size)
    k = torch.empty(batch * per_seq, block_size, hkv, d, dtype=dtype)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    return k, torch.empty_like(k), tables, lens


def _decode(hq: int, hkv: int, block_size: int, splits: int, kv: str | None = None):
    def launch(dtype: torch.dtype) -> None:
        from paged_llm.ops.paged_attention.triton_decode import paged_decode_attention_triton
        from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

        k, v, tables, lens = _paged(4, 512, block_size, hkv, 128, dtype)
        scales: dict[str, torch.Tensor] = {}
        if kv:
            cache_dtype = KV_CACHE_DTYPES[kv].dtype
            k, v = k.to(cache_dtype), v.to(cache_dtype)
            scales = dict(k_scale=torch.ones(k.shape[:3]), v_scale=torch.ones(k.shape[:3]))
        q = torch.empty(4, hq, 128, dtype=dtype)
        paged_decode_attention_triton(q, k, v, tables, lens, 0.1, num_splits=splits, **scales)

    return launch


def _prefill(hq: int, hkv: int):
    def launch(dtype: torch.dtype) -> None:
        from paged_llm.ops.paged_attention.triton_prefill import paged_prefill_attention_triton

        k, v, tables, lens = _paged(2, 256, 16, hkv, 128, dtype)
        q = torch.empty(512, hq, 128, dtype=dtype)
        starts = torch.tensor([0, 256, 512], dtype=torch.int32)
        paged_prefill_attention_triton(q, k, v, tables, starts, lens, 0.1)

    return launch


def _store_kv(kv: str | None):
    def launch(dtype: torch.dtype) -> None:
        from paged_llm.ops.kv_store.triton import store_kv_triton
        from paged_llm.quant.kv_cache import KV_CACHE_DTYPES

        k, v, _, _ = _paged(1, 64, 16, 8, 128, dtype)
        scales: dict[str, torch.Tensor] = {}
        if kv:
            k, v = (c.to(KV_CACHE_DTYPES[kv].dtype) for c in (k, v))
            scales = dict(k_scale=torch.ones(k.shape[:3]), v_scale=torch.ones(k.shape[:3]))
        new = torch.empty(8, 8, 128, dtype=dtype)
        store_kv_triton(new, new, k, v, torch.arange(8), **scales)

    return launch


def _copy_blocks(dtype: torch.dtype) -> None:
    from paged_llm.ops.copy_blocks.triton import copy_blocks_triton

    k, v, _, _ = _paged(1, 64, 16, 8, 128, dtype)
    copy_blocks_triton(k, v, torch.tensor([0]), torch.tensor([1]))


def _w8_matmul(rows: int, weight_dtype: torch.dtype = torch.int8, **overrides: int):
    def launch(dtype: torch.dtype) -> None:
        from paged_llm.ops.quant_matmul.triton import fp8_matmul_triton, int8_matmul_triton

        matmul = int8_matmul_triton if weight_dtype == torch.int8 else fp8_matmul_triton
        w = torch.empty(4096, 4096, dtype=weight_dtype)
        x = torch.empty(rows, 4096, dtype=dtype)
        matmul(x, w, torch.empty(4096), **overrides)

    return launch


def _int4_matmul(rows: int, **overrides: int):
    def launch(dtype: torch.dtype) -> None:
        from paged_llm.ops.quant_matmul.triton import int4_matmul_triton

        qweight = torch.empty(512, 4096, dtype=torch.int32)
        qzeros = torch.empty(32, 512, dtype=torch.int32)
        scales = torch.empty(32, 4096, dtype=torch.float16)
        x = torch.empty(rows, 4096, dtype=dtype)
        int4_matmul_triton(x, qweight, qzeros, scales, 128, 1, **overrides)

    return launch


def _elementwise(dtype: torch.dtype) -> None:
    from paged_llm.ops.elementwise import triton as tri

    x = torch.empty(8, 4096, dtype=dtype)
    tri.rms_norm_triton(x, torch.empty(4096, dtype=dtype), 1e-6)
    tri.rotary_triton(x.view(8, 32, 128), torch.empty(8, 128, dtype=dtype),
                      torch.empty(8, 128, dtype=dtype))  # fmt: skip
    tri.silu_mul_triton(torch.empty(8, 11008, dtype=dtype), torch.empty(8, 11008, dtype=dtype))


CASES: dict[str, Callable[[torch.dtype], None]] = {
    "decode_mha_bs16": _decode(32, 32, 16, 1),
    "decode_gqa_bs32": _decode(32, 8, 32, 1),
    "decode_split4": _decode(32, 8, 16, 4),
    "decode_int8_cache": _decode(32, 8, 16, 1, "int8"),
    "decode_fp8_cache": _decode(32, 8, 16, 1, "fp8_e4m3"),
    "prefill_gqa": _prefill(32, 8),
    "store_kv": _store_kv(None),
    "store_kv_int8": _store_kv("int8"),
    "store_kv_fp8": _store_kv("fp8_e4m3"),
    "copy_blocks": _copy_blocks,
    "int8_matmul_m1": _w8_matmul(1),  # the tuned path at 1 row (GEMV where gemv_rows >= 1)
    "int8_matmul_m4": _w8_matmul(4),
    "int8_matmul_m8_gemv": _w8_matmul(8, gemv_rows=8),
    "int8_matmul_m1_dot": _w8_matmul(1, gemv_rows=0),
    "int8_matmul_m32": _w8_matmul(32),
    "fp8_matmul_m1": _w8_matmul(1, torch.float8_e4m3fn),
    "fp8_matmul_m32": _w8_matmul(32, torch.float8_e4m3fn),
    "int4_matmul_m1": _int4_matmul(1),
    "int4_matmul_m4": _int4_matmul(4),
    "int4_matmul_m8_gemv": _int4_matmul(8, gemv_rows=8),
    "int4_matmul_m1_dot": _int4_matmul(1, gemv_rows=0),
    "int4_matmul_m32": _int4_matmul(32),
    "int8_matmul_m1_split8": _w8_matmul(1, split_k=8),
    "int4_matmul_m1_split8": _int4_matmul(1, split_k=8),
    "elementwise": _elementwise,
}
# need compute capability >= 8.9
FP8_CASES = {"decode_fp8_cache", "store_kv_fp8", "fp8_matmul_m1", "fp8_matmul_m32"}


def compile_case(name: str, capability: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Compile one case; one row per kernel it launched (or one error row)."""
    arch = {9: "sm90", 8: "sm80"}.get(capability // 10, "default")
    row = {"case": name, "capability": capability, "dtype": str(dtype).removeprefix("torch.")}
    try:
        with compile_only(capability, arch) as kernels:
            CASES[name](dtype)
    except Exception as err:  # recorded: the report is for finding exactly these
        return [{**row, "ok": False, "error": f"{type(err).__name__}: {str(err)[:400]}"}]
    rows = []
    for kernel in kernels:
        meta = kernel.metadata
        usage = resource_usage(kernel.asm["cubin"])
        rows.append(
            {
                **row,
                "kernel": meta.name,
                "num_warps": meta.num_warps,
                "num_stages": meta.num_stages,
                "dynamic_shared": meta.shared,  # Triton's tiles live in dynamic shared memory
                **usage,
                "hot_loop": hot_loop(_cuobjdump(kernel.asm["cubin"], "-sass")),
                "ok": usage["local"] == 0,  # spills go to local memory
            }
        )
    return rows


def _loop_summary(loop: dict[str, int] | None) -> str:
    if loop is None:
        return "-"
    return " ".join(f"{k}={v}" for k, v in loop.items() if v)


def write(cfg: Any, out_dir: str | Path) -> dict[str, Any]:
    """Compile the cases for each architecture and dtype; write kernel_compile.json into
    out_dir and return the report."""
    args = settings(cfg)
    args.cases = args.cases or list(CASES)  # null: every case
    for key, known in (("dtypes", DTYPES), ("cases", CASES)):
        unknown = sorted(set(getattr(args, key)) - set(known))
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; choose from {list(known)}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles kernels instead of interpreting")
    import triton

    rows = []
    for capability in args.arch:
        for dtype_name in args.dtypes:
            for case in args.cases:
                if case in FP8_CASES and capability < 89:
                    continue
                rows.extend(compile_case(case, capability, DTYPES[dtype_name]))
                last = rows[-1]
                print(
                    f"sm_{capability} {dtype_name:4} {case:18} "
                    + (
                        f"regs {last['reg']:3} local {last['local']} "
                        f"shared {last['dynamic_shared']:6} loop {_loop_summary(last['hot_loop'])}"
                        if "reg" in last
                        else last.get("error", "")
                    ),
                    flush=True,
                )
    report = {
        "schema": "paged_llm.kernel_compile/1",
        "measured": False,
        "note": "compiled on a CPU for the targets named; nothing ran on a GPU",
        "triton": triton.__version__,
        "torch": torch.__version__,
        "rows": rows,
        "all_ok": all(r["ok"] for r in rows),
    }
    print(f"all_ok={report['all_ok']}  wrote {write_json(out_dir, 'kernel_compile.json', report)}")
    return report


def main() -> None:
    """``python -m experiments.kernel_compile_report [arch=[90,80]] [dtypes=[fp16,bf16]] ...``."""
    hydra_app("kernel_compile_report", write)


if __name__ == "__main__":
    main()
