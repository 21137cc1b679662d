"""The GPU draft attention kernels (sgl_vericache.kernels) against their torch twins.

The cases live in kernel_checks.py, a plain script (the bare GPU machine has no pytest).
Each family runs in a subprocess: Triton's interpreter must be switched on
(TRITON_INTERPRET=1) before anything imports triton, and this test process may already
have imported it without. On CPU the interpreter runs every case except the `large`
family (~1 min on 2 cores); with CUDA the `gpu` tests run them compiled, large ones too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "test" / "kernel_checks.py"
INTERPRETED_FAMILIES = ["quantizers", "droppers", "layouts", "store"]


def _run_checks(args: list[str], interpret: bool, timeout: float = 600) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(CHECKS), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("family", INTERPRETED_FAMILIES)
def test_kernels_match_torch_twins_in_the_interpreter(family):
    out = _run_checks(["--device", "cpu", "--family", family], interpret=True)
    assert " 0 failed" in out and "interpreter" in out, out[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", INTERPRETED_FAMILIES + ["large"])
def test_kernels_match_torch_twins_on_cuda(family):
    out = _run_checks(["--device", "cuda", "--family", family], interpret=False)
    assert " 0 failed" in out and "compiled" in out, out[-3000:]


def test_checks_refuse_cpu_without_the_interpreter():
    """Compiled Triton cannot run on a CPU: the script says so instead of crashing later."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(CHECKS), "--device", "cpu"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]


def test_cpu_drafting_never_touches_the_kernels():
    """On a CPU the draft store keeps its dense torch path: the kernels are not even imported
    (nor triton), and draft_attention_available says no."""
    code = """
import sys, torch
from sgl_vericache.kernels import draft_attention_available
from sgl_vericache.mem_cache.compress import get_compressor
from sgl_vericache.spec.drafter import CompressedKVStore
k, v = torch.randn(300, 2, 64), torch.randn(300, 2, 64)
store = CompressedKVStore(get_compressor("kivi4"), num_layers=1)
store.sync("r", 300, lambda _, s, e: (k[s:e], v[s:e]))
store.begin_round(["r"], 2)
store.attend(0, torch.randn(1, 4, 64), torch.randn(1, 2, 64), torch.randn(1, 2, 64), 0.125)
assert store._kernel_round is None and store._round is not None
assert not draft_attention_available("cpu") and not draft_attention_available(torch.device("cpu"))
loaded = sorted(m for m in sys.modules if m == "triton" or m.startswith("sgl_vericache.kernels."))
assert not loaded, loaded
print("dense path")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "dense path" in proc.stdout, proc.stderr[-3000:]
