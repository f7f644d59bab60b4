"""FP8 training: the Linear layers a precision policy selects run as torchao float8 layers.

``precision="fp8"`` means: the matmuls of the *selected* ``nn.Linear`` layers run in float8
(``torchao.float8.convert_to_float8_training``: dynamic scaling, e4m3 forward, e5m2 gradients
with the tensorwise recipe), and everything else runs under bf16 autocast exactly as with
``precision="bf16"``. Parameters stay fp32 (master weights), so the state dict is the bf16 run's.

Which Linear layers: :func:`distamp.precision.fp8_select.plan_linears` (the policy alone decides;
the
audit shows the same decisions). torchao's version range and import:
:mod:`distamp.precision.fp8_torchao`.
Both are re-exported here.

FSDP2/HSDP: weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``, tensorwise
recipe only) and :meth:`Float8Training.after_step` computes every weight's scale in ONE
all-reduce after each optimizer step, over the ranks that shard each weight, on any mesh
(:class:`distamp.precision.fp8_parallel.WeightScales`); without it each weight's all-gather would
do its
own amax all-reduce. DDP and FSDP1: float8 compute only.

Models parallelised by hand (tensor, pipeline, expert parallel; ``DistAMP(mesh=...)``): convert
FIRST with :func:`convert_for_fp8`, then parallelise
(:func:`distamp.precision.fp8_parallel.fp8_tp_plan`
gives the float8 tensor-parallel styles), then hand the model to the engine.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.reduction import FlagReducer
from distamp.agreement.topology import agreement_group
from distamp.cluster import is_distributed
from distamp.model_names import model_name
from distamp.precision.fp8_parallel import WeightScales, is_float8_linear
from distamp.precision.fp8_select import (
    DEFAULT_MIN_FEATURES,
    FP8_RECIPES,
    Float8Settings,
    LinearChoice,
    plan_linears,
)
from distamp.precision.fp8_torchao import (
    TORCHAO_RANGE,
    check_device,
    fp8_support,
    require_torchao,
    torchao_version_tested,
)

if TYPE_CHECKING:
    from distamp.observe.diagnostics import OverflowReport
    from distamp.precision.policy import AutocastPolicy

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FP8_RECIPES",
    "TORCHAO_RANGE",
    "Float8Settings",
    "Float8Training",
    "LinearChoice",
    "SaturatedLayer",
    "convert_for_fp8",
    "fp8_support",
    "install_compile_guard",
    "plan_linears",
    "require_torchao",
    "torchao_version_tested",
]


@dataclass(frozen=True)
class SaturatedLayer:
    """An fp8 layer whose float8 GEMM produced a non-finite result at the reported step."""

    layer: str
    tensor: str  # "weight.grad", or "output" (the forward tracer's first non-finite output)
    kind: str  # "inf", "nan", "inf+nan" or "non-finite"
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        where = f", rank {','.join(map(str, self.ranks))}" if self.ranks else ""
        return f"{self.layer} ({self.tensor} {self.kind}{where})"


@dataclass
class Float8Training:
    """The fp8 side of a model in training: what was converted, and the per-step hooks.

    Built by :meth:`convert` before the model is parallelised (or by :meth:`adopt` for a model
    the user converted and parallelised); the engine then calls :meth:`after_wrap` once,
    :meth:`after_step` after every optimizer step and after loading a checkpoint, and
    :meth:`annotate` when reporting a skipped step.
    """

    settings: Float8Settings
    choices: list[LinearChoice]
    adopted: bool = False  # converted by the user before parallelising (see adopt)
    scales: WeightScales | None = None
    _hooks: list[Any] = field(default_factory=list, repr=False)

    @property
    def converted(self) -> list[str]:
        """Names of the Linear layers that run in fp8."""
        return [c.name for c in self.choices if c.fp8]

    @classmethod
    def convert(
        cls, model: nn.Module, policy: AutocastPolicy, *, strategy: str, device: torch.device
    ) -> Float8Training:
        """Swap the Linear layers :func:`plan_linears` selects for torchao ``Float8Linear``.

        In place, before wrapping (``fully_shard`` must see the float8 weights to gather them
        in float8). Parameter names and objects are unchanged (``weight``/``bias``), except
        that with float8 all-gather the weights are re-wrapped (FSDP rebuilds the optimizer
        by name anyway).

        Args:
            model: the unwrapped model, on ``device``.
            policy: an fp8 policy.
            strategy: the resolved strategy; float8 all-gather only for "fsdp2"/"hsdp".
            device: the training device (CUDA must be compute capability 8.9+).

        Raises:
            ImportError: torchao missing or outside the tested range.
            RuntimeError: the float8 GEMM (``fp8_gemm="scaled_mm"``, or "auto" on CUDA) on a
                CUDA device without float8 support, or on the CPU with the rowwise recipe and
                torch < 2.12; the emulation (``"emulated"``, "auto" on the CPU) runs anywhere.
            ValueError: a name pattern of ``policy`` that matches nothing in ``model``.
        """
        ao = require_torchao()
        settings = policy.fp8
        assert settings is not None, "convert() needs an fp8 policy"
        emulated = settings.emulated(device)
        if not emulated:
            check_device(device, settings.recipe)
        policy.check_patterns(model)  # a misspelt pattern refused before any layer is swapped
        choices = plan_linears(model, policy)
        selected = {c.name for c in choices if c.fp8}
        all_gather = (
            strategy in ("fsdp2", "hsdp")
            and settings.fsdp_float8_all_gather
            and settings.recipe == "tensorwise"
        )
        config = (
            ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise + gather
            if all_gather
            else ao.Float8LinearConfig.from_recipe_name(settings.recipe)
        )
        if emulated:  # the same float8 operands and scales, multiplied in fp32
            config = replace(config, emulate=True)
        ao.convert_to_float8_training(
            model,  # torchao's fqn spells the wrappers' parts; the choices are model names
            module_filter_fn=lambda _m, fqn: model_name(fqn, model) in selected,
            config=config,
        )
        state = cls(settings, choices, _hooks=_add_input_casts(model))
        if not selected and (not is_distributed() or dist.get_rank() == 0):
            why = "; ".join(str(c) for c in choices[:4]) or "the model has no nn.Linear"
            warnings.warn(
                f"precision='fp8': no Linear layer qualifies for float8 ({why}), so the model "
                "trains as bf16. Lower fp8_min_features (AutocastPolicy('fp8', "
                "fp8_min_features=...)) if its layers are meant to run in fp8.",
                RuntimeWarning,
                stacklevel=3,
            )
        return state

    @classmethod
    def adopt(cls, model: nn.Module, policy: AutocastPolicy) -> Float8Training:
        """The fp8 side of a model whose Linear layers were converted (by :func:`convert_for_fp8`
        or torchao) before the user parallelised it: its ``Float8Linear`` layers run in fp8,
        the other Linear layers are reported with the policy's reason or as not converted.

        A rank may hold no float8 layer (a pipeline stage of excluded layers); only when no rank
        of the job holds one does :meth:`after_wrap` raise ``ValueError`` (on every rank alike):
        then the model was parallelised before it was converted.
        """
        require_torchao()
        policy.check_patterns(model)
        settings = policy.fp8
        assert settings is not None, "adopt() needs an fp8 policy"
        choices = [
            c
            if not c.fp8 or c.reason.startswith("already")
            else replace(c, fp8=False, reason="not converted before parallelising")
            for c in plan_linears(model, policy)
        ]
        return cls(settings, choices, adopted=True, _hooks=_add_input_casts(model))

    def after_wrap(
        self,
        model: nn.Module,
        *,
        strategy: str,
        device: torch.device,
        reducer: FlagReducer | None = None,
    ) -> None:
        """Once, after the strategy wrapped ``model`` (on every rank of ``reducer``, default the
        whole job: collective):
        which weights FSDP2 gathers in float8 and their first scales (so even the first step
        gathers with one all-reduce), and the compile guard for DDP on CUDA."""
        reducer = reducer if reducer is not None else agreement_group(None)
        if self.adopted:
            _require_float8_somewhere(len(self.converted), reducer)
        self.scales = WeightScales([model], reducer)
        self.after_step(model)
        if strategy == "ddp" and device.type == "cuda":
            # On every float8 layer, so that compiling the DDP wrapper or the model inside it
            # is caught alike.
            for module in model.modules():
                if is_float8_linear(module):
                    self._hooks += install_compile_guard(module, _DDP_COMPILE)

    def after_step(self, model: nn.Module) -> None:
        """After each optimizer step (skipped or not) and after loading a checkpoint: every
        float8-gathered weight's scale from its new amax, in one all-reduce over the weights of
        every mesh (:class:`~distamp.precision.fp8_parallel.WeightScales`); nothing when no weight
        is
        gathered in float8. No host sync.

        A skipped step leaves the weights as they were, so the scales come out the same; calling
        it unconditionally keeps the collectives of a step fixed and avoids reading the skip
        decision on the host.
        """
        if self.scales is None:
            self.scales = WeightScales([model])
        self.scales.update()

    def saturation(self, report: OverflowReport) -> list[SaturatedLayer]:
        """The fp8 layers of a skipped step whose float8 GEMMs saturated, from ``report``.

        With dynamic scaling a finite amax always fits: the scale maps it onto the float8
        maximum. A non-finite amax makes the scale 0 (or NaN) and the cast turns the WHOLE
        operand into NaN, so one inf in an activation or gradient poisons every output of that
        GEMM, not a row of it. torchao keeps no amax, and the gradients are gone by the time a
        report is read, so the evidence is what the scaler already recorded for free: the
        per-gradient non-finite flags of the skipped step (a layer's weight gradient is the
        float8 product of its input and output gradient), plus the first non-finite forward
        output when a :class:`~distamp.observe.diagnostics.NonFiniteTracer` ran. No collective, no
        extra pass over any tensor.
        """
        layers = set(self.converted)
        found = []
        for entry in report.entries:  # the bias gradient is no float8 product: left out
            if entry.module in layers and entry.parameter.endswith(".weight"):
                found.append(SaturatedLayer(entry.module, "weight.grad", entry.kind, entry.ranks))
        first = (report.forward or "").split(" (rank")[0]
        if first in layers:
            found.insert(0, SaturatedLayer(first, "output", "non-finite", ()))
        return found

    def annotate(self, report: OverflowReport | None) -> OverflowReport | None:
        """``report`` with :meth:`saturation` in ``extra["fp8_saturated"]`` (which
        :meth:`~distamp.observe.diagnostics.OverflowReport.one_line` prints), forward first, then in
        model order."""
        if report is None:
            return None
        saturated = self.saturation(report)
        if not saturated:
            return report
        return replace(report, extra={**report.extra, "fp8_saturated": [str(x) for x in saturated]})

    def remove(self) -> None:
        """Remove the hooks :meth:`convert` and :meth:`after_wrap` added."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _require_float8_somewhere(local: int, reducer: FlagReducer) -> None:
    """Raise on every rank alike when no rank of ``reducer`` holds a float8 layer (a collective:
    one rank raising alone would leave the others waiting in their next collective)."""
    count = torch.tensor([float(local)], device=reducer.device_for(torch.device("cpu")))
    if not reducer.is_noop:
        reducer.all_reduce_max_(count)
    if count.item() == 0:
        raise ValueError(
            "precision='fp8' with a model you parallelised yourself (mesh=, a pipeline stage, "
            "wrappers or DTensor parameters) and no float8 layer on any rank: float8 layers "
            "must replace the Linear layers BEFORE parallelize_module/fully_shard/DDP see them. "
            "Call distamp.fp8.convert_for_fp8(model, policy, fully_sharded=...) first (and "
            "distamp.fp8_parallel.fp8_tp_plan for tensor parallel plans), or let the engine "
            "wrap an unparallelised model (strategy='ddp', 'fsdp2' or 'hsdp')"
        )


