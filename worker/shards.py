"""A base model sharded over a trainer engine's ranks (torch's FSDP2), as its jobs' calls see it.

``ShardedBase`` owns the FSDP2 units of a base sharded by ``TrainerEngine.shard_base`` (one per
decoder layer, the decoder as the root) and what a full fine-tuning job's calls need of them: its
units resharded (no unit left holding gathered weights from another job's forward) and how a
pass's gradients are reduced over the ranks (summed where the ranks split a step's rows, averaged
where every rank ran them all). The functions move one parameter between its forms: this rank's
shard (``local``), the whole tensor on every rank (``gather``, one all-gather) and this rank's
shard of a whole tensor (``shard_of``, no communication: FSDP2's cut, ``torch.chunk`` along dim 0).

Invariants. A sharded parameter is a DTensor whose local tensor is FSDP2's own shard storage: a
copy into it is what the next all-gather reads. ``shard_of(gather(x))`` is ``x`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["ShardedBase", "as_shard", "gather", "is_shard", "local", "shard_of"]


def is_shard(param: torch.Tensor) -> bool:
    """Whether ``param`` is one of a sharded base's parameters (a DTensor), not a whole tensor."""
    return isinstance(param, DTensor)


def local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``: a sharded parameter's shard (its storage, not a copy), else ``param``."""
    return param.to_local() if isinstance(param, DTensor) else param


def as_shard(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``part``, this rank's shard, as a DTensor cut as the sharded parameter ``like`` is (no copy,
    no communication); ``like`` whole: ``part`` itself."""
    if not isinstance(like, DTensor):
        return part
    return DTensor.from_local(part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


def gather(part: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``part`` is this rank's shard, cut as the sharded parameter
    ``like`` is (every rank calls it: one all-gather); ``like`` whole: ``part`` itself."""
    whole = as_shard(part, like)
    return whole.full_tensor() if isinstance(whole, DTensor) else whole


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``whole``, cut as the sharded parameter ``like`` is; ``like`` whole: ``whole``."""
    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    pieces = torch.chunk(whole, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    if rank < len(pieces):
        return pieces[rank]
    return whole.new_empty((0, *whole.shape[1:]))


class ShardedBase:
    """The FSDP2 units of a sharded base (``modules``) over ``width`` ranks."""

    def __init__(self, modules: Sequence[Any], width: int) -> None:
        self.modules, self.width = list(modules), width
        for module in self.modules:  # sums and means by a plain SUM, which every backend has (gloo too)
            module.set_force_sum_reduction_for_comms(True)

    def reshard(self) -> None:
        """Every unit back to its shards: none keeps weights gathered in an earlier forward."""
        for module in self.modules:
            module.reshard()

    def reduce(self, summed: bool) -> None:
        """How the next backwards' gradients are reduce-scattered: summed over the ranks
        (``summed``: each ran its share of the rows) or averaged (each ran them all)."""
        for module in self.modules:
            module.set_gradient_divide_factor(1.0 if summed else float(self.width))
