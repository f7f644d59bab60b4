"""FP8 on parallel layouts: float8 weight scales over the ranks that shard each weight, and
float8 tensor-parallel styles.

**Weight scales.** With FSDP2's float8 all-gather (tensorwise recipe) every rank casts its shard
of a weight to float8 *before* the all-gather, so all shards of one weight must use ONE scale:
``float8_max / amax(whole weight)``. torchao's ``precompute_float8_dynamic_scale_for_fsdp``
computes them through DTensor ops, which needs every float8 weight on one mesh; on a tensor
parallel job (FSDP2 over ``dp`` for some layers, over ``(dp, tp)`` for the TP-sharded ones) it
raises, and on a pipeline job each stage holds its own weights. :class:`WeightScales` computes
them for any layout in ONE all-reduce: each weight is keyed by the ranks of its mesh and its
name, every rank contributes its shard's amax at its key's slot (0 elsewhere), and a MAX over
the agreement group yields, at each slot, the amax over exactly the ranks holding that weight.
The slots are agreed once, at setup, at a cost that does not grow with the world size: each key
is a 62-bit digest (of its name and its mesh's ranks) placed in a hash table whose size all
ranks derive from the same numbers; one MAX all-reduce of the table (the digests and their
negations) shows every rank which slots are taken and whether two keys collided (then the
table doubles and the exchange repeats). An ``all_gather_object`` of the keys would move
``world x keys x mesh size`` items through pickle (16384 ranks: memory exhausted).
Replicas (HSDP's replicate dimension, a TP-replicated weight) contribute the same value, so the
result is the whole weight's amax; the arithmetic is torchao's, so scales are bitwise the ones
its precompute gives where that one works.

**Tensor parallel styles.** :func:`fp8_tp_plan` turns a ``parallelize_module`` plan's
``ColwiseParallel``/``RowwiseParallel`` into torchao's float8 styles for the layers that run in
float8 (tensorwise recipe): their input activations are cast to float8 before the sequence
parallel all-gather (half of bf16's bytes) and their output gradients in the backward.

Convert first (:func:`distamp.precision.fp8.convert_for_fp8`), then ``parallelize_module`` with the
fp8
plan, then ``fully_shard``/pipeline stages, then hand the model to ``DistAMP(precision="fp8",
mesh=...)``, which calls :meth:`WeightScales.update` after every optimizer step.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.reduction import ExternalGroup, FlagReducer
from distamp.agreement.topology import agreement_group
from distamp.model_names import named_model_modules
from distamp.precision.fp8_torchao import require_torchao
from distamp.torch_compat import (
    dtensor_local,
    float8_plain_weight,
    foreach_norm,
    set_float8_scale,
)

__all__ = ["WeightScales", "fp8_tp_plan", "gathers_in_float8", "is_float8_linear"]


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear``, also once ``fully_shard`` swapped its
    class for a subclass. By class name, so that callers need not import torchao to ask."""
    return isinstance(module, nn.Linear) and any(
        cls.__name__ == "Float8Linear" for cls in type(module).__mro__
    )