def convert_for_fp8(
    model: nn.Module,
    policy: AutocastPolicy | str = "fp8",
    *,
    fully_sharded: bool = False,
    device: torch.device | str | None = None,
) -> Float8Training:
    """Convert the Linear layers ``policy`` selects to float8, before you parallelise ``model``.

    For models parallelised by hand (``parallelize_module``, ``fully_shard`` on a sub-mesh,
    pipeline stages): ``fully_shard`` and the tensor-parallel styles must see the float8 layers,
    so the conversion comes first. Then parallelise (use
    :func:`distamp.precision.fp8_parallel.fp8_tp_plan` for the TP plan) and pass the model to
    ``DistAMP(precision=policy, mesh=...)``, which precomputes the float8 weight scales after
    every step. Pipeline jobs: convert the whole model (or each stage's module) with the same
    policy on every rank, so that the same layers run in fp8 everywhere.

    Args:
        model: the unparallelised model (or pipeline stage module), on its training device.
        policy: an fp8 :class:`~distamp.AutocastPolicy` or ``"fp8"``.
        fully_sharded: FSDP2/HSDP will shard it: gather the selected weights in float8 (when the
            policy's ``fsdp_float8_all_gather`` and the tensorwise recipe allow).
        device: the training device, to refuse GPUs without float8 support; default: the
            device of the model's first parameter.

    Returns:
        What was converted (``.converted``, ``.choices``).

    Raises:
        ValueError: ``policy`` is not fp8; ImportError: torchao missing or untested;
        RuntimeError: a CUDA device without float8 support.
    """
    from distamp.precision.policy import AutocastPolicy

    if isinstance(policy, str):
        policy = AutocastPolicy(policy)
    if policy.fp8 is None:
        raise ValueError(
            f"convert_for_fp8: not an fp8 policy: pass AutocastPolicy('fp8', ...) or 'fp8' "
            f"(got {policy.short()})"
        )
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    strategy = "fsdp2" if fully_sharded else "none"
    return Float8Training.convert(model, policy, strategy=strategy, device=torch.device(device))


