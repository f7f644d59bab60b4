"""What restores each 16-bit parameter's fp32 value on this rank (:class:`Master`), and the cast
that makes the parameters 16-bit (:func:`cast_parameters_`).

A :class:`Master` is one of: the parameter itself (fp32: an island of the policy), a bf16
weight plus its int16 remainder (exact, :mod:`distamp.optim.bits`), an fp32 copy (fp16 weights,
or ``master="sharded"`` on the owning rank), nothing (stochastic rounding), a bf16 compensation
(Kahan), or another rank's (sharded). The optimizer (:mod:`distamp.optim.master`) asks it for
the fp32 value, steps that, and hands the result back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from distamp.optim.bits import (
    join_remainder,
    round_nearest_bf16,
    round_nearest_bf16_,
    round_stochastic_,
    split_remainder,
    split_remainder_,
)
from distamp.optim.config import WeightPrecision
from distamp.optim.draws import Draws

__all__ = ["Master", "cast_parameters_", "local_tensor", "make_master", "shaped_like"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (FSDP2, TP), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def cast_parameters_(
    params: Iterable[nn.Parameter], dtype: torch.dtype
) -> dict[nn.Parameter, torch.Tensor]:
    """Turn fp32 ``params`` into ``dtype`` in place (same ``Parameter`` objects, so optimizers
    and modules that hold them still do) and return what restores each exact master: the int16
    remainder for bf16, the fp32 value itself for fp16. Parameters that are not fp32 are left
    alone and get no entry."""
    low: dict[nn.Parameter, torch.Tensor] = {}
    for p in params:
        if p.dtype != torch.float32:
            continue
        with torch.no_grad():
            if dtype == torch.bfloat16:
                weight, low[p] = split_remainder(p.detach())
            else:
                low[p] = p.detach().clone()
                weight = low[p].to(dtype)
        p.data = weight
    return low


@dataclass
class Master:
    """What restores one parameter's fp32 value on this rank.

    ``kind``: "fp32" (an fp32 parameter, its own master: an island of the policy), "remainder"
    (bf16 weight + int16 remainder, exact), "copy" (an fp32 copy: fp16 weights, or sharded),
    "stochastic" (none), "kahan" (a bf16 compensation), "remote" (another rank owns it).
    """

    param: nn.Parameter
    kind: str
    low: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return local_tensor(self.param.detach())

    @property
    def rebuilds(self) -> bool:
        """Whether :meth:`fp32` builds a new value (rather than returning a tensor of its own
        that the step updates in place): it then takes a buffer to build it in."""
        return self.kind in ("remainder", "kahan", "stochastic")

    @property
    def needs_work(self) -> bool:
        """Whether :meth:`store_` wants a ``work`` buffer (its rounding cannot overwrite the
        master: a copy that lives on, a random draw, a Kahan compensation still to take)."""
        if self.kind == "copy":
            return self.weight.dtype == torch.bfloat16
        return self.kind in ("stochastic", "kahan")

    def fp32(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 master: the parameter or the copy itself (updated in place), or a value
        rebuilt from the weight, in ``out`` (fp32, contiguous, the weight's size: the step's
        reused buffer) or a new tensor."""
        w = self.weight
        if self.kind == "fp32":
            return w
        if self.kind == "copy":
            assert self.low is not None
            return self.low
        if self.kind == "remainder":
            assert self.low is not None
            return join_remainder(w, self.low, out)
        if out is None:
            out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        out = out.view(w.shape).copy_(w)  # exact: every bf16 is an fp32
        if self.kind == "kahan":
            assert self.low is not None
            out.add_(self.low)  # in fp32, as w.float() + low.float()
        return out

    def store_(
        self,
        master: torch.Tensor,
        generator: Draws | None,
        work: torch.Tensor | None = None,
        *,
        spent: bool = False,
    ) -> None:
        """Write the updated fp32 ``master`` back as weight (and remainder or compensation).

        ``work``: a 4-byte buffer of the weight's size the store may overwrite (``None``: one
        is allocated where needed); ``spent``: ``master`` is a temporary (:meth:`fp32`'s
        ``out``) the store may overwrite too, which spares the remainder's and the Kahan
        store a pass. The bits are the same either way."""
        w = self.weight
        if self.kind == "fp32":
            return  # stepped in place
        if self.kind == "remainder":
            assert self.low is not None
            split_remainder_(master, w, self.low, master if spent else work)
        elif self.kind == "copy":
            # The copy was stepped in place; the weight is its rounding, a bf16 one rounded as
            # an exact master's is (ties away from zero), so a sharded run's weights are the
            # exact run's bit for bit.
            if w.dtype == torch.bfloat16:
                round_nearest_bf16_(master, w, work)
            else:
                w.copy_(master)
        elif self.kind == "stochastic":
            round_stochastic_(master, w, generator, work)
        elif self.kind == "kahan":
            assert self.low is not None
            round_nearest_bf16_(master, w, work)
            # What the rounding lost, in fp32 (exact: w is within a bf16 step of master)
            self.low.copy_(master.sub_(w) if spent else master - w.float())

    def load_(self, master: torch.Tensor) -> None:
        """Take ``master`` (fp32, this rank's shape) as the exact truth."""
        master = master.contiguous()
        w = self.weight
        if self.kind == "fp32":
            w.copy_(master)
        elif self.kind == "copy":
            assert self.low is not None
            self.low.copy_(master)
            w.copy_(_rounded(master, w.dtype))
        elif self.kind in ("remainder", "kahan"):
            self.store_(master, None)
        elif self.kind == "stochastic":
            w.copy_(round_nearest_bf16(master))


