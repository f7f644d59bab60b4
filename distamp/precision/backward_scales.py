"""Per-block backward scales: each block's gradients get their own power of two.

One loss scale serves the whole model, so when one block's gradients are ``2**30`` times
smaller than another's (fp16's normal range is about ``2**30`` wide), the scale that keeps the
large ones finite flushes the small ones to zero or subnormals. Here each **block** ``b`` gets
an exponent ``k_b`` (0 at the start):

- where the gradient enters the block in backward (its forward outputs), it is multiplied by
  ``2**k_b``; where it leaves (the block's floating inputs), by ``2**-k_b``: the rest of the
  model sees the gradients it would see without the factor, and the block's own parameters get
  ``scale * 2**k_b`` times their gradient;
- the scaler unscales each parameter's gradient by ``2**-k_b`` on top of ``1 / scale`` in its
  one unscale pass, the gradients grouped by factor
  (:meth:`distamp.DistributedGradScaler.set_grad_exponents`): one read per gradient still.

**Blocks**: by default the model's top-level children holding parameters, with
``nn.ModuleList`` / ``nn.ModuleDict`` containers expanded (so ``model.blocks[i]`` of a
transformer is a block; a plain ``nn.Sequential`` model's entries are its blocks). Or the
outermost modules matching ``BackwardScaleRules.blocks`` patterns. Blocks never nest. A
parameter outside every block keeps exponent 0, and so do blocks that share a parameter with
another block (tied weights: one gradient, two factors), which are never scaled. A tensor
reaching a block other than through its forward arguments (a captured module attribute, a
closure) skips the exit factor: keep such blocks out of the patterns. A block with ``k != 0``
receives copies of its floating inputs (the exit factor's autograd function): one that modifies
an input in place then modifies the copy, and the caller's tensor stays as it was.

**Decisions** run at the numeric monitor's reports, from agreed numbers only, so every rank
changes the same exponents at the same step:

- *overflow*: each block measures the largest ``|gradient|`` entering it, times ``2**k_b``
  (one ``amax`` per block output per step, like the monitor's forward headroom), in fp32 so
  that a product past the format's maximum is seen even where fp16 made it ``inf``. A block
  whose scaled entering gradient passed the format's maximum, or the block before it in
  backward order when the gradient arrived non-finite from there, **backs off alone**:
  ``k_b`` drops by one per step of the window where its own factor overflowed (by one when the
  non-finite gradient came from inside it), if ``k_b > 0`` (at 0 the block overflowed under the loss
  scale itself, whose own backoff is the remedy). The step itself was skipped by the one agreed
  flag and the loss scale backed off by its own rule, as always.
- *underflow*: a block whose parameters' gradients are more than ``grow_above`` zero or
  subnormal (the monitor's agreed underflow fractions, element-weighted) **grows**: ``k_b``
  rises by as many doublings as keep its entering gradient ``headroom_bits`` binades under the
  format's maximum, at most ``max_growth`` per report, up to ``max_exponent``.

Not attributed: an overflow that appears only in a block's parameter gradients (its entering
and leaving activation gradients finite) is left to the loss scale's backoff.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from distamp.arguments import ArgumentTypeError
from distamp.model_names import model_name, named_model_modules
from distamp.observe.numerics import FORMAT_MAX, NumericStats
from distamp.precision.patterns import check_module_patterns
from distamp.precision.settings import EXPONENT_LIMIT, Fields
from distamp.precision.state_checks import check_backward_scale_state
from distamp.torch_compat import in_recomputation

__all__ = ["BackwardScaleChange", "BackwardScaleRules", "BackwardScales", "select_blocks"]


@dataclass(frozen=True, kw_only=True)
class BackwardScaleRules:
    """Settings of per-block backward scales (``AutocastPolicy(..., backward_scales=...)``).

    Every field is checked here, at construction (:mod:`distamp.precision.settings`): a wrong
    kind is an ``ArgumentTypeError`` (a ``TypeError`` and a ``ValueError``), a value out of range
    a ``ValueError``, both naming the field. Numbers are taken as torch takes them (numpy
    scalars, 0-d tensors; never ``bool``) and stored as plain Python numbers.

    Attributes:
        blocks: name patterns (``fnmatch`` on qualified names) of the blocks, a non-empty
            sequence of non-empty strings (stored as a tuple; one string is refused); each must
            match a module of the model it meets (:mod:`distamp.precision.patterns`). ``None``
            (default): top-level blocks (see the module doc).
        grow_above: grow a block whose underflow fraction exceeds this, in ``[0, 1)`` (default
            0.05).
        headroom_bits: after growing, a block's largest entering gradient stays this many
            binades under the format's maximum, in ``[0, 40]`` (default 8: parameter gradients
            sum over the batch and can exceed it; fp16 spans 40 binades, subnormals included,
            so a larger headroom could never let a block grow).
        max_growth: most doublings a block gains at one report, in ``[1, 24]`` (default 8).
        max_exponent: the largest ``k_b``, in ``[1, 24]`` (default 24; exponents stay in
            ``[0, max_exponent]``; why 24: :data:`~distamp.precision.settings.EXPONENT_LIMIT`).
    """

    blocks: tuple[str, ...] | None = None
    grow_above: float = 0.05
    headroom_bits: int = 8
    max_growth: int = 8
    max_exponent: int = EXPONENT_LIMIT

    def __post_init__(self) -> None:
        f = Fields(self)
        f.patterns("blocks", "layers.*", optional=True, empty=False)
        f.real("grow_above", 0.0, 1.0, high_open=True, why=" (an underflow fraction)")
        f.whole("headroom_bits", 0, 40, " (binades: fp16 spans 40)")
        f.whole("max_growth", 1, EXPONENT_LIMIT)
        f.whole("max_exponent", 1, EXPONENT_LIMIT, " (2**k stays a sane float32 factor)")


@dataclass(frozen=True)
class BackwardScaleChange:
    """One decision: at optimizer ``step``, ``block``'s exponent went ``before`` -> ``after``."""

    step: int
    block: str
    before: int
    after: int
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.block} 2**{self.before} -> 2**{self.after} ({self.reason})"