# The float8 layers that carry the CPU input cast: one hook per layer, whichever Float8Training
# installed it first (convert_for_fp8's, then the engine's adopt of the same model). Kept here,
# not as a mark set on torchao's modules.
_INPUT_CAST: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _add_input_casts(model: nn.Module) -> list[Any]:
    """Put :func:`_cast_to_cpu_autocast` on every float8 layer of ``model`` that has none yet;
    return the new hook handles. First among the pre-hooks: a tensor-parallel style's input
    hook, registered later, must see the cast activation."""
    hooks = []
    for module in model.modules():
        if is_float8_linear(module) and module not in _INPUT_CAST:
            _INPUT_CAST.add(module)
            hooks.append(module.register_forward_pre_hook(_cast_to_cpu_autocast, prepend=True))
    return hooks


def _cast_to_cpu_autocast(_module: nn.Module, args: tuple[Any, ...]) -> Any:
    """Cast a CPU fp32 input to CPU autocast's dtype, as Float8Linear does under CUDA autocast.

    torchao's ``Float8Linear.forward`` casts its input only when ``torch.is_autocast_enabled()``
    (CUDA's autocast) is on (checked: torchao 0.18, torch 2.13). On CPU the input would stay
    fp32: its amax and the tensor saved for backward would differ from a CUDA run's.
    """
    x = args[0] if args else None
    if (
        isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.is_autocast_enabled("cpu")
    ):
        return (x.to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


_DDP_COMPILE = (
    "torch.compile of a DistributedDataParallel model with float8 Linear layers on CUDA is "
    "refused: it fails upstream (pytorch/pytorch#158936). Use strategy='fsdp2' (float8 "
    "all-gather; compile works there), or keep DDP and run the model without torch.compile."
)


def install_compile_guard(model: nn.Module, message: str) -> list[Any]:
    """Make ``torch.compile`` of ``model`` raise ``RuntimeError(message)`` at its first call.

    A forward pre-hook on ``model`` checks ``torch.compiler.is_compiling()``: while Dynamo
    traces the hook that is True, and the call to a ``torch.compiler.disable``-d function runs
    eagerly, so the error reaches the caller instead of being traced into a graph. Eager calls
    cost one Python check.

    Returns:
        The hook handles.
    """

    @torch.compiler.disable
    def refuse() -> None:
        raise RuntimeError(message)

    def hook(_module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            refuse()

    return [model.register_forward_pre_hook(hook)]
