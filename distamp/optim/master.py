"""16-bit weights with their fp32 master, stepped by torch's own update rules.

:class:`MasterWeightOptimizer` wraps a torch optimizer built over the model's parameters. The
parameters become 16-bit (:func:`~distamp.optim.store.cast_parameters_`: the weights the
forward reads, the gradients backward writes, the bytes DDP all-reduces and FSDP gathers), and
beside each one lies what restores its fp32 value (:class:`~distamp.optim.store.Master`): a
remainder, an fp32 copy, a compensation buffer, or nothing. A step reconstructs the fp32
masters of a chunk of parameters, runs torch's update on them (:mod:`distamp.optim.rules`), and
stores them back; the temporaries never exceed one chunk.

It speaks the protocol of torch's fused optimizers (``_step_supports_amp_scaling``): a scaler
sets ``grad_scale`` (the loss scale, times the clip divisor) and the agreed ``found_inf`` before
calling ``step``, so the scaler's one read pass over the 16-bit gradients is the only one before
the step, the gradients are divided in fp32, and a step skipped on any rank leaves weights,
masters and states untouched on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from distamp.optim.bits import round_stochastic_
from distamp.optim.config import WeightPrecision
from distamp.optim.draws import Draws
from distamp.optim.rules import Rule, rule_for
from distamp.optim.scratch import Scratch
from distamp.optim.sharding import WeightGather, assign_owners
from distamp.optim.store import Master, local_tensor, make_master, shaped_like
from distamp.torch_compat import mark_optimizer_stepped

__all__ = ["BLOCK_ELEMENTS", "ROUNDING_STEP", "MasterWeightOptimizer"]

_SLOW_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq"})
"""Moments whose per-step change can fall below half a bf16 step (``1 - beta2``): rounded
stochastically when kept in bf16; the others (``exp_avg``, SGD's buffer) to nearest."""

BLOCK_ELEMENTS = 1 << 19
"""A chunk is updated in blocks of about this many elements (2 MiB per fp32 tensor): on a
2-core CPU (2 MiB of L2 per core) a 21.5M-parameter AdamW step measured 1.2-1.3x torch's with
blocks of 2^19, 1.7x with the whole 2^22-element chunk at once."""

ROUNDING_STEP = "rounding_step"
"""The parameter-group entry counting the steps that drew stochastic rounding's numbers."""


class MasterWeightOptimizer(torch.optim.Optimizer):
    """A torch optimizer's update applied to fp32 masters of 16-bit weights.

    Build it with :func:`distamp.optim.master_weights` (a loop of your own) or let
    ``DistAMP(weights=...)`` build it. The wrapped optimizer's ``param_groups`` are shared, not
    copied: a scheduler built over either changes both.

    Args:
        optimizer: an :class:`~torch.optim.AdamW`, ``Adam`` or ``SGD`` over the (already cast)
            parameters, not stepped yet.
        precision: the :class:`~distamp.optim.config.WeightPrecision`.
        low: what :func:`~distamp.optim.store.cast_parameters_` returned for them (remainders
            or fp32 values; under FSDP2 cut to each parameter's local shard).
        process_group: the data-parallel ranks the masters are sharded over
            (``master="sharded"``; ``None``: the default group).
        seed: the stochastic rounding's random stream, the same on every rank.

    Raises:
        ValueError: an optimizer it cannot drive, one that has stepped, or a parameter whose
            dtype is neither fp32 nor the weight precision's.
    """

    _step_supports_amp_scaling = True  # the scaler hands grad_scale and found_inf to step()
    keeps_16bit_masters = True
    """A scaler steps its 16-bit parameters: their masters are kept here (a scaler refuses
    16-bit parameters of any other optimizer: :mod:`distamp.scaler.master_dtypes`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision: WeightPrecision,
        low: Mapping[nn.Parameter, torch.Tensor] | None = None,
        *,
        process_group: Any = None,
        seed: int = 0,
    ) -> None:
        if isinstance(optimizer, MasterWeightOptimizer):
            raise ValueError("this optimizer already keeps master weights")
        self.rule: Rule = rule_for(optimizer)
        if any(optimizer.state.values()):
            raise ValueError(
                f"{type(optimizer).__name__} has stepped already: its states are fp32 tensors "
                "of the old weights. Build the weight precision before the first step (or load "
                "the states afterwards with load_state_dict)."
            )
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared: schedulers of either reach both
        self.inner = optimizer
        self.precision = precision
        self.seed = seed
        # One stream per device: torch draws on a device only from a generator of that device.
        self.generators: dict[torch.device, torch.Generator] = {}
        self._scratch = Scratch()
        params = [p for g in self.param_groups for p in g["params"]]
        self.gather: WeightGather | None = None
        owners = [0] * len(params)
        rank = 0
        if precision.master == "sharded" and _world(process_group) > 1:
            import torch.distributed as dist

            world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
            owners = assign_owners([local_tensor(p.detach()).numel() for p in params], world)
            locals_ = [local_tensor(p.detach()) for p in params]
            self.gather = WeightGather(locals_, owners, process_group)
        low = low or {}
        self.masters: dict[nn.Parameter, Master] = {
            p: make_master(p, precision, low.get(p), owner == rank)
            for p, owner in zip(params, owners, strict=True)
        }
        for group in self.param_groups:
            for p in group["params"]:
                if self.masters[p].kind != "remote":
                    self.state[p] = self._fresh_state(group, p)

    # ------------------------------------------------------------------ state
    def _fresh_state(self, group: dict[str, Any], p: nn.Parameter) -> dict[str, Any]:
        """Zeroed moments (stored in the states' dtype; an fp32 parameter's in fp32), as torch
        creates them lazily at the first step; SGD's momentum buffer stays ``None`` until the
        first step, which fills it with the gradient (torch's rule)."""
        w = local_tensor(p.detach())
        dtype = torch.float32 if w.dtype == torch.float32 else self.precision.state_dtype
        state: dict[str, Any] = {}
        if self.rule.has_step:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.zeros(
                (), dtype=torch.float32, device=w.device if on_device else None
            )
        for name in self.rule.moment_names(group):
            state[name] = None if self.rule.name == "sgd" else torch.zeros_like(w, dtype=dtype)
        return state

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Update the masters from the 16-bit gradients and store the weights back.

        Under a scaler (``scaler.step(opt)``), the gradients are divided by the scale it hands
        over, and a step it found non-finite on any rank is skipped here, with no write: the
        agreed flag is read on the host (free on the CPU; one sync on an accelerator, as for
        every non-fused optimizer). ``master="sharded"``: one all-gather per weight dtype after
        an applied step.

        Raises:
            RuntimeError: fp16 weights stepped without loss scaling (no scaler, or a disabled
                one), or a ``closure``.
        """
        if closure is not None:
            raise RuntimeError("MasterWeightOptimizer.step takes no closure")
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        if self.precision.needs_scaler and found_inf is None:
            raise RuntimeError(
                "fp16 weights stepped without loss scaling: their gradients underflow unseen. "
                "Step through an enabled scaler (scaler.step(optimizer) with a "
                "distamp.DistributedGradScaler, or DistAMP(precision='fp16')), or use bf16."
            )
        mark_optimizer_stepped(self.inner)  # a scheduler built over the inner one knows
        # Host read of the agreed flag (see docstring): a skip writes nothing at all.
        if found_inf is not None and bool(found_inf.item()):
            return None
        for g, group in enumerate(self.param_groups):
            count = 0
            if self._rounds:  # counted in the group: a resumed run draws the same numbers
                count = int(group.get(ROUNDING_STEP, 0)) + 1
                group[ROUNDING_STEP] = count
            try:
                for c, chunk in enumerate(self._chunks(group)):
                    # One stream for the chunk, seeded once: its tensors' draws follow one
                    # another, block after block.
                    device = chunk[0].weight.device
                    draws = self._generator(device, (g, c, count)) if self._rounds else None
                    for block in self._blocks(group, chunk):
                        self._step_block(group, block, grad_scale, draws)
            finally:
                self._scratch.clear()  # nothing of the step's temporaries outlives it
        if self.gather is not None:
            self.gather.gather_()
        return None

    def _chunks(self, group: dict[str, Any]) -> Iterator[list[Master]]:
        """This rank's parameters of ``group`` that have a gradient, in runs of about
        ``chunk_elements`` elements (the bound on the step's fp32 temporaries)."""
        chunk: list[Master] = []
        size = 0
        for p in group["params"]:
            m = self.masters[p]
            if m.kind == "remote" or p.grad is None:
                continue
            chunk.append(m)
            size += m.weight.numel()
            if size >= self.precision.chunk_elements:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _blocks(self, group: dict[str, Any], chunk: list[Master]) -> Iterator[list[Master]]:
        """``chunk`` in runs of about :data:`BLOCK_ELEMENTS` elements, stepped one after the
        other so that a block's masters, gradients and moments stay in the cache through the
        update's passes (torch's foreach update makes each pass over the whole list). The
        update is elementwise, so the grouping changes no bit; and a chunk's draws keep their
        order where a chunk draws for one list of tensors only (its second moments, or its
        weights); where it draws for more (stochastic weights and bf16 moments, or AMSGrad's
        two bf16 second moments), the chunk is one block."""
        slow = self.precision.states == "bf16" and self.rule.name == "adam"
        drawing = int(self.precision.master == "stochastic") + sum(
            slow and name in _SLOW_MOMENTS for name in self.rule.moment_names(group)
        )
        if drawing > 1:
            yield chunk
            return
        block: list[Master] = []
        size = 0
        for m in chunk:
            block.append(m)
            size += m.weight.numel()
            if size >= BLOCK_ELEMENTS:
                yield block
                block, size = [], 0
        if block:
            yield block

    def _step_block(
        self,
        group: dict[str, Any],
        chunk: list[Master],
        grad_scale: torch.Tensor | None,
        draws: Draws | None,
    ) -> None:
        # Every fp32 temporary is a view of the step's reused buffers (:mod:`.scratch`).
        device = chunk[0].weight.device
        rebuilt = iter(
            self._scratch.views("master", [m.weight.shape for m in chunk if m.rebuilds], device)
        )
        masters = [m.fp32(next(rebuilt)) if m.rebuilds else m.fp32() for m in chunk]
        raw = [local_tensor(m.param.grad) for m in chunk]  # type: ignore[arg-type]
        # fp32 copies of the 16-bit gradients, divided in place; an fp32 parameter's own
        # gradient is copied only when it must be divided (its .grad stays as it is)
        grads = self._widened("grad", raw, device, copy=grad_scale is not None)
        if grad_scale is not None:
            torch._foreach_div_(grads, grad_scale.to(device))
        names = self.rule.moment_names(group)
        stored = {name: [self.state[m.param][name] for m in chunk] for name in names}
        work: dict[str, list[Any]] = {
            name: self._widened(name, ts, device, copy=False) for name, ts in stored.items()
        }
        if self.rule.has_step:
            work["step"] = [self.state[m.param]["step"] for m in chunk]
        self.rule.run(group, masters, grads, work)
        # What the stochastic roundings draw into, and the nearest roundings of masters that
        # must survive them compute in: sized to the largest tensor that needs it.
        needs = [m.weight.numel() for m in chunk if m.needs_work]
        needs += [
            t.numel()
            for name in names
            if name in _SLOW_MOMENTS
            for t in stored[name]
            if t is not None and t.dtype == torch.bfloat16
        ]
        spare = self._scratch.flat("work", max(needs), device) if needs else None
        for name in names:
            for m, old, new in zip(chunk, stored[name], work[name], strict=True):
                if old is None:  # SGD's first step created the buffer (fp32, the gradient)
                    dtype = torch.float32 if m.kind == "fp32" else self.precision.state_dtype
                    self.state[m.param][name] = new.to(dtype)
                elif old.dtype == torch.bfloat16 and name in _SLOW_MOMENTS:
                    # rounded stochastically: to nearest, an Adam second moment whose change
                    # per step is below half a bf16 step (beta2=0.999) would never decay
                    assert spare is not None
                    round_stochastic_(new, old, draws, spare[: new.numel()])
                elif old is not new:  # fp32, or a bf16 first moment (1 - beta1 a step): nearest
                    old.copy_(new)
        for m, master in zip(chunk, masters, strict=True):
            m.store_(
                master,
                draws if m.kind == "stochastic" else None,
                None if spare is None or not m.needs_work else spare[: master.numel()],
                spent=m.rebuilds,  # a view of the step's buffer, not needed after its store
            )

    def _widened(
        self, slot: str, tensors: list[Any], device: torch.device, *, copy: bool
    ) -> list[Any]:
        """``tensors`` in fp32: the 16-bit ones (and with ``copy`` the fp32 ones too) copied
        into views of ``slot``'s reused buffer (exact: a widening), the others as they are."""
        moved = [t is not None and (copy or t.dtype != torch.float32) for t in tensors]
        shapes = [t.shape for t, m in zip(tensors, moved, strict=True) if m]
        views = iter(self._scratch.views(slot, shapes, device)) if shapes else iter(())
        return [next(views).copy_(t) if m else t for t, m in zip(tensors, moved, strict=True)]

    @property
    def _rounds(self) -> bool:
        """Whether a step draws random numbers (stochastic weights, or bf16 moments)."""
        return self.precision.master == "stochastic" or self.precision.states == "bf16"

    def _generator(self, device: torch.device, stream: tuple[int, int, int]) -> Draws:
        """The stochastic rounding's random stream on ``device`` for one chunk of one step:
        seeded from ``(seed, group, chunk, step)``, so every rank draws alike and a resumed
        run draws what the uninterrupted one drew (the step count rides in the group)."""
        gen = self.generators.get(device)
        if gen is None:
            gen = self.generators[device] = torch.Generator(device)
        group, chunk, step = stream
        key = ((self.seed * 1_000_003 + step) * 1_009 + group) * 100_003 + chunk
        return Draws(gen, key % (1 << 62))

    # ------------------------------------------------------------------ what others read
    def master_tensors(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """``(parameter, fp32 master)`` for every parameter this rank holds the master of
        (local shapes; new tensors except for fp32 parameters). A stochastic or Kahan run has
        no exact master: its weight (plus compensation) is the best value there is."""
        for p, m in self.masters.items():
            if m.kind != "remote":
                yield p, m.fp32()

    def exact_weight(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s exact fp32 value for a computation that wants the master rather than the
        16-bit weight (an island adaptive precision promoted): the weight upcast plus the
        master's difference from it, detached, so that the value is the master bit for bit
        and the gradient reaches ``p`` as it would through ``p.float()``. ``None`` where no
        rank-identical exact value exists here: no 16-bit weight of this optimizer's, no master
        (stochastic), or sharded masters (another rank holds it: every rank then computes from
        the 16-bit weight alike)."""
        m = self.masters.get(p)  # type: ignore[call-overload]
        if m is None or m.kind not in ("remainder", "copy", "kahan") or self.gather is not None:
            return None
        up = p.float()
        with torch.no_grad():
            diff = m.fp32() - up.detach()
        return up + diff

    def holds_master(self, p: nn.Parameter) -> bool:
        """Whether this rank holds ``p``'s master (always, unless ``master="sharded"``)."""
        return self.masters[p].kind != "remote"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "masters", None) is None:  # torch's __init__ adding the first groups
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "MasterWeightOptimizer: add parameter groups to the optimizer before wrapping it "
            "(their masters are made when the weights are cast)"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout, in fp32, with each 16-bit parameter's exact master as ``"master"``:
        it loads into this class under any weight precision, and into (or from) a plain torch
        optimizer of the same class (which ignores ``"master"``). ``master="sharded"``: this
        rank's parameters only (every rank saves its own; DCP joins them)."""
        index = 0
        packed: dict[int, dict[str, Any]] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                ids.append(index)
                m = self.masters[p]
                if m.kind != "remote":
                    entry = {
                        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for k, v in self.state[p].items()
                    }
                    if m.kind != "fp32":
                        entry["master"] = m.fp32().clone() if m.kind == "copy" else m.fp32()
                    packed[index] = {k: shaped_like(v, p) for k, v in entry.items()}
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": packed, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load :meth:`state_dict`'s layout (or a torch optimizer's of the same class). Checked
        whole before anything changes: group count and sizes, each entry's keys and shapes.

        Raises:
            ValueError: what does not fit, named; nothing was changed.
        """
        params = [p for g in self.param_groups for p in g["params"]]
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        state = state_dict.get("state", {}) if isinstance(state_dict, Mapping) else None
        if not isinstance(groups, list) or not isinstance(state, Mapping):
            raise ValueError("load_state_dict: expected {'state': ..., 'param_groups': [...]}")
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g.get("params", ())) for g in groups] != sizes:
            raise ValueError(
                f"load_state_dict: the checkpoint's parameter groups hold "
                f"{[len(g.get('params', ())) for g in groups]} parameters, this optimizer's {sizes}"
            )
        # The saved groups' parameter keys, in order, name this optimizer's parameters in order
        # (indices from state_dict(); parameter names from DCP's flattened layout), as torch's.
        saved_keys = [k for g in groups for k in g["params"]]
        by_key = dict(zip(saved_keys, params, strict=True))
        plan: list[tuple[nn.Parameter, str, torch.Tensor | None]] = []
        for key, entry in state.items():
            if key not in by_key or not isinstance(entry, Mapping):
                raise ValueError(f"load_state_dict: entry {key!r} names no parameter")
            p = by_key[key]
            i = saved_keys.index(key)
            if self.masters[p].kind == "remote":
                continue
            shape = local_tensor(p.detach()).shape
            mine = self.state[p]
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    value = local_tensor(value)  # a sharded parameter's state: this rank's part
                if name == "master" or (name in mine and name != "step"):
                    if value is not None and (
                        not isinstance(value, torch.Tensor) or value.shape != shape
                    ):
                        got = getattr(value, "shape", type(value).__name__)
                        raise ValueError(
                            f"load_state_dict: parameter {i}'s {name!r} is {got}, expected "
                            f"{tuple(shape)}"
                        )
                    plan.append((p, name, value))
                elif name == "step":
                    plan.append((p, name, torch.as_tensor(value, dtype=torch.float32)))
        for group, saved in zip(self.param_groups, groups, strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        with torch.no_grad():
            for p, name, value in plan:
                if name == "master":
                    assert value is not None
                    self.masters[p].load_(value.to(torch.float32))
                    continue
                old = self.state[p].get(name)
                if value is None or old is None:
                    dtype = torch.float32 if self.masters[p].kind == "fp32" else None
                    device = local_tensor(p.detach()).device  # a CPU checkpoint's buffer too
                    self.state[p][name] = (
                        value
                        if value is None
                        else value.to(device, dtype or self.precision.state_dtype, copy=True)
                    )
                else:
                    old.copy_(value)


def _world(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