def gathers_in_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` whose weight FSDP2 all-gathers in
    float8 (a DTensor over torchao's ``WeightWithDynamicFloat8CastTensor``)."""
    if not is_float8_linear(module):
        return False
    return _TorchaoShard(getattr(module, "weight", None)).is_float8


class _TorchaoShard:
    """This rank's part of a weight that FSDP2 gathers in float8: torchao's
    ``WeightWithDynamicFloat8CastTensor`` inside the weight's DTensor.

    DTensor's and torchao's private names are read through :mod:`distamp.torch_compat`.
    FSDP2's pre-all-gather cast reads the scale precomputed on that very object (torchao's own
    ``precompute_float8_dynamic_scale_for_fsdp`` sets it the same way, and there is no public
    setter), and ``DTensor.to_local()`` cannot reach the object: for a Parameter it returns a
    fresh view, on which the scale would be lost.
    """

    def __init__(self, weight: Any) -> None:
        self.tensor: Any = dtensor_local(weight)  # None: not a DTensor

    @property
    def is_float8(self) -> bool:
        return type(self.tensor).__name__ == "WeightWithDynamicFloat8CastTensor"

    def plain(self) -> torch.Tensor:
        """The high-precision tensor the wrapper forwards every op to: one plain foreach
        kernel over these instead of a subclass dispatch per weight."""
        return float8_plain_weight(self.tensor)

    def set_scale(self, scale: torch.Tensor) -> None:
        """The scale FSDP2's next pre-all-gather cast uses for this weight."""
        set_float8_scale(self.tensor, scale)


def _mesh_digest(mesh: Any, cache: dict[int, bytes]) -> bytes:
    """The ranks of ``mesh`` (and its shape), hashed: equal on every rank of the mesh, in one
    pass over the rank tensor's bytes (no Python loop over ranks)."""
    found = cache.get(id(mesh))
    if found is None:
        grid = mesh.mesh.to(torch.int64).contiguous()
        digest = hashlib.blake2b(repr(tuple(grid.shape)).encode(), digest_size=16)
        digest.update(grid.numpy().tobytes())
        found = cache[id(mesh)] = digest.digest()
    return found


def _key(mesh_digest: bytes, name: str) -> int:
    """A weight's key: a 62-bit digest of its mesh and its name (non-negative in int64, and
    its negation stays above the empty-slot marker of :func:`agree_keys`)."""
    digest = hashlib.blake2b(mesh_digest + name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


_EMPTY = -(1 << 62)  # below every negated key: a slot no rank writes reduces to it


def agree_keys(
    keys: list[int], reducer: FlagReducer, device: torch.device, *, size: int | None = None
) -> list[int]:
    """Every distinct key (non-negative, below 2**62) of the group, in one order all ranks share
    (collective: every rank of ``reducer`` calls it).

    Keys go to slot ``key % size`` of a table every rank sizes alike (from the group's largest
    key count, itself agreed with one all-reduce). One MAX all-reduce of ``[keys, -keys,
    local collision]`` gives, per slot, the largest and smallest key written there; a slot
    whose two differ, or a rank that put two keys in one slot, is a collision, seen by every
    rank from the same numbers: the table doubles and the exchange repeats. Cost per rank:
    O(keys), whatever the world size.
    """
    groups = tuple(g for g in reducer.groups if not isinstance(g, ExternalGroup))
    # (a torchft quorum's replicas hold the same model, hence the same keys)

    def max_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        for group in groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.cpu()

    if size is None:  # ``size``: a power of two every rank passes alike (tests force collisions)
        most = int(max_reduce(torch.tensor([len(keys)], dtype=torch.int64)).item())
        size = 1 << max(3, (4 * most - 1).bit_length())
    while True:
        table = torch.full((2 * size + 1,), _EMPTY, dtype=torch.int64)
        table[:size] = -1
        slots = [k % size for k in keys]
        table[2 * size] = int(len(set(slots)) < len(set(keys)))
        if keys:
            index = torch.tensor(slots, dtype=torch.int64)
            values = torch.tensor(keys, dtype=torch.int64)
            table[index] = values
            table[index + size] = -values
        table = max_reduce(table)
        largest, smallest = table[:size], -table[size : 2 * size]
        taken = largest >= 0
        if not bool(table[2 * size]) and torch.equal(largest[taken], smallest[taken]):
            return [int(k) for k in largest[taken].tolist()]
        size *= 2


class WeightScales:
    """The float8 weight scales of FSDP2's float8 all-gather, for every layout, in one
    all-reduce per step (see the module docstring for why and how).

    Args:
        roots: the modules whose float8 weights to cover (a model, or the pipeline stages this
            rank holds); their ``named_modules`` names key the weights, so ranks holding the
            same weight must see it under the same name (as ``fully_shard`` and pipeline
            stages built from one model keep them).
        reducer: the ranks that reduce together (a scaler's agreement group; ``None``: the whole
            job). All of them must build a ``WeightScales`` and call :meth:`update` the same
            number of times; building one is a collective (the keys are exchanged once).
    """

    def __init__(self, roots: Iterable[nn.Module], reducer: FlagReducer | None = None) -> None:
        self.reducer = reducer if reducer is not None else agreement_group(None)
        self._layers: list[tuple[int, str, Any]] = []  # (key, name, Float8Linear)
        seen: set[int] = set()
        meshes: dict[int, bytes] = {}
        for root in roots:
            for name, module in named_model_modules(root):
                if id(module) not in seen and gathers_in_float8(module):
                    seen.add(id(module))
                    weight: Any = module.weight  # a DTensor (gathers_in_float8)
                    mesh = _mesh_digest(weight.device_mesh, meshes)
                    self._layers.append((_key(mesh, name), name, module))
        keys = sorted({key for key, _, _ in self._layers})
        cpu = torch.device("cpu")
        every = (
            agree_keys(keys, self.reducer, self.reducer.device_for(cpu))
            if not self.reducer.is_noop
            else keys
        )
        slot = {key: i for i, key in enumerate(every)}
        self._layers.sort(key=lambda layer: slot[layer[0]])  # so a full set needs no scatter
        self._slots = [slot[key] for key, _, _ in self._layers]
        self.size = len(slot)
        self.collectives = 0
        self._float8_max = _float8_max([m for _, _, m in self._layers])
        # Shapes never change: which shards are empty (they contribute 0) and where the rest go
        # is fixed, and so is the index of the scatter (None: a plain stack is already in order).
        shards = self._shards()
        self._nonempty = [i for i, s in enumerate(shards) if s.tensor.numel()]
        in_order = self._slots == list(range(self.size))
        self._index: torch.Tensor | None = None
        if not (in_order and len(self._nonempty) == self.size):
            device = shards[0].tensor.device if shards else self.reducer.device_for(cpu)
            self._index = torch.tensor([self._slots[i] for i in self._nonempty], device=device)

    @property
    def layers(self) -> list[str]:
        """Names of this rank's layers whose scales are precomputed (in reduction order)."""
        return [name for _, name, _ in self._layers]

    @torch.no_grad()
    def update(self) -> None:
        """Set every covered weight's float8 scale from its current amax: one all-reduce (none
        when no rank of the group gathers in float8). No host sync. Call after each optimizer
        step, skipped or not, and after loading weights."""
        if self.size == 0:
            return
        from torchao.float8.float8_utils import EPS

        local = self._shards()
        shards = [s.plain() for s in local]
        if self._index is None:  # this rank holds every key, in slot order, none empty
            amax = torch.stack(foreach_norm(shards, ord=float("inf"))).float()
        else:
            amax = torch.zeros(self.size, dtype=torch.float32, device=self._index.device)
            if self._nonempty:
                norms = foreach_norm([shards[i] for i in self._nonempty], ord=float("inf"))
                amax.index_copy_(0, self._index, torch.stack(norms).float())
        if not self.reducer.is_noop:
            self.reducer.all_reduce_max_(amax)
            self.collectives += len(self.reducer.groups)
        # torchao's arithmetic (clamp, then float64 division), so the scales are its own.
        scales = (self._float8_max / torch.clamp(amax, EPS).double()).float().unbind()
        for shard, i in zip(local, self._slots, strict=True):
            shard.set_scale(scales[i])  # read by FSDP2's pre-all-gather cast

    def _shards(self) -> list[_TorchaoShard]:
        return [_TorchaoShard(m.weight) for _, _, m in self._layers]


def _float8_max(modules: list[Any]) -> float:
    dtypes = {m.config.cast_config_weight.target_dtype for m in modules}
    if len(dtypes) > 1:
        raise ValueError(f"float8 weights of several float8 dtypes ({dtypes}) in one model")
    return float(torch.finfo(dtypes.pop() if dtypes else torch.float8_e4m3fn).max)


def fp8_tp_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """``plan`` (a ``parallelize_module`` plan) with torchao's float8 styles for the layers of
    ``model`` that run in float8: ``ColwiseParallel`` -> ``Float8ColwiseParallel``,
    ``RowwiseParallel`` -> ``Float8RowwiseParallel``, keeping their layouts.

    Only for the tensorwise recipe (torchao's float8 styles assume one scale per tensor);
    other styles, other layers and rowwise-recipe layers keep the plan's style, under which
    float8 layers still run (activations gathered in bf16). Call after
    :func:`distamp.precision.fp8.convert_for_fp8` and before ``parallelize_module``.

    Plan keys may be patterns, as ``parallelize_module`` takes them (``"blocks.*.mlp.w1"``); a
    pattern gets the float8 style when every module it matches runs in tensorwise float8.

    Raises:
        ValueError: a plan key matches no module of ``model``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    require_torchao()
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swap = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    # parallelize_module's own names (a plan is torch's: its keys spell any wrapper's parts)
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for key, style in plan.items():
        # parallelize_module's matching: fnmatch on each dotted atom ("blocks.*.fc").
        atoms = key.split(".")
        matched = [
            module
            for name, module in modules.items()
            if len(parts := name.split(".")) == len(atoms)
            and all(map(fnmatch.fnmatchcase, parts, atoms))
        ]
        if not matched:
            raise ValueError(f"fp8_tp_plan: {key!r} matches no module of the model")
        # A float8 style refuses a plain Linear: swap only when every match runs tensorwise fp8.
        new = swap.get(type(style)) if all(map(_tensorwise_float8, matched)) else None
        out[key] = (
            new(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
            if new is not None
            else style
        )
    return out


def _tensorwise_float8(module: nn.Module) -> bool:
    if not is_float8_linear(module):
        return False
    config: Any = module.config
    return bool(config.cast_config_weight.scaling_granularity.name == "TENSORWISE")
