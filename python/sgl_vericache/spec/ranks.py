"""Values every rank of a parallel group takes alike (no SGLang imports: the group is
SGLang's ``GroupCoordinator``, or anything with its ``world_size``, ``first_rank`` and
``cpu_group``)."""

from __future__ import annotations

import torch


def first_rank_values(values, group) -> tuple:
    """``values`` (floats) as the group's first rank has them, on every rank of ``group``
    (SGLang's ``GroupCoordinator``; None or one rank: as given). Tensor-parallel ranks run
    the same schedule, and the adaptive planner decides from step times each rank measures
    on its own GPU: ranks that decided apart (one a round, one a plain step) would run
    different forwards and hang in their all-reduces. Fed the same times, the planners
    decide alike. A broadcast of a few floats over the group's CPU (gloo) group, once an
    iteration."""
    values = tuple(float(v) for v in values)
    if group is None or group.world_size == 1:
        return values
    import torch.distributed as dist

    shared = torch.tensor(values, dtype=torch.float64)
    dist.broadcast(shared, src=group.first_rank, group=group.cpu_group)
    return tuple(shared.tolist())
