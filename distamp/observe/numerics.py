"""Numeric monitor: where a mixed-precision run is about to leave its format's range.

Per watched module (by default every module that holds parameters of its own) it measures:

- **overflow**: whether the module's forward output went non-finite, so that a skipped step
  names the *first* module (in completion order: an inner module that produced the inf finishes
  before the parents that merely passed it on) whose output broke;
- **headroom**: the largest ``|output|`` since the last report over the format's maximum
  (fp16 65504, bf16 3.4e38, float8 e4m3 448); 1.0 or more means it overflowed;
- **underflow**: per parameter, the fraction of its scaled low-precision gradient elements that
  are zero or subnormal in the compute format (``|g| < finfo(compute_dtype).tiny``), measured
  before unscaling. An embedding's weight (``nn.Embedding``, ``nn.EmbeddingBag``) counts only
  the rows the step looked up, taken as the rows with a nonzero element: the gradient of every
  other row is zero by construction, not by the format (a byte-level GPT's batch of 64 bytes
  leaves about 90% of its 256 rows untouched, which would read as 90% underflow);
- **fp8 flush** (torchao float8 layers only): the fraction of the layer's nonzero input elements
  that torchao's dynamic tensorwise scaling (``448 / amax``) sends to zero in e4m3, i.e. with
  ``|x| * 448 / amax <= 2**-10`` (half e4m3's smallest subnormal, which rounds to zero). Dynamic
  scaling always fits the largest value, so an fp8 layer never overflows in its forward GEMM;
  what breaks it is an input whose dynamic range exceeds e4m3's (about 2**17 from 448 down to
  2**-9): one outlier feature compresses every other value to zero. Headroom against 448 says
  nothing there (the scaled amax is 448 by construction), the flush fraction says exactly how
  much of the input the GEMM lost. Measured on reporting steps only: one pass over the input.

Cost model. Each watched module's forward costs one ``amax`` reduction of its output and one
tiny in-place maximum, every step (the skip attribution must exist for any step, and which
step skips is only known after the fact). The statistics never get a collective of their own:
they ride in the step's one flag collective (:meth:`payload`, through the scaler's
``attach_rider``): one float per watched module every step, plus the headroom, underflow and
fp8 flush vectors at reporting steps (every ``interval`` steps). One host read per reporting step.
Agreed numbers: non-finite flags are exact; headroom and underflow are the ranks' maximum, or
their mean when a clipping norm shares the collective (it is SUM-reduced then).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distamp.model_names import model_name, named_model_modules
from distamp.observe.fp8_flush import flushed_fraction
from distamp.torch_compat import in_recomputation

__all__ = ["E4M3_FLUSH", "FORMAT_MAX", "NumericMonitor", "NumericStats"]

FORMAT_MAX: dict[str, float] = {
    "fp16": 65504.0,
    "bf16": float(torch.finfo(torch.bfloat16).max),
    "fp8_e4m3": 448.0,
    "fp8_e5m2": 57344.0,
}
"""Largest finite value of each compute format: the denominator of headroom."""

E4M3_FLUSH = 2.0**-10
"""Half of e4m3's smallest subnormal (2**-9): scaled values at or below it round to zero."""


@dataclass(frozen=True)
class NumericStats:
    """One agreed report of the monitor (identical on every rank).

    Attributes:
        step: the optimizer step (count of steps completed) the report closes.
        headroom: module name -> max ``|output|`` since the previous report / the format's
            maximum (``inf`` when the output went non-finite).
        underflow: parameter name -> fraction of its gradient elements that are zero or
            subnormal in the compute format, at this reporting step (an embedding's weight:
            of the rows the step looked up).
        skips: ``(step, module)`` for each skipped step since the previous report; ``module``
            is the first watched module whose forward output went non-finite on any rank, or
            ``None`` when the forward was finite (a gradient-only overflow).
        fp8_flush: float8 layer name -> the largest fraction, at this reporting step, of its
            nonzero input elements that e4m3 under dynamic tensorwise scaling rounds to zero
            (measured whether the layer runs in fp8 or was promoted to bf16).
        silent: watched modules whose forward never ran as a module call since the monitor
            was attached (``nn.MultiheadAttention``'s ``out_proj``: the attention reads its
            weights directly). Their headroom is 0 because nothing was measured, not because
            they are safe; the report draws them as "no data".
    """

    step: int
    headroom: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)
    skips: tuple[tuple[int, str | None], ...] = ()
    fp8_flush: dict[str, float] = field(default_factory=dict)
    silent: tuple[str, ...] = ()

    @property
    def first_nonfinite(self) -> str | None:
        """The module blamed for the last skipped step of the report, if any."""
        return self.skips[-1][1] if self.skips else None

    def as_metrics(self) -> dict[str, float]:
        """Flat ``name -> number`` for the metrics writers (JSONL, TensorBoard)."""
        out: dict[str, float] = {"numerics/skips": float(len(self.skips))}
        out.update({f"numerics/headroom/{k}": v for k, v in self.headroom.items()})
        out.update({f"numerics/underflow/{k}": v for k, v in self.underflow.items()})
        out.update({f"numerics/fp8_flush/{k}": v for k, v in self.fp8_flush.items()})
        return out


