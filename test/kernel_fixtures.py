"""What every draft-kernel check shares (kernel_checks.py and kernel_store_checks.py): the
case record, the shapes, seeded K/V and the tolerance comparison; and kernel_checks.py's
harness for running its cases in several processes. Not a pytest module."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from sgl_vericache.kernels import ops

TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
SMALL = ops.LaunchConfig(block_n=16)  # small blocks: short entries still span several


@dataclass(frozen=True)
class Shape:
    lengths: tuple[int, ...]  # verified tokens per request (ragged)
    kv_heads: int = 2
    group: int = 3  # query heads per KV head
    head_dim: int = 64
    dtype: torch.dtype = torch.float32  # KV (entry) and query dtype
    q_dtype: torch.dtype | None = None  # None: as dtype
    # queries are randn * q_gain and the softmax scale 1 / (sqrt(d) q_gain): the same scores
    # from queries far outside fp16's range (half products rescale them into it)
    q_gain: float = 1.0


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[torch.device], float]  # returns the max abs error it checked; raises on failure
    family: str  # one of FAMILIES: test_kernels.py runs one subprocess per family
    interpret: bool = True  # runs under the interpreter (False: too large for it, or inline PTX)
    tags: tuple[str, ...] = field(default_factory=tuple)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kv(tokens, shape: Shape, seed: int):
    g = _gen(seed)
    k = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=g) * 1.5 + 0.3
    v = torch.randn(tokens, shape.kv_heads, shape.head_dim, generator=g)
    return k.to(shape.dtype), v.to(shape.dtype)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, label: str) -> float:
    atol, rtol = TOL[dtype]
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape, (label, got.shape, ref.shape)
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    if bool(bad.any()) or not bool(torch.isfinite(got).all()):
        where = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else "non-finite"
        raise AssertionError(f"{label}: max abs error {float(err.max()):.3g} (atol {atol}, rtol {rtol}) at {where}")
    return float(err.max())


# KIVI options of the small cases: short entries still have several groups and a residual window
KIVI = {"group_size": 8, "residual_length": 8}


def _line(text: str) -> None:
    """Print one line in one write. ``--jobs`` shards share their caller's stdout, and with
    PYTHONUNBUFFERED (set on these machines) print's text and newline are two writes that
    another shard's line can land between: a glued line fails the caller's parse."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_sharded(script: str, jobs: int, argv: list[str]) -> int:
    """``script`` (kernel_checks.py) in ``jobs`` processes at once, each every jobs-th case, each printing its
    lines as its cases end (a run its caller's time limit cuts keeps every line printed so
    far), then one summary of their counts. A process that dies counts as a failure."""
    import re
    import subprocess
    import tempfile

    rest, skip = [], False
    for arg in argv:  # this call's arguments without --jobs
        if skip:
            skip = False
        elif arg == "--jobs":
            skip = True
        elif not arg.startswith("--jobs="):
            rest.append(arg)
    start = time.perf_counter()
    sys.stdout.flush()
    tmp = tempfile.TemporaryDirectory()
    files = [Path(tmp.name) / f"shard{k}" for k in range(jobs)]
    procs = [subprocess.Popen([sys.executable, script, *rest, "--shard", f"{k}/{jobs}", "--summary", str(f)])
             for k, f in enumerate(files)]  # their output goes straight to ours, a line at a time
    passed = failed = 0
    for k, (proc, f) in enumerate(zip(procs, files)):
        proc.wait()
        summary = re.match(r"(\d+) passed, (\d+) failed", f.read_text()) if f.exists() else None
        if summary and proc.returncode in (0, 1):
            passed, failed = passed + int(summary.group(1)), failed + int(summary.group(2))
        else:
            failed += 1
            _line(f"FAIL  shard {k}/{jobs}: exit status {proc.returncode}, no summary")
    tmp.cleanup()
    _line(f"{passed} passed, {failed} failed, {time.perf_counter() - start:.1f} s, {jobs} processes")
    return 1 if failed or not passed else 0
