"""experiments/kernel_compile_report: every Triton kernel compiles for sm_90 on this CPU machine
(the interpreter cannot tell, e.g. it accepts a plain global read in a kernel), without
spills, and the int4 decode kernel's main loop keeps the shape it was written for."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.kernel_compile_report import hot_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   I2FP.F32.U32 R3, R2 ;
        /*0030*/                   FFMA R5, R3, R3, R5 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/               @P0 BRA 0x10 ;
        /*0060*/                   STS [R0], R5 ;
        /*0070*/                   EXIT ;
        /*0080*/                   BRA 0x80;
"""


def test_hot_loop_counts_the_longest_backward_branch():
    assert hot_loop(SASS) == {
        "instructions": 5, "barriers": 1, "shared_memory": 0, "global_loads": 1,
        "int_to_float": 1, "fma": 1,
    }  # fmt: skip
    assert hot_loop(SASS.replace("BRA 0x10", "BRA 0x70")) is None  # forward branches only


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_and_int4_gemv_loop_is_lean(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    cmd = [sys.executable, "-m", "experiments.kernel_compile_report", "arch=[90]",
           "dtypes=[bf16]", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    doc = json.loads((tmp_path / "kernel_compile.json").read_text())
    assert doc["all_ok"] and doc["measured"] is False, [r for r in doc["rows"] if not r["ok"]]
    int4 = next(r for r in doc["rows"] if r["case"] == "int4_matmul_m1")
    loop = int4["hot_loop"]
    assert int4["kernel"] == "_int4_gemv_kernel" and int4["local"] == 0
    # one load per packed int32, no int->float per weight, no reduction inside the loop
    assert loop["barriers"] == loop["shared_memory"] == 0 and loop["int_to_float"] <= 4
    assert loop["instructions"] < 8 * 64  # a 128 x 64 tile over 128 threads: 64 weights each
    dot = next(r for r in doc["rows"] if r["case"] == "int4_matmul_m32")
    assert dot["kernel"] == "_int4_matmul_kernel" and dot["hot_loop"]["int_to_float"] <= 2