def select_blocks(
    model: nn.Module, patterns: tuple[str, ...] | None = None
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` (see the module doc), in ``named_modules`` order, never nested.

    Names are model names (:mod:`distamp.model_names`): a block is the same block with or
    without a checkpoint wrapper or ``torch.compile`` around it or the model. The module is the
    outermost of that name, so the hooks sit at the block's boundary, outside its checkpoint and
    its compiled region (its entry and exit factors once per forward, and a block compiled with
    its wrapper stays one graph)."""
    modules = list(named_model_modules(model, outermost=True))
    if patterns is not None:
        out: list[tuple[str, nn.Module]] = []
        for name, module in modules:
            inside = any(name.startswith(f"{b}.") for b, _ in out)
            if name and not inside and any(fnmatch.fnmatchcase(name, p) for p in patterns):
                out.append((name, module))
        return out

    children: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in modules:
        if name:
            children.setdefault(name.rpartition(".")[0], []).append((name, module))

    def expand(parent: str) -> list[tuple[str, nn.Module]]:
        found: list[tuple[str, nn.Module]] = []
        for name, child in children.get(parent, []):
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found += expand(name)
            elif any(True for _ in child.parameters()):
                found.append((name, child))
        return found

    return expand("")


class _Leave(torch.autograd.Function):
    """Identity forward; backward: the block's factor taken off where the gradient leaves.

    A copy, not a view: a block may modify its input in place (``relu_``), which autograd
    forbids on a custom function's view. Only blocks with ``k != 0`` pay it."""

    @staticmethod
    @override
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> Any:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    @override
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad * ctx.factor, None


def _grad_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every floating tensor that requires grad in a nested structure."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad and value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _grad_tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _grad_tensors(v)


def _map_grad_tensors(value: Any, fn: Any) -> Any:
    """``fn`` applied to every floating tensor that requires grad in a nested structure."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.requires_grad and value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_grad_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_grad_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_grad_tensors(v, fn) for k, v in value.items()}
    return value


class BackwardScales:
    """Per-block backward exponents: hooks, agreed statistics, decisions and the log.

    Args:
        rules: the settings.
        precision: the policy's precision name; only "fp16" is loss-scaled.

    Raises:
        ValueError: another precision (bf16, fp8 and fp32 need no loss scale).
    """

    def __init__(self, rules: BackwardScaleRules, precision: str) -> None:
        if precision != "fp16":
            raise ValueError(
                f"backward_scales=True with precision={precision!r}: per-block gradient scales "
                "refine fp16's loss scale; bf16/fp8/fp32 have no loss scale to refine. Use "
                "precision 'fp16' or backward_scales=False"
            )
        self.rules = rules
        self.fmax = FORMAT_MAX["fp16"]
        self.changes: list[BackwardScaleChange] = []
        self.names: list[str] = []
        self.exponents: list[int] = []
        self._params: list[list[tuple[str, nn.Parameter]]] = []
        self._handles: list[RemovableHandle] = []
        self._forward_order: list[int] = []
        self.pinned: set[int] = set()  # blocks sharing a parameter: exponent 0 for good
        self._step: torch.Tensor | None = None  # [B] this step's entering amax (block frame)
        self._window: torch.Tensor | None = None  # [3B]: steps over, non-finite, finite amax
        self._agreed: torch.Tensor | None = None

    @classmethod
    def from_arg(cls, value: bool | BackwardScaleRules, precision: str) -> BackwardScales | None:
        """``AutocastPolicy(backward_scales=...)``: False -> None, True -> default rules."""
        if value is False:
            return None
        if value is True:
            return cls(BackwardScaleRules(), precision)
        if isinstance(value, BackwardScaleRules):
            return cls(value, precision)
        raise ArgumentTypeError(
            f"backward_scales={value!r}: pass True, False or a BackwardScaleRules(...) instance"
        )

    # ------------------------------------------------------------------ binding
    def bind(self, model: nn.Module) -> None:
        """Find ``model``'s blocks (by model names: :func:`select_blocks`) and put
        the entry/exit hooks on them. A refused model changes nothing.

        Raises:
            ValueError: a ``blocks`` pattern that matches no module of ``model``, or no block.
        """
        check_module_patterns(model, blocks=self.rules.blocks)
        blocks = select_blocks(model, self.rules.blocks)
        if not blocks:
            wanted = self.rules.blocks or "top-level children with parameters"
            raise ValueError(
                f"backward_scales: no block found in the model ({wanted}); set "
                "BackwardScaleRules(blocks=(...)) to module name patterns that match"
            )
        self.remove()
        previous = dict(zip(self.names, self.exponents, strict=True))
        self.names = [name for name, _ in blocks]
        self.exponents = [previous.get(name, 0) for name in self.names]
        self._params = [
            [(model_name(p), t) for p, t in m.named_parameters(prefix=n)] for n, m in blocks
        ]
        owners: dict[int, list[int]] = {}
        for i, params in enumerate(self._params):
            for _, p in params:
                owners.setdefault(id(p), []).append(i)
        self.pinned = {i for ids in owners.values() if len(ids) > 1 for i in ids}
        for i, (_, module) in enumerate(blocks):
            self._handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i: int) -> Any:
        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            k = self.exponents[i]
            if k == 0 or not torch.is_grad_enabled():
                return None
            factor = 2.0**-k
            leave = lambda t: _Leave.apply(t, factor)  # noqa: E731
            return _map_grad_tensors(args, leave), _map_grad_tensors(kwargs, leave)

        # Eager under torch.compile: the hooks sit at a block's boundary, so the block itself
        # stays one graph, shared by every block (the exponents and the index are Python
        # numbers: traced, each would be a guard, a graph per block and one per change).
        return torch.compiler.disable(pre)

    def _post(self, i: int) -> Any:
        """A tensor hook on each output (not a function wrapping it: the caller may modify the
        output in place): the entering gradient recorded and multiplied by ``2**k``."""

        def post(_m: nn.Module, _args: Any, output: Any) -> None:
            # The forward's order, also under reentrant checkpointing (a forward without grad,
            # recomputed with it in backward order): never from a recomputation.
            if i not in self._forward_order and not in_recomputation():
                self._forward_order.append(i)
            if not torch.is_grad_enabled():
                return
            factor = 2.0 ** self.exponents[i]

            def enter(grad: torch.Tensor) -> torch.Tensor | None:
                self.record_entry(i, grad, factor)
                return grad * factor if factor != 1.0 else None

            for t in _grad_tensors(output):
                t.register_hook(enter)

        return torch.compiler.disable(post)  # eager: see _pre

    def record_entry(self, index: int, grad: torch.Tensor, factor: float) -> None:
        """Backward: block ``index``'s entering gradient, its amax times ``factor`` in fp32
        (no host sync). NaN stays non-finite (``maximum`` propagates it)."""
        amax = grad.detach().abs().amax().float() * factor
        if self._step is None or self._step.device != amax.device:
            self._step = torch.zeros(len(self.names), device=amax.device)
        self._step[index] = torch.maximum(self._step[index], amax)

    def grad_exponents(self) -> dict[torch.Tensor, int]:
        """Each block parameter and its exponent (for the scaler's unscale pass)."""
        return {
            p: k for params, k in zip(self._params, self.exponents, strict=True) for _, p in params
        }

    # ------------------------------------------------------------------ statistics
    def _fold(self, skipped: torch.Tensor) -> None:
        """This step's entering amaxes into the window, once its skip is agreed: steps where a
        block's scaled entering gradient passed the format's maximum *and* the step skipped
        (a count; an fp32 gradient past 65504 that broke nothing is no overflow), non-finite
        entering gradients of a skipped step, the largest finite one."""
        if self._step is None:
            return
        b, step = len(self.names), self._step
        if self._window is None or self._window.device != step.device:
            self._window = torch.zeros(3 * b, device=step.device)
        skip = skipped.to(step.device).float()
        finite = torch.isfinite(step)
        self._window[:b] += (finite & (step >= self.fmax)).float() * skip
        bad = (~finite).float() * skip
        torch.maximum(self._window[b : 2 * b], bad, out=self._window[b : 2 * b])
        largest = torch.where(finite, step, torch.zeros_like(step))
        torch.maximum(self._window[2 * b :], largest, out=self._window[2 * b :])
        step.zero_()

    @property
    def capacity(self) -> int:
        """The most floats :meth:`payload` sends: ``[over, non-finite, amax]`` per block."""
        return 3 * len(self.names)

    def payload(self, due: bool) -> torch.Tensor | None:
        """The rider's part at a reporting step (``due``): the window of the steps completed
        since the last report, ``[over, non-finite, amax]`` per block; nothing otherwise. The
        step in progress joins the next window (its skip is not agreed yet)."""
        if not due or self._window is None:
            return None
        return self._window.clone()

    def deliver(self, reduced: torch.Tensor, op: str, ranks: int) -> None:
        """The agreed window. Flags agree under MAX and SUM alike (> 0); a SUM of amaxes
        bounds their maximum from above, so growth stays on the safe side; a SUM of counts is
        brought back to the ranks' mean, rounded up."""
        agreed = reduced.clone()
        if op == "sum" and ranks > 1:
            b = len(self.names)
            agreed[:b] = torch.ceil(agreed[:b] / ranks)
        self._agreed = agreed

    def end_step(self, due: bool, skipped: torch.Tensor) -> None:
        """After the step, with its agreed skip flag: at a reporting step the window closes
        (the local one when no collective ran: nothing to agree with); then this step is
        folded in."""
        if due:
            if self._agreed is None and self._window is not None:
                self._agreed = self._window.clone()
            if self._window is not None:
                self._window.zero_()
        self._fold(skipped)

    # ------------------------------------------------------------------ decisions
    def _blamed(self, over: list[float], bad: list[float]) -> dict[int, tuple[int, str]]:
        """Block -> (doublings to back off, reason)."""
        order = list(reversed(self._forward_order))  # backward order
        order += [i for i in range(len(self.names)) if i not in order]
        blamed: dict[int, tuple[int, str]] = {}
        for pos, i in enumerate(order):
            if over[i] > 0:
                steps = int(over[i])
                reason = f"its scaled entering gradient passed the fp16 maximum on {steps} steps"
                blamed[i] = (steps, reason)
            elif bad[i] > 0 and pos > 0:
                prev = order[pos - 1]
                if bad[prev] == 0 and prev not in blamed:
                    blamed[prev] = (1, "its leaving gradient went non-finite")
        return blamed

    def decide(self, stats: NumericStats) -> list[BackwardScaleChange]:
        """Apply the rules to the agreed window and report (one host read of ``3 * blocks``
        numbers); returns (and logs) the changes made."""
        made: list[BackwardScaleChange] = []
        agreed, self._agreed = self._agreed, None
        if agreed is None:
            return made
        b = len(self.names)
        values = agreed.tolist()  # host sync, reporting steps only
        over, bad, largest = values[:b], values[b : 2 * b], values[2 * b :]
        blamed = self._blamed(over, bad)
        high = self.rules.max_exponent
        for i in range(b):
            k = self.exponents[i]
            if i in blamed and k > 0:
                steps, reason = blamed[i]
                self._change(stats.step, i, max(0, k - steps), reason, made)
                continue
            under = None if i in self.pinned else self.underflow(i, stats)
            if under is None or under <= self.rules.grow_above or k >= high:
                continue
            if largest[i] > 0:
                room = math.floor(math.log2(self.fmax / largest[i])) - self.rules.headroom_bits
            else:  # no gradient entered, or all of it was zero
                room = self.rules.max_growth
            grow = min(room, self.rules.max_growth, high - k)
            if grow >= 1:
                reason = f"underflow {under:.3g} > {self.rules.grow_above}"
                self._change(stats.step, i, k + grow, reason, made)
        return made

    def underflow(self, index: int, stats: NumericStats) -> float | None:
        """Block ``index``'s underflow fraction in ``stats`` (element-weighted over its
        parameters), ``None`` when the report has none of them."""
        total = count = 0.0
        for name, p in self._params[index]:
            if name in stats.underflow:
                total += stats.underflow[name] * p.numel()
                count += p.numel()
        return total / count if count else None

    def _change(
        self, step: int, index: int, after: int, reason: str, made: list[BackwardScaleChange]
    ) -> None:
        change = BackwardScaleChange(step, self.names[index], self.exponents[index], after, reason)
        self.exponents[index] = after
        self.changes.append(change)
        made.append(change)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Exponents, the change log and the partial window (host sync): a resumed run decides
        and scales exactly as an uninterrupted one."""
        return {
            "exponents": dict(zip(self.names, self.exponents, strict=True)),
            "changes": [asdict(c) for c in self.changes],
            "forward_order": list(self._forward_order),
            "window": None if self._window is None else self._window.tolist(),
        }

    def validate_state_dict(self, state: Any) -> None:
        """Check a :meth:`state_dict` against the bound blocks and the rules; changes nothing
        (see :func:`~distamp.precision.state_checks.check_backward_scale_state`: this model's
        blocks, exponents in ``[0, max_exponent]``, 0 on blocks sharing a parameter).

        Raises:
            RuntimeError: called before :meth:`bind`.
            ValueError: naming the entry (``ArgumentTypeError`` for a wrong kind).
        """
        self._checked(state)

    def _checked(self, state: Any) -> dict[str, Any]:
        if not self.names:
            raise RuntimeError("backward scales: bind(model) before loading their state")
        pinned = [self.names[i] for i in self.pinned]
        high = self.rules.max_exponent
        return check_backward_scale_state(state, names=self.names, pinned=pinned, max_exponent=high)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, checked whole first (:meth:`validate_state_dict`): a
        refused state changes nothing."""
        state = self._checked(state)
        self.exponents = state["exponents"]
        self.changes = [BackwardScaleChange(**c) for c in state["changes"]]
        self._forward_order = state["forward_order"]
        window = state["window"]
        device = self._window.device if self._window is not None else torch.device("cpu")
        self._window = None if window is None else torch.tensor(window, device=device)
        self._step, self._agreed = None, None

    def remove(self) -> None:
        """Take the hooks off (exponents and log stay)."""
        for h in self._handles:
            h.remove()
        self._handles = []
