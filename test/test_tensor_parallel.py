"""Tensor-parallel ranks decide alike: each rank's adaptive planner decides from step times
its own GPU measured, and ranks that decided apart (a round on one, a plain step on another)
would run different forwards and hang in their all-reduces. Every rank's planner takes the
first rank's times (``spec.ranks.first_rank_values``, a broadcast over the TP group's CPU
group). Checked here with two real gloo processes; a tensor-parallel engine needs several
GPUs, which no machine of this project has."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from sgl_vericache.config import VeriCacheConfig
from sgl_vericache.spec.round import Speculator
from sgl_vericache.spec.stats import Stats

SCRIPT = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from sgl_vericache.spec.ranks import first_rank_values

    def rank(r, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=r)
        group = SimpleNamespace(world_size=2, first_rank=0, cpu_group=dist.group.WORLD)
        mine = (0.25 + r, 3.0 * (r + 1), 1e-3)  # what this rank measured
        got = first_rank_values(mine, group)
        assert got == (0.25, 3.0, 1e-3), (r, got)
        alone = SimpleNamespace(world_size=1, first_rank=r, cpu_group=None)
        assert first_rank_values(mine, alone) == mine and first_rank_values(mine, None) == mine
        dist.destroy_process_group()
        os.write(1, f"rank {r} ok\\n".encode())  # one write: the two ranks' lines do not interleave

    if __name__ == "__main__":
        mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2)
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_rank_gets_the_first_ranks_step_times(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), str(_free_port())], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout


class _Seam:
    """The round's seam where every other rank measured other times: ``agree`` answers the
    first rank's."""

    num_layers, device, windows = 2, "cpu", {}

    def __init__(self, first_rank):
        self.first_rank, self.asked = first_rank, []

    def agree(self, seconds):
        self.asked.append(tuple(seconds))
        return self.first_rank[len(seconds)]

    def abort(self, req, message, status=400):
        raise AssertionError(message)


class _Planner:
    def __init__(self):
        self.plain, self.rounds = [], []

    def plain_done(self, seconds):
        self.plain.append(seconds)

    def round_done(self, reqs, lens, accept_lens, forward_seconds, seconds, setup_seconds=0.0):
        self.rounds.append((forward_seconds, seconds, setup_seconds))


def test_the_planner_learns_the_agreed_step_times_not_its_own():
    seam = _Seam({1: (0.5,), 3: (0.1, 0.7, 0.05)})
    spec = Speculator(VeriCacheConfig(), seam, Stats(False), torch.Generator().manual_seed(0))
    spec.planner = planner = _Planner()
    spec.end_plain(0.031, 0.0)
    spec.forward_seconds, spec.setup_seconds, spec.lens = 0.02, 0.004, [3]
    spec.count_round([], [2], set(), 0.09, 0.0)
    assert seam.asked == [(0.031,), (0.02, 0.09, 0.004)]  # what this rank measured, offered
    assert planner.plain == [0.5] and planner.rounds == [(0.1, 0.7, 0.05)]  # what it learned: the first rank's
    spec.count_round([], None, set(), 0.08, 0.0)  # a forward that was no round: nothing to agree on
    assert len(seam.asked) == 2 and len(planner.rounds) == 1


class _Group:
    """A tensor-parallel group of ``world_size`` ranks seen from one of them: a broadcast
    brings the first rank's tensor (here: 7s) into the caller's, in place."""

    def __init__(self, world_size):
        self.world_size, self.broadcasts = world_size, 0

    def broadcast(self, t, src=0):
        assert src == 0
        self.broadcasts += 1
        return t.fill_(7)


def test_a_sampled_verify_takes_the_first_ranks_acceptance(monkeypatch):
    """As SGLang's own sampled verify: every rank takes the first rank's accepted tokens and
    lengths, so ranks that drew apart cannot diverge (one rank a token more: a hang)."""
    from types import SimpleNamespace

    from sglang.srt.distributed import parallel_state

    from sgl_vericache.sglang.sampling import sampled_verify

    bs, n = 2, 3
    sampled = SimpleNamespace(accept=lambda c, logits, p, skip: (torch.tensor([1, 0]), torch.arange(bs * n).view(bs, n)))
    info = SimpleNamespace(acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None)
    args = (sampled, (), SimpleNamespace(draft_token_num=n, draft_token=torch.zeros(bs * n), positions=torch.zeros(bs * n)),
            SimpleNamespace(reqs=[None] * bs, sampling_info=info),
            SimpleNamespace(next_token_logits=torch.zeros(bs * n, 5)), None)
    for world_size in (1, 2):
        group = _Group(world_size)
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
        predict, accept_lens, accept_index = sampled_verify(*args)
        if world_size == 1:  # this rank's own: row 0 accepted a draft, row 1 none
            assert group.broadcasts == 0 and accept_lens.tolist() == [2, 1]
            assert accept_index.tolist() == [[0, 1, -1], [3, -1, -1]]
        else:
            assert group.broadcasts == 3
            assert all(bool((t == 7).all()) for t in (predict, accept_lens, accept_index))
