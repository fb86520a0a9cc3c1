"""Rank agreement for tensor parallelism, over a gloo group so it never touches the NCCL stream.

Every rank of a tensor-parallel model calls the same kernels with the same keys in the same order, so
the tuner can use collectives at the points where a kernel in the active phase decides whether to tune.
"""

from typing import Any, List, Optional

import torch.distributed as dist

_group: Any = None
_group_for: Optional[int] = None  # id of the default group the gloo group was made for


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gloo_group():
    """A gloo group over all ranks: WORLD when it already is gloo, else one made on first use.

    ``new_group`` is collective; every rank reaches the first agreement point together because they run
    the same forward.
    """
    global _group, _group_for
    default = dist.group.WORLD
    if _group_for != id(default):
        _group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        _group_for = id(default)
    return _group


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order (just ``[obj]`` without torch.distributed)."""
    if world() == 1:
        return [obj]
    out: List[Any] = [None] * world()
    dist.all_gather_object(out, obj, group=_gloo_group())
    return out