def _rounded(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight of an fp32 ``master``: bf16 as :func:`split_remainder` rounds (ties away
    from zero), other dtypes by torch's cast."""
    return round_nearest_bf16(master) if dtype == torch.bfloat16 else master.to(dtype)


def make_master(
    p: nn.Parameter, precision: WeightPrecision, low: torch.Tensor | None, owned: bool
) -> Master:
    """The :class:`Master` of ``p`` under ``precision``: ``low`` is what
    :func:`cast_parameters_` kept for it (cut to ``p``'s local shard), taken over, not copied
    (the cast's own copy: an fp16 setup holds one fp32 copy, not two); ``owned``: whether this
    rank holds the master (``master="sharded"``).

    Raises:
        ValueError: ``p`` is neither fp32 nor the weight dtype, or its ``low`` is missing.
    """
    w = local_tensor(p.detach())
    if w.dtype == torch.float32:
        return Master(p, "fp32" if owned else "remote")
    if w.dtype != precision.torch_dtype:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} is {w.dtype}, but the weight precision is "
            f"{precision.dtype}: cast the model with the same precision (master_weights does)"
        )
    if not owned:
        return Master(p, "remote")
    exact = low if low is None else local_tensor(low)
    if precision.master == "stochastic":
        return Master(p, "stochastic")
    if precision.master == "kahan":
        return Master(p, "kahan", torch.zeros_like(w))
    if precision.master == "sharded" or w.dtype == torch.float16:
        if exact is None:
            raise ValueError(
                "an fp16 or sharded master needs the fp32 values cast_parameters_ kept"
            )
        if exact.dtype == torch.int16:  # a bf16 weight's remainder: the copy is the joined value
            exact = join_remainder(w, exact)
        return Master(p, "copy", exact.detach())
    if exact is None or exact.dtype != torch.int16:
        raise ValueError("an exact bf16 master needs the remainder cast_parameters_ returned")
    return Master(p, "remainder", exact.detach())


def shaped_like(value: Any, p: nn.Parameter) -> Any:
    """A state tensor of a DTensor parameter (FSDP2, TP) as a DTensor placed like it, as
    torch's optimizers keep theirs, so that DCP saves and reshards each rank's part; anything
    else as it is."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    placements = cast(Any, p).placements
    return DTensor.from_local(value, mesh, placements, shape=p.shape, stride=p.stride())