def _floats(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _floats(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _floats(v)


def _format_of(module: nn.Module, compute: str) -> str:
    """The format a module computes in: float8 layers (torchao, any class in the MRO named
    Float8*) use e4m3; others the policy's compute format."""
    if any(c.__name__.startswith("Float8") for c in type(module).__mro__):
        return "fp8_e4m3"
    return compute


class NumericMonitor:
    """Forward hooks and gradient reads that feed :class:`NumericStats`, agreed across ranks.

    Drive it as the engine does: attach to the scaler (``scaler.attach_rider(monitor)``), call
    :meth:`before_step` with the scale before unscaling, and :meth:`end_step` with the agreed
    skip flag after ``update()``; it returns the :class:`NumericStats` at reporting steps.

    Args:
        model: the unwrapped model (its module and parameter names are the report's).
        compute_dtype: the low-precision dtype (``torch.float16`` or ``torch.bfloat16``).
        interval: steps between reports (headroom and underflow are reduced then); >= 1.
        watch: module name patterns (``fnmatch``) to watch; default: every module with
            parameters of its own.
        step: the step count to start from (a resumed run).

    Attributes:
        latest: the last agreed report (identical on every rank).
        latest_local: the same report with this rank's own headroom, underflow and fp8 flush,
            before the ranks' maximum or mean (the skips are the agreed ones): where one rank's
            data runs hotter than its peers', the agreed numbers hide which rank it is, and
            per-rank telemetry (:mod:`distamp.observe.telemetry`) keeps both.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        compute_dtype: torch.dtype,
        interval: int = 10,
        watch: Iterable[str] | None = None,
        step: int = 0,
    ) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"interval={interval!r}: give a whole number of steps >= 1")
        if compute_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"compute_dtype={compute_dtype!r}: the monitor watches fp16 or bf16 training"
            )
        patterns = None if watch is None else tuple(watch)
        compute = "fp16" if compute_dtype == torch.float16 else "bf16"
        self.interval = interval
        self.tiny = float(torch.finfo(compute_dtype).tiny)
        self.modules: list[tuple[str, nn.Module]] = [
            (name, m)
            for name, m in named_model_modules(model)
            if (
                any(fnmatch.fnmatchcase(name, p) for p in patterns)
                if patterns is not None
                else any(True for _ in m.parameters(recurse=False))
            )
        ]
        self.names = [name for name, _ in self.modules]
        formats = [_format_of(m, compute) for _, m in self.modules]
        self._fmax = torch.tensor([FORMAT_MAX[f] for f in formats])
        self._fp8 = [i for i, f in enumerate(formats) if f == "fp8_e4m3"]  # flush measured
        self._fp8_slot = {i: k for k, i in enumerate(self._fp8)}
        self.params = [
            (model_name(n, model), p) for n, p in model.named_parameters() if p.requires_grad
        ]
        # Gradients zero on every row a step did not look up: underflow counts looked-up rows.
        self._row_sparse = {
            id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        }
        self._step_amax: torch.Tensor | None = None  # [M] this step's max |output|
        self._window_amax: torch.Tensor | None = None  # [M] since the last report
        if self.modules:
            self._step_amax = torch.zeros(len(self.modules), device=self._device())
            self._window_amax = torch.zeros_like(self._step_amax)
        # [F] at a reporting step; slots and the reporting-step flag as tensors (see _slots)
        self._flush = torch.zeros(len(self._fp8), device=self._device())
        self._fp8_slots = [torch.tensor([k], device=self._device()) for k in range(len(self._fp8))]
        self._due_flag = torch.zeros((), device=self._device())
        self.step = step
        # Each module's slot as a 1-element index tensor, not a Python number: under
        # torch.compile a number read in the hook is a guard, and every block of a model would
        # compile a graph of its own; a tensor is an input, so the blocks share one.
        self._slots = [torch.tensor([i], device=self._device()) for i in range(len(self.modules))]
        # Forward completion order, as a stamp per module from one clock (never seen: last, in
        # model order): set on first sight by an eager forward, by every call of a compiled one
        # (a tensor op, where a Python record would be a guard; the earliest stamp stays).
        never = torch.iinfo(torch.int64).max
        self._stamp = torch.full((len(self.modules),), never, dtype=torch.int64)
        self._stamp = self._stamp.to(self._device())
        self._clock = torch.zeros(1, dtype=torch.int64, device=self._device())
        self._seen: set[int] = set()
        self._underflow: torch.Tensor | None = None  # [P] at a reporting step
        self._agreed_bad: torch.Tensor | None = None  # [M] agreed non-finite flags
        self._agreed_stats: torch.Tensor | None = None  # [M + P] agreed headroom, underflow
        self._firsts: list[torch.Tensor] = []  # per step of the window: blamed module or -1
        self._sent = False
        self._local_stats: torch.Tensor | None = None  # [M + P + F] this rank's, before agreeing
        self.latest: NumericStats | None = None
        self.latest_local: NumericStats | None = None
        # Pipeline stages: set when this step's skip lies in an earlier stage (then blame none)
        self.blamed_upstream: torch.Tensor | None = None
        self._handles = [
            mod.register_forward_hook(self._hook(i)) for i, (_, mod) in enumerate(self.modules)
        ]
        # The input of a float8 layer as it comes, ahead of every other pre-hook: torchao's
        # tensor-parallel styles cast it to float8 in theirs (the flushed values gone by then).
        self._handles += [
            self.modules[i][1].register_forward_pre_hook(self._pre_hook(slot), prepend=True)
            for i, slot in self._fp8_slot.items()
        ]

    # ------------------------------------------------------------------ forward
    def _flush_of(self, slot: torch.Tensor, args: Any, due: torch.Tensor | None) -> None:
        """At a reporting step: the fraction of a float8 layer's nonzero input that e4m3 flushes
        to zero under torchao's tensorwise scale ``448 / amax`` (max over micro-batches).
        ``due``: the reporting-step flag, in a compiled block (measured at every step there,
        kept only at a reporting step); ``None``: eager, called at reporting steps only."""
        x = next(_floats(args), None)
        if x is not None and hasattr(x, "to_local"):
            x = x.to_local()  # a DTensor: this rank's part (its own amax; torchao's is global)
        if x is None or type(x).__name__.startswith("Float8"):
            return  # already quantised upstream: what flushed cannot be told any more
        fraction = flushed_fraction(x, FORMAT_MAX["fp8_e4m3"], E4M3_FLUSH).reshape(1)
        if due is not None:
            fraction = fraction * due  # 0 outside a reporting step: the maximum keeps the old
        merged = torch.maximum(self._flush.index_select(0, slot), fraction.to(self._flush.device))
        self._flush.index_copy_(0, slot, merged)

    def _pre_hook(self, slot: int) -> Any:
        index = self._fp8_slots[slot]

        def pre_hook(_module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():
                self._flush_of(index, args, self._due_flag)
            elif self.due and not in_recomputation():
                self._flush_of(index, args, None)

        return pre_hook

    def _hook(self, index: int) -> Any:
        slot = self._slots[index]

        def hook(_module: nn.Module, args: Any, output: Any) -> None:
            if in_recomputation():  # activation checkpointing: this forward was counted
                return
            if torch.compiler.is_compiling():
                stamp = torch.minimum(self._stamp.index_select(0, slot), self._clock)
                self._stamp.index_copy_(0, slot, stamp)
                self._clock.add_(1)
            elif index not in self._seen:
                self._seen.add(index)
                self._stamp.index_copy_(0, slot, self._clock)
                self._clock.add_(1)
            step_amax = self._step_amax
            assert step_amax is not None  # allocated with the modules
            for t in _floats(output):
                amax = t.detach().abs().amax().float().reshape(1).to(step_amax.device)
                # maximum() propagates NaN, so a NaN output stays non-finite
                merged = torch.maximum(step_amax.index_select(0, slot), amax)
                step_amax.index_copy_(0, slot, merged)

        return hook

    @property
    def step(self) -> int:
        """Optimizer steps completed (skipped ones included)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self._due_flag.fill_(1.0 if self.due else 0.0)  # no sync: a write to the device

    @property
    def due(self) -> bool:
        """Whether the step in progress closes a report (every ``interval`` steps)."""
        return (self._step + 1) % self.interval == 0

    # ------------------------------------------------------------------ the step
    def before_step(self) -> None:
        """At a reporting step, before unscaling: the underflow fraction of each parameter's
        gradient, read while it still holds the scaled values. One read per gradient, only at
        reporting steps; no host sync."""
        if not self.due or not self.params:
            return
        fractions = []
        for _, p in self.params:
            g = p.grad
            if g is None:
                fractions.append(torch.zeros((), device=self._device()))
                continue
            local = g.to_local() if hasattr(g, "to_local") else g
            if id(p) in self._row_sparse and local.dim() == 2 and not local.is_sparse:
                low = self._looked_up_underflow(local.detach().abs())
            else:
                n = max(local.numel(), 1)
                low = (local.detach().abs() < self.tiny).sum(dtype=torch.float32) / n
            fractions.append(low.to(self._device()))
        self._underflow = torch.stack(fractions)

    def _looked_up_underflow(self, a: torch.Tensor) -> torch.Tensor:
        """An embedding's underflow fraction over the rows with a nonzero element (the rows the
        step looked up; a row-sharded weight's local rows alike). 0 when no row was: nothing
        there to lose."""
        rows = (a > 0).any(dim=1, keepdim=True)
        low = ((a < self.tiny) & rows).sum(dtype=torch.float32)
        return low / (rows.sum(dtype=torch.float32) * a.shape[1]).clamp(min=1.0)

    def _device(self) -> torch.device:
        if self._step_amax is not None:
            return self._step_amax.device
        return self.params[0][1].device if self.params else torch.device("cpu")

    def payload(self) -> torch.Tensor | None:
        """The scaler's rider protocol: this step's local statistics, once per step."""
        if self._sent or self._step_amax is None:
            return None
        self._sent = True
        bad = (~torch.isfinite(self._step_amax)).float()
        if not self.due:
            return bad
        assert self._window_amax is not None
        amax = torch.nan_to_num(
            torch.maximum(self._window_amax, self._step_amax), nan=float("inf"), posinf=float("inf")
        )
        under = self._underflow
        if under is None:
            under = torch.zeros(len(self.params), device=bad.device)
        stats = torch.cat([amax, under.to(bad.device), self._flush.to(bad.device)])
        self._local_stats = stats  # kept apart: the collective reduces a copy of the payload
        return torch.cat([bad, stats])

    def deliver(self, reduced: torch.Tensor, op: str, ranks: int) -> None:
        """The scaler's rider protocol: the payload, reduced over the agreeing ranks."""
        m = len(self.modules)
        self._agreed_bad = reduced[:m] > 0
        if reduced.numel() > m:
            stats = reduced[m:].clone()
            if op == "sum" and ranks > 1:
                stats = stats / ranks
            self._agreed_stats = stats

    def _first_bad(self) -> torch.Tensor:
        """On device: the index of the first agreed non-finite module, in completion order."""
        assert self._agreed_bad is not None
        perm = torch.argsort(self._stamp, stable=True).to(self._agreed_bad.device)
        bad = self._agreed_bad[perm]
        first = torch.where(bad.any(), perm[bad.to(torch.int8).argmax()], -1)
        if self.blamed_upstream is not None:
            first = torch.where(self.blamed_upstream.to(first.device), -1, first)
        return first

    @property
    def capacity(self) -> int:
        """The most floats :meth:`payload` sends in a step (at a reporting step)."""
        return 2 * len(self.modules) + len(self.params) + len(self._fp8)

    def end_step(self, skipped: torch.Tensor) -> NumericStats | None:
        """After ``update()``: record which module the (agreed) skip is blamed on, and at a
        reporting step read the agreed statistics (one host sync) and return them."""
        due = self.due
        if self._step_amax is not None:
            if not self._sent or self._agreed_bad is None:
                # no collective ran this step (nothing to agree with): the local numbers rule
                payload = self.payload() if not self._sent else None
                if payload is not None:
                    self.deliver(payload, "max", 1)
            first = self._first_bad()
            # -2: not skipped; -1: skipped with a finite forward; else the blamed module
            self._firsts.append(torch.where(skipped.to(first.device), first, -2))
            assert self._window_amax is not None
            torch.maximum(self._window_amax, self._step_amax, out=self._window_amax)
            self._step_amax.zero_()
        self.step += 1
        self._sent, self._agreed_bad, self.blamed_upstream = False, None, None
        if not due:
            return None
        return self._report()

    def _report(self) -> NumericStats:
        start = self.step - len(self._firsts)
        firsts = torch.stack(self._firsts).tolist() if self._firsts else []  # host sync
        skips = tuple(
            (start + k + 1, None if i < 0 else self.names[i])
            for k, i in enumerate(firsts)
            if i != -2
        )
        headroom, underflow, flush = self._named(self._agreed_stats)
        silent = self._silent()
        self.latest = NumericStats(self.step, headroom, underflow, skips, flush, silent)
        mine = self._named(self._local_stats)  # this rank's own numbers, before agreeing
        self.latest_local = NumericStats(self.step, mine[0], mine[1], skips, mine[2], silent)
        self._firsts, self._agreed_stats, self._underflow = [], None, None
        self._local_stats = None
        self._flush.zero_()
        if self._window_amax is not None:
            self._window_amax.zero_()
        return self.latest

    def _silent(self) -> tuple[str, ...]:
        """The watched modules no forward hook has fired for yet (their stamp is still "never"):
        host sync, at a reporting step only (the report reads the device anyway)."""
        if not self.modules:
            return ()
        never = torch.iinfo(torch.int64).max
        unseen = (self._stamp == never).tolist()  # host sync: reporting step
        return tuple(n for n, u in zip(self.names, unseen, strict=True) if u)

    def _named(
        self, stats: torch.Tensor | None
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """``(headroom, underflow, fp8_flush)`` by name from a ``[M + P + F]`` statistics
        vector (host sync); empty dicts for ``None``."""
        if stats is None:
            return {}, {}, {}
        m, values, fmax = len(self.modules), stats.tolist(), self._fmax.tolist()
        headroom = {n: values[i] / fmax[i] for i, n in enumerate(self.names)}
        underflow = {n: values[m + j] for j, (n, _) in enumerate(self.params)}
        base = m + len(self.params)
        flush = {self.names[i]: values[base + k] for k, i in enumerate(self._fp8)}
        return headroom, underflow, flush

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to report the same numbers: the step and the partial
        window (host sync)."""
        return {
            "step": self.step,
            "firsts": [int(t) for t in self._firsts],
            "window_amax": None if self._window_amax is None else self._window_amax.tolist(),
        }

    def check_state_dict(self, state: Any) -> None:
        """Check a :meth:`state_dict` against this monitor (``ValueError`` naming the field);
        changes nothing. The window must hold one value per watched module of this model."""
        if not isinstance(state, dict) or set(state) != {"step", "firsts", "window_amax"}:
            raise ValueError(
                "numeric monitor state must be a dict with keys 'firsts', 'step' and "
                f"'window_amax', got {state!r:.200}"
            )
        step = state["step"]
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
            raise ValueError(f"monitor 'step' must be an int in [0, 2**63 - 1], got {step!r}")
        m = len(self.modules)
        firsts = state["firsts"]
        if not isinstance(firsts, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and -2 <= i < m for i in firsts
        ):
            raise ValueError(
                f"monitor 'firsts' must be a list of module indices in [-2, {m - 1}] (-2: not "
                f"skipped, -1: no module blamed), got {firsts!r:.200}"
            )
        if len(firsts) > step:
            raise ValueError(f"monitor 'firsts' has {len(firsts)} entries for {step} steps")
        amax = state["window_amax"]
        if amax is not None and (
            not isinstance(amax, list)
            or len(amax) != m
            or not all(isinstance(x, float) for x in amax)
        ):
            raise ValueError(
                f"monitor 'window_amax' must be None or {m} floats (one per watched module of "
                f"this model), got {amax!r:.200}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; checked first (:meth:`check_state_dict`), so a refused
        state changes nothing."""
        self.check_state_dict(state)
        self.step = int(state["step"])
        self._firsts = [torch.tensor(i) for i in state["firsts"]]
        if state["window_amax"] is not None:
            self._window_amax = torch.tensor(state["window_amax"], device=self._device())
            self._step_amax = torch.zeros_like(self._window_amax)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []
