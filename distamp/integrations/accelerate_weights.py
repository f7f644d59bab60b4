"""16-bit weights with an exact master through Accelerate's ``prepare`` (``weights=``).

:class:`WeightsAccelerator` is the ``accelerate.Accelerator`` that
:class:`~distamp.integrations.accelerate.DistAMPAccelerator` builds on. Given a
:class:`~distamp.WeightPrecision`, its ``prepare`` makes each model's trainable fp32 parameters
16-bit in place (:func:`~distamp.optim.cast_parameters_`: the same ``Parameter`` objects)
before Accelerate wraps the model in DDP, so DDP's buckets and all-reduce are 16-bit, and wraps
each optimizer in a :class:`~distamp.MasterWeightOptimizer` before Accelerate wraps it in its
``AcceleratedOptimizer``. The policy's fp32 modules keep fp32 weights.

Order, as Accelerate 1.15 and transformers 5.24 have it:

- ``Accelerator.prepare`` prepares its arguments one by one in the order given (models,
  optimizers and data loaders in one pass, then the schedulers). Here the models go first, so
  an optimizer passed before its model finds its parameters cast; the results keep the
  caller's order.
- The Hugging Face Trainer builds its optimizer before ``prepare(model, optimizer)``, or, when
  it delays the optimizer, after ``prepare(model)``, over the parameters already cast. So the
  low bits of every cast parameter (its remainder, or its fp32 value for fp16) are kept here,
  keyed by the parameter, until the optimizer that holds it is prepared.
- Checkpoints: ``Accelerator.load_state`` loads the models' weights, then the optimizers'
  states; the Trainer's resume loads the model's weights before ``prepare`` (into the fp32
  model, which is then cast) and the optimizer's state after it. Either way the optimizer's
  ``"master"`` entries come last and set each weight and its master bit for bit. A checkpoint
  whose optimizer state has no master for a 16-bit parameter (an fp32-weight run's) is refused
  by ``load_state`` before anything is loaded: its weights would be rounded into the 16-bit
  ones beside masters of the run before.

Under DDP the masters are made rank 0's (one broadcast of the low bits after wrapping), as DDP
makes the weights rank 0's.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, NoReturn

import torch
from torch import nn
from typing_extensions import override

from distamp.integrations import accelerate_optimizer

ACCELERATE_VERSION = accelerate_optimizer.ACCELERATE_VERSION  # importing it checked the version

from accelerate import Accelerator  # noqa: E402  (only after the version check)
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import OPTIMIZER_NAME, DDPCommunicationHookType, DistributedType  # noqa: E402

from distamp.cluster.agreement import agree_failures  # noqa: E402
from distamp.optim import MasterWeightOptimizer, WeightPrecision, island_parameters  # noqa: E402
from distamp.optim.rules import rule_for  # noqa: E402
from distamp.optim.sharding import broadcast_bytes_  # noqa: E402
from distamp.optim.store import cast_parameters_  # noqa: E402
from distamp.torch_compat import accelerate_prepared  # noqa: E402

__all__ = ["ACCELERATE_VERSION", "WeightsAccelerator", "check_weight_precision"]

# Who shards or casts the parameters itself: not covered with 16-bit weights yet.
_OWN_PARAMETERS = ("deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin")
_SHARDED_TYPES = (
    DistributedType.DEEPSPEED,
    DistributedType.FSDP,
    DistributedType.MEGATRON_LM,
    DistributedType.XLA,
)


def check_weight_precision(weights: Any, mode: Any, *, given: str) -> WeightPrecision | None:
    """``weights`` checked against the mixed precision ``mode`` (``"bf16"``, ``"fp16"``; an
    Accelerate ``PrecisionType`` too; ``None``: not known yet, the type only); ``given`` names
    where the mode came from, for the message. Changes nothing.

    Raises:
        TypeError: ``weights`` is neither a :class:`~distamp.WeightPrecision` nor ``None``.
        ValueError: a mode without 16-bit compute (``"no"``, ``"fp8"``), weights of another
            dtype than the mode's (the weights are the compute dtype), or ``master="sharded"``
            (each rank holds its share of the masters, and Accelerate's ``save_state`` and the
            Trainer's checkpoints write the main process's optimizer state only).
    """
    if weights is None:
        return None
    if not isinstance(weights, WeightPrecision):
        raise TypeError(
            f"weights={weights!r:.80}: pass a distamp.WeightPrecision(dtype=..., master=..., "
            "states=...) or None (fp32 weights)"
        )
    if weights.master == "sharded":
        raise ValueError(
            f"weights ({weights.short()}): each rank holds its share of the masters, and "
            "Accelerate's save_state and the Trainer's checkpoints write the optimizer state of "
            "the main process only; use master='exact' (or distamp.DistAMP(weights='sharded'))"
        )
    if mode is None:
        return weights
    mode = str(getattr(mode, "value", mode))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    own = "bf16" if weights.torch_dtype == torch.bfloat16 else "fp16"
    if mode not in dtypes:
        raise ValueError(
            f"weights ({weights.short()}) with {given}: 16-bit weights go with 'bf16' or 'fp16' "
            f"training; pass mixed_precision={own!r} (TrainingArguments: {own}=True), or drop "
            "weights"
        )
    if weights.torch_dtype != dtypes[mode]:
        raise ValueError(
            f"weights ({weights.short()}) with {given}: the weights are the compute dtype; pass "
            f"WeightPrecision({mode!r}, ...), or train in {own}"
        )
    return weights


def _refuse_distribution(weights: WeightPrecision, what: str) -> NoReturn:
    raise ValueError(
        f"weights ({weights.short()}) with {what}: it shards or casts the parameters itself, "
        "and 16-bit weights with a master are covered under DDP and on one process for now; "
        "drop weights (or train with distamp.DistAMP(strategy='fsdp2', weights=...))"
    )


class WeightsAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare`` keeps 16-bit weights with an exact master
    (see the module doc); without ``weights`` it is Accelerate's own.

    Prepare the fp32 model (weights loaded) and an optimizer that has not stepped, as usual:
    ``model, optimizer = accelerator.prepare(model, optimizer)``, or the model first and an
    optimizer built over its (now 16-bit) parameters afterwards. The prepared optimizer wraps a
    :class:`~distamp.MasterWeightOptimizer` (``optimizer.optimizer``): its ``state_dict()``
    holds each master, so ``save_state``/``load_state`` resume bit for bit. A policy's adaptive
    islands (a subclass's ``adaptive`` run) promote computes from the masters.

    Args:
        *args, **kwargs: passed to ``accelerate.Accelerator``.
        weights: a :class:`~distamp.WeightPrecision` whose dtype is ``mixed_precision``'s
            (``"bf16"``, or ``"fp16"`` with loss scaling); ``None`` (default): fp32 weights.

    Raises:
        ValueError: ``weights`` with ``mixed_precision`` ``"no"`` or ``"fp8"``, of another
            dtype, or with DeepSpeed, FSDP, Megatron-LM, XLA, tensor/context parallelism or a
            DDP comm hook (not covered yet); refused before Accelerate's state is built where
            the arguments say so. ``prepare`` refuses, before anything is cast or wrapped, a
            model whose trainable parameters are 16-bit already or sharded, an optimizer it
            cannot drive (see :func:`~distamp.optim.rules.rule_for`) or that has stepped, and
            an optimizer over parameters of no model prepared with it.
        TypeError: ``weights`` is no :class:`~distamp.WeightPrecision`.
    """

    weights: WeightPrecision | None = None
    """The weight precision (``None``: fp32 weights)."""
    policy: Any = None
    """An :class:`~distamp.AutocastPolicy` whose fp32 modules keep fp32 weights (a subclass's)."""

    def __init__(self, *args: Any, weights: WeightPrecision | None = None, **kwargs: Any) -> None:
        if weights is not None:  # refused before Accelerate's state exists where possible
            mode = kwargs.get("mixed_precision")
            check_weight_precision(weights, mode, given=f"mixed_precision={mode!r}")
            for name in _OWN_PARAMETERS:
                if kwargs.get(name) is not None:
                    _refuse_distribution(weights, f"{name}=")
        super().__init__(*args, **kwargs)
        mode = self.state.mixed_precision  # also when it came from Accelerate's config
        self.weights = check_weight_precision(weights, mode, given=f"mixed_precision={mode!r}")
        self._low: dict[nn.Parameter, torch.Tensor] = {}  # cast, waiting for their optimizer
        self._kept: set[nn.Parameter] = set()  # fp32 parameters of cast models (islands)
        self._cast: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        if self.weights is None:
            return
        if self.distributed_type in _SHARDED_TYPES:
            _refuse_distribution(self.weights, str(self.distributed_type))
        parallel = self.parallelism_config
        for dim in ("tp", "cp", "sp", "dp_shard"):
            if parallel is not None and getattr(parallel, f"{dim}_enabled", False):
                _refuse_distribution(self.weights, f"parallelism_config ({dim})")
        hook = getattr(self.ddp_handler, "comm_hook", DDPCommunicationHookType.NO)
        if hook != DDPCommunicationHookType.NO:
            raise ValueError(
                f"weights ({self.weights.short()}) with DistributedDataParallelKwargs(comm_hook="
                f"{hook}): the gradients are 16-bit already, and DDP sends them as they are; "
                "drop the comm hook"
            )
        self.register_load_state_pre_hook(self._check_masters)

    # ------------------------------------------------------------------ prepare
    @override
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``; with ``weights``, every model and optimizer given is
        checked first (a refusal leaves them all as they were), and the models are prepared
        before the rest (the results in the order given)."""
        if self.weights is None or (
            device_placement is not None and len(device_placement) != len(args)
        ):
            return super().prepare(*args, device_placement=device_placement)
        casting: set[nn.Parameter] = set()
        kept: set[nn.Parameter] = set()
        for obj in args:
            if isinstance(obj, nn.Module) and self._to_cast(obj):
                cast, keep = self._cast_plan(obj)
                casting.update(cast)
                kept.update(keep)
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and self._to_wrap(obj):
                self._check_optimizer(obj, casting, kept)
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], nn.Module))
        placed = None if device_placement is None else [device_placement[i] for i in order]
        result = super().prepare(*(args[i] for i in order), device_placement=placed)
        if len(args) == 1:
            return result
        out: list[Any] = [None] * len(args)
        for position, i in enumerate(order):
            out[i] = result[position]
        return tuple(out)

    @override
    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> Any:
        """Accelerate's ``prepare_model``; with ``weights`` (not for evaluation), the model's
        trainable fp32 parameters are cast before Accelerate places and wraps it, and after
        DDP made the weights rank 0's, the masters are made rank 0's too (one broadcast)."""
        weights = None if evaluation_mode or not self._to_cast(model) else self.weights
        cast = weights is not None
        if weights is not None:
            params, keep = self._cast_plan(model)
            self._low.update(cast_parameters_(params, weights.torch_dtype))
            self._kept.update(keep)
            self._cast.add(model)
        prepared = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        if cast:
            mine = [p for p in model.parameters() if p in self._low]
            for p in mine:  # Accelerate may have moved the model to its device
                if self._low[p].device != p.device:
                    self._low[p] = self._low[p].to(p.device)
            if isinstance(prepared, nn.parallel.DistributedDataParallel):
                broadcast_bytes_([self._low[p] for p in mine])  # as DDP broadcast the weights
        return prepared

    @override
    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        """Accelerate's ``prepare_optimizer``; with ``weights``, over a
        :class:`~distamp.MasterWeightOptimizer` around ``optimizer`` whose masters are the low
        bits kept from the model's cast."""
        if self.weights is not None and self._to_wrap(optimizer):
            self._check_optimizer(optimizer, set(), set())
            params = [p for group in optimizer.param_groups for p in group["params"]]
            low = {p: self._low.pop(p) for p in params if p in self._low}
            optimizer = MasterWeightOptimizer(optimizer, self.weights, low)
            # A policy's adaptive islands (the subclass's run) promote from the masters.
            rules = getattr(getattr(self, "adaptive", None), "adaptive", None)
            if rules is not None:
                rules.exact_weights = optimizer.exact_weight
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    # ------------------------------------------------------------------ checks
    def _to_cast(self, model: nn.Module) -> bool:
        return not accelerate_prepared(model) and model not in self._cast

    @staticmethod
    def _to_wrap(optimizer: torch.optim.Optimizer) -> bool:
        return not accelerate_prepared(optimizer) and not isinstance(
            optimizer, AcceleratedOptimizer
        )

    def _cast_plan(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The parameters of ``model`` to cast, and the fp32 ones it keeps (the policy's fp32
        modules, frozen parameters). Changes nothing.

        Raises:
            ValueError: ``model`` arrives wrapped or sharded, or with 16-bit trainable
                parameters (their masters are gone).
        """
        sharded = [n for n, p in model.named_parameters() if hasattr(p, "device_mesh")]
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) or sharded:
            raise ValueError(
                f"weights= with a model that arrives wrapped or sharded ({type(model).__name__}"
                f"{', DTensor parameters' if sharded else ''}): pass the plain fp32 model to "
                "prepare, which casts it before Accelerate wraps it"
            )
        islands = island_parameters(model, self.policy)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        low16 = [n for n, p in named if p.dtype in (torch.float16, torch.bfloat16)]
        if low16:
            raise ValueError(
                f"weights=: {len(low16)} parameters are 16-bit already ({', '.join(low16[:3])}"
                f"{', ...' if len(low16) > 3 else ''}): the masters are made from fp32 weights; "
                "build or load the model in fp32 (no .half(), no dtype= in from_pretrained) and "
                "prepare it once"
            )
        cast = [p for _, p in named if id(p) not in islands and p.dtype == torch.float32]
        chosen = set(cast)
        keep = [p for p in model.parameters() if p not in chosen and p.dtype == torch.float32]
        return cast, keep

    def _check_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        casting: set[nn.Parameter],
        kept: set[nn.Parameter],
    ) -> None:
        """Refuse an optimizer the weight precision cannot take over; changes nothing.
        ``casting``/``kept``: what the same ``prepare`` call casts and keeps in fp32."""
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError(
                "weights= with a MasterWeightOptimizer: the accelerator casts the model and "
                "makes the masters itself; pass the fp32 model and the plain optimizer "
                "(no distamp.master_weights before prepare)"
            )
        rule_for(optimizer)  # ValueError naming the optimizers it drives
        name = type(optimizer).__name__
        if any(optimizer.state.values()):
            raise ValueError(
                f"weights=: the {name} has stepped already, its states belong to the fp32 "
                "weights; prepare the optimizer before its first step (load states afterwards "
                "with load_state)"
            )
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stray = [
            p
            for p in params
            if p not in self._low
            and p not in casting
            and not (p.dtype == torch.float32 and (p in self._kept or p in kept))
        ]
        if stray:
            low16 = sum(p.dtype != torch.float32 for p in stray)
            raise ValueError(
                f"weights=: the {name} holds parameters of no model prepared here ("
                f"{len(stray)} of {len(params)}; {low16} of them 16-bit, their masters not kept "
                "here): prepare the fp32 model with or before its optimizer "
                "(accelerator.prepare(model, optimizer)), each parameter in one optimizer"
            )

    def _check_masters(self, _models: list[Any], input_dir: str) -> None:
        """Before ``load_state`` loads anything: every prepared optimizer's file in
        ``input_dir`` holds a master for each 16-bit parameter. Collective (a refusal on every
        rank); reads the files' structure only (memory-mapped)."""
        error = None
        for i, prepared in enumerate(self._optimizers):
            opt = prepared.optimizer if isinstance(prepared, AcceleratedOptimizer) else prepared
            path = os.path.join(input_dir, f"{OPTIMIZER_NAME}{'' if i == 0 else f'_{i}'}.bin")
            if not isinstance(opt, MasterWeightOptimizer) or not os.path.isfile(path):
                continue  # a missing file: Accelerate's own error
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                entries = list(
                    state["state"].get(k, {}) for g in state["param_groups"] for k in g["params"]
                )
            except Exception as exc:  # unreadable: Accelerate would fail midway
                error = f"checkpoint file {path}: {exc}; nothing was loaded"
                break
            params = [p for g in opt.param_groups for p in g["params"]]
            wanted = [
                j for j, p in enumerate(params) if p.dtype != torch.float32 and opt.holds_master(p)
            ]
            missing = [j for j in wanted if j >= len(entries) or "master" not in entries[j]]
            if missing:
                error = (
                    f"checkpoint file {path}: no fp32 master for {len(missing)} of the "
                    f"{len(wanted)} 16-bit parameters (a checkpoint of fp32 weights?); nothing "
                    "was loaded. Load its model weights into the fp32 model before prepare "
                    "instead (the masters are made from them)"
                )
                break
        failures, _ = agree_failures(error)
        if failures:
            raise ValueError("; ".join(failures))
