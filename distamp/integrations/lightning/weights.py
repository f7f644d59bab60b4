"""16-bit weights with an exact master under the Lightning Trainer:
``DistAMPTrainerPrecision("bf16-true")``, ``("16-true")``, or ``weights=WeightPrecision(...)``.

Lightning's own ``"bf16-true"``/``"16-true"`` (``HalfPrecision``) cast the model and keep no
master, so every update smaller than half a 16-bit step of its weight is lost without a word.
Here the same spellings mean :class:`~distamp.WeightPrecision`: 16-bit parameters and
gradients, and beside each weight what restores its fp32 master bit for bit, stepped by
:class:`~distamp.MasterWeightOptimizer` around the user's optimizer. The work follows the order
of Lightning's strategies (``Strategy.setup`` and ``DDPStrategy.setup``, checked on Lightning
2.6):

1. ``convert_module`` sees the bare LightningModule before the strategy moves it to its device
   and wraps it: :meth:`TrainerWeights.check` refuses what is not covered (nothing changed
   yet), then :meth:`TrainerWeights.cast` casts the trainable parameters in place (the same
   ``Parameter`` objects, so DDP's buckets and the optimizers ``configure_optimizers`` builds
   later hold 16-bit tensors), leaves the policy's fp32 modules fp32, and keeps the low bits
   by parameter;
2. ``connect`` comes after DDP wrapped the model (and made every rank's weights rank 0's) and
   after ``configure_optimizers``: :meth:`TrainerWeights.wrap` moves the low bits to their
   weights' device, makes them rank 0's as well (one broadcast), and wraps each optimizer;
   the Trainer then steps, checkpoints and restores the wrapped ones. Schedulers keep working:
   the wrapper shares its optimizer's ``param_groups``;
3. ``on_save_checkpoint``: :meth:`TrainerWeights.masters_into` writes each master in the
   model's own entry of the checkpoint, where an fp32 run keeps its weights.

On resume (DDP, one device) Lightning loads the model's entries into the fp32 module before
``setup`` (so the cast starts from the masters), and the optimizers' states after ``connect``
(their ``"master"`` entries set weights and masters again, whatever the module held).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402

from distamp.integrations.lightning.hooks import strategy_of  # noqa: E402
from distamp.optim import MasterWeightOptimizer, WeightPrecision, island_parameters  # noqa: E402
from distamp.optim.bits import join_remainder  # noqa: E402
from distamp.optim.config import WEIGHT_DTYPES  # noqa: E402
from distamp.optim.rules import rule_for  # noqa: E402
from distamp.optim.sharding import broadcast_bytes_  # noqa: E402
from distamp.optim.store import cast_parameters_  # noqa: E402
from distamp.precision.policy import Precision as ParsedPrecision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = ["GatheringMasterOptimizer", "TrainerWeights", "check_weights"]


def check_weights(
    owner: str,
    precision: str,
    parsed: ParsedPrecision,
    weights: Any,
    scaler: DistributedGradScaler | None,
    *,
    unscale: str,
    spike_guard: Any,
) -> WeightPrecision | None:
    """The weight precision a Trainer plug-in's arguments ask for, checked before anything is
    built: ``WeightPrecision(dtype)`` (exact master, fp32 states) for ``"bf16-true"`` and
    ``"16-true"``, the given one for any spelling, ``None`` for fp32 weights.

    Raises:
        TypeError: ``weights`` is neither ``None`` nor a :class:`~distamp.WeightPrecision`.
        ValueError: a dtype other than the precision's, an fp16 scaler that does not scale,
            ``unscale="before_hooks"`` or a spike guard with fp16 weights (their gradients are
            never unscaled in fp16).
    """
    given = f"{owner}(precision={precision!r}, weights={weights!r})"
    if weights is None:
        if not precision.endswith("-true"):
            return None
        weights = WeightPrecision("bf16" if precision.startswith("bf16") else "fp16")
    elif not isinstance(weights, WeightPrecision):
        raise TypeError(
            f"{given}: pass a distamp.WeightPrecision(dtype=..., master=..., states=...), or "
            "None (fp32 weights with '-mixed', an exact master with '-true')"
        )
    if weights.torch_dtype != parsed.compute_dtype:
        dtype = next(k for k, v in WEIGHT_DTYPES.items() if v == parsed.compute_dtype)
        kind = precision[precision.index("-") :]  # "-true" or "-mixed", as given
        other = ("bf16" if weights.torch_dtype == torch.bfloat16 else "16") + kind
        raise ValueError(
            f"{given}: the weights are the compute dtype; pass WeightPrecision({dtype!r}, ...) "
            f"or precision={other!r}"
        )
    if weights.needs_scaler:
        if scaler is not None and (not scaler.is_enabled() or scaler.check_only):
            raise ValueError(
                f"{given}: fp16 weights train under loss scaling, and this scaler does not "
                "scale (disabled or check_only); pass an enabled DistributedGradScaler or "
                "scaler=None"
            )
        if unscale == "before_hooks":
            raise ValueError(
                f"{owner}(precision={precision!r}, unscale='before_hooks'): fp16 gradients are "
                "never unscaled in fp16 (small ones would flush to zero); the step divides them "
                "in fp32, so hooks see them scaled. Use unscale='auto' or 'at_clip', or bf16"
            )
        if spike_guard is not None:
            raise ValueError(
                f"{owner}(precision={precision!r}, spike_guard=...): a spike skip unscales the "
                "gradients, which fp16 weights' gradients refuse; not covered yet. Use "
                "precision='bf16-true', or drop spike_guard"
            )
    return weights


class TrainerWeights:
    """One Trainer plug-in's 16-bit weights: the low bits that restore each master, kept by
    parameter from the cast to the optimizers' wrapping (and across ``fit`` calls on the same
    module), and the wrapped optimizers.

    Args:
        precision: the :class:`~distamp.WeightPrecision`.
        owner: the plug-in's class name, for the messages.
    """

    def __init__(self, precision: WeightPrecision, owner: str) -> None:
        self.precision = precision
        self.owner = owner
        self.module: nn.Module | None = None
        """The module cast last (its parameters are the keys of :attr:`low`)."""
        self.low: dict[nn.Parameter, torch.Tensor] = {}
        """Each cast parameter's low bits (int16 remainder for bf16, fp32 value for fp16)."""
        self.optimizers: list[MasterWeightOptimizer] = []
        """The optimizers :meth:`wrap` returned last, in the Trainer's order."""

    # ------------------------------------------------------------------ convert_module
    def check(self, module: nn.Module, policy: Any) -> None:
        """Refuse, before anything changes, what the weights do not cover: a strategy other
        than one device or DDP, ``master="sharded"`` off DDP, and 16-bit parameters whose
        masters are gone.

        Raises:
            ValueError: naming the way out.
        """
        strategy = strategy_of(module)
        name = type(strategy).__name__
        ddp = isinstance(strategy, DDPStrategy)
        if strategy is not None and not (ddp or isinstance(strategy, SingleDeviceStrategy)):
            raise ValueError(
                f"{self.owner} with 16-bit weights ({self.precision.short()}) under {name}: "
                "not covered yet (sharded parameters keep their masters per shard); use "
                "strategy='ddp' or one device, or precision='bf16-mixed'/'16-mixed' without "
                "weights"
            )
        if self.precision.master == "sharded" and not ddp:
            raise ValueError(
                f"{self.owner}(weights=WeightPrecision(master='sharded')) under "
                f"{name if strategy is not None else 'no Trainer'}: the masters are sharded "
                "over DDP's ranks; use strategy='ddp', or master='exact' on one device"
            )
        known = self.low if module is self.module else {}
        keep = island_parameters(module, policy)
        lost = [
            n
            for n, p in module.named_parameters()
            if p.requires_grad and id(p) not in keep and p.dtype != torch.float32 and p not in known
        ]
        if lost:
            raise ValueError(
                f"{self.owner}: {len(lost)} parameters are 16-bit already "
                f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}) with no master "
                "this plug-in kept: the masters are made from fp32 weights; build or load the "
                "model in fp32 (not after .half() or Lightning's own 'bf16-true'), or fit a "
                "module trained with 16-bit weights again with the same plug-in, which keeps "
                "its masters"
            )

    def cast(self, module: nn.Module, policy: Any) -> None:
        """Cast ``module``'s trainable fp32 parameters (not the policy's fp32 modules) to the
        weight dtype in place and keep their low bits. Parameters cast by an earlier ``fit``
        keep theirs (their masters went on being stepped in place)."""
        if module is not self.module:
            self.module, self.low, self.optimizers = module, {}, []
        keep = island_parameters(module, policy)
        todo = [
            p
            for p in module.parameters()
            if p.requires_grad and id(p) not in keep and p.dtype == torch.float32
        ]
        self.low.update(cast_parameters_(todo, self.precision.torch_dtype))

    # ------------------------------------------------------------------ connect
    def wrap(self, model: nn.Module, optimizers: list[Optimizer]) -> list[Optimizer]:
        """Each optimizer wrapped in a :class:`~distamp.MasterWeightOptimizer` over the low
        bits of its parameters, on their weights' device; under DDP rank 0's (collective: one
        broadcast; DDP made the weights rank 0's, the masters follow).

        Raises:
            ValueError: an optimizer the weights cannot drive (named), one that stepped, one
                wrapped already, or one holding 16-bit parameters with no master; the weights
                are then fp32 again, the masters' values (rank 0's under DDP).
        """
        for p, bits in self.low.items():  # cast before the strategy moved the module
            if bits.device != p.device:
                self.low[p] = bits.to(p.device)
        group = model.process_group if isinstance(model, DistributedDataParallel) else None
        if isinstance(model, DistributedDataParallel) and dist.get_world_size(group) > 1:
            assert self.module is not None
            order = [self.low[p] for p in self.module.parameters() if p in self.low]
            broadcast_bytes_(order, src=_global_rank(group, 0), group=group)
        ours = {id(opt) for opt in self.optimizers}  # a validate/test after fit hands them back
        try:
            for opt in optimizers:
                if id(opt) not in ours:
                    self._check_optimizer(opt)
        except ValueError:
            self._uncast()
            raise
        sharded = self.precision.master == "sharded" and group is not None
        cls = GatheringMasterOptimizer if sharded else MasterWeightOptimizer
        self.optimizers = [
            opt
            if isinstance(opt, MasterWeightOptimizer)
            else cls(
                opt,
                self.precision,
                {p: self.low[p] for g in opt.param_groups for p in g["params"] if p in self.low},
                process_group=group,
            )
            for opt in optimizers
        ]
        return list(self.optimizers)

    def _check_optimizer(self, opt: Optimizer) -> None:
        if isinstance(opt, MasterWeightOptimizer):
            raise ValueError(
                f"{self.owner}: configure_optimizers returned a MasterWeightOptimizer; with "
                "16-bit weights the plug-in wraps the optimizer itself: return the plain "
                "AdamW/Adam/SGD over self.parameters()"
            )
        rule_for(opt)  # names an optimizer it cannot drive
        if any(opt.state.values()):
            raise ValueError(
                f"{self.owner}: {type(opt).__name__} has stepped already; with 16-bit weights "
                "configure_optimizers must return a fresh optimizer"
            )
        orphans = [
            p
            for g in opt.param_groups
            for p in g["params"]
            if p.dtype != torch.float32 and p not in self.low
        ]
        if orphans:
            raise ValueError(
                f"{self.owner}: {type(opt).__name__} holds {len(orphans)} "
                f"{orphans[0].dtype} parameters that were not cast in convert_module (no "
                "master); keep the model fp32 until the Trainer sets it up"
            )

    def _uncast(self) -> None:
        """The weights back to fp32 from the low bits (a refused ``connect``)."""
        for p, bits in self.low.items():
            with torch.no_grad():
                p.data = join_remainder(p.detach(), bits) if bits.dtype == torch.int16 else bits
        self.module, self.low, self.optimizers = None, {}, []

    def exact_weight(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s master for an island the policy's adaptive rules promote (see
        :meth:`~distamp.MasterWeightOptimizer.exact_weight`), from whichever optimizer holds
        it."""
        for opt in self.optimizers:
            found = opt.exact_weight(p)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ checkpoints
    def masters_into(self, checkpoint: dict[str, Any]) -> None:
        """Put each 16-bit parameter's fp32 master (the optimizers' saved ``"master"``) in its
        model entries of the Trainer ``checkpoint`` (in place): the checkpoint's weights are
        the masters, as an fp32 run's are, for ``load_from_checkpoint``, a resumed run and an
        export alike. The same tensors as the optimizer's entries: ``torch.save`` writes each
        storage once."""
        states, entries = checkpoint.get("optimizer_states"), checkpoint.get("state_dict")
        if self.module is None or not isinstance(states, list) or not isinstance(entries, dict):
            return
        if len(states) != len(self.optimizers):
            return  # not the optimizers this plug-in wrapped: nothing to pair
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        for opt, saved in zip(self.optimizers, states, strict=True):
            state = saved.get("state") if isinstance(saved, Mapping) else None
            if not isinstance(state, Mapping):
                continue  # a rank that does not write (sharded masters: rank 0 holds them all)
            params = [p for g in opt.param_groups for p in g["params"]]
            for index, p in enumerate(params):
                entry = state.get(index)
                master = entry.get("master") if isinstance(entry, Mapping) else None
                for name in names.get(id(p), ()) if master is not None else ():
                    if name in entries:
                        entries[name] = master


class GatheringMasterOptimizer(MasterWeightOptimizer):
    """A :class:`~distamp.MasterWeightOptimizer` with ``master="sharded"`` over DDP's ranks
    that speaks the protocol of Lightning's ``Strategy.optimizer_state``, as torch's
    ``ZeroRedundancyOptimizer`` does: the Trainer calls :meth:`consolidate_state_dict` on every
    rank, then ``state_dict()`` on rank 0 only, and rank 0 alone writes the checkpoint. Without
    it the checkpoint would hold rank 0's share of the masters and moments; with it, all of
    them, and each rank loads its own share back (``load_state_dict`` skips the others').
    """

    consolidated: dict[str, Any] | None = None
    """Every rank's state, gathered by :meth:`consolidate_state_dict` (on its ``to`` rank),
    handed out by the next :meth:`state_dict`."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's share of the state (on the CPU) on rank ``to`` of
        the data-parallel group, for its next :meth:`state_dict`."""
        mine = super().state_dict()
        share = {
            index: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for index, entry in mine["state"].items()
        }
        group = self.gather.group if self.gather is not None else None
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered: list[Any] | None = [None] * world if rank == to else None
        dist.gather_object(share, gathered, dst=_global_rank(group, to), group=group)
        if gathered is not None:
            state: dict[int, Any] = {}
            for part in gathered:
                state.update(part)
            self.consolidated = {
                "state": dict(sorted(state.items())),
                "param_groups": mine["param_groups"],
            }

    @override
    def state_dict(self) -> dict[str, Any]:
        """Every rank's state after :meth:`consolidate_state_dict` on this rank (once), else
        this rank's share (:meth:`~distamp.MasterWeightOptimizer.state_dict`)."""
        if self.consolidated is not None:
            out, self.consolidated = self.consolidated, None
            return out
        return super().state_dict()


def _global_rank(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (``None``: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)
