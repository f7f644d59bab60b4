"""Which module of a trained model computes in which dtype once exported, and why.

Training decided it already: the policy's fp32 islands (:class:`~distamp.AutocastPolicy`'s
``fp32_modules``), the promotions its adaptive rules made (the :class:`PrecisionChange` log kept in
the engine's checkpoints), and which Linear layers ran in float8. A :class:`PrecisionPlan` gathers
those decisions from their sources, adds the ones the export check makes (``auto_islands``), and
is written next to the exported program, so that a reader of the artifact knows what is fp32 and
why without the training code.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from distamp.model_names import named_model_modules
from distamp.precision.adaptive import PrecisionChange
from distamp.precision.fp8_parallel import is_float8_linear
from distamp.precision.fp8_select import plan_linears
from distamp.precision.policy import (
    DEFAULT_FP32_MODULES,
    AutocastPolicy,
    PrecisionLike,
    parse_precision,
)

__all__ = ["SOURCES", "ModuleDecision", "PrecisionPlan", "adaptive_changes", "as_policy"]

SOURCES = ("policy", "adaptive", "auto_islands", "fp8_fallback")
"""Why a module computes in another dtype than the compute dtype: one of the policy's fp32
modules, a promotion of the adaptive rules in training, a promotion of the export check
(``auto_islands=True``), or a float8 Linear exported as its bf16 fallback."""

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class ModuleDecision:
    """One module that does not simply compute in the policy's compute dtype.

    Attributes:
        module: the qualified name (as in ``named_modules``; ``""`` is the model itself).
        dtype: ``"float32"`` (an fp32 island: parameters, inputs and compute in fp32) or
            ``"bfloat16"`` (a float8 Linear exported as a bf16 linear).
        source: one of :data:`SOURCES`.
        reason: the decision in words (the policy's spec that matched, the adaptive change's
            step and reason, what the export check measured).
    """

    module: str
    dtype: str
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.module or '<model>'}: {self.dtype} ({self.source}: {self.reason})"


def as_policy(policy: AutocastPolicy | PrecisionLike) -> AutocastPolicy:
    """An :class:`~distamp.AutocastPolicy` from a policy or a precision spelling (``"fp16"``:
    the default policy of that precision, normalization layers and the fp32 ops in fp32)."""
    if isinstance(policy, AutocastPolicy):
        return policy
    try:
        return AutocastPolicy(parse_precision(policy))
    except ValueError as exc:
        raise ValueError(
            f"policy={policy!r}: pass a distamp.AutocastPolicy or a precision ('fp16', 'bf16', "
            f"'fp8', 'fp32'); {exc}"
        ) from None


def adaptive_changes(trainer_state: Mapping[str, Any] | None) -> list[PrecisionChange]:
    """The adaptive rules' change log from an engine checkpoint's trainer state (every pipeline
    stage's, when the run had stages), oldest first; empty when the run had no rules."""
    run = (trainer_state or {}).get("adaptive")
    if not isinstance(run, Mapping):
        return []
    parts = list(run["stages"].values()) if isinstance(run.get("stages"), Mapping) else [run]
    changes = []
    for part in parts:
        adaptive = part.get("adaptive") if isinstance(part, Mapping) else None
        for entry in (adaptive or {}).get("changes", []):
            changes.append(PrecisionChange(**entry))
    return sorted(changes, key=lambda c: c.step)


def _policy_reason(policy: AutocastPolicy, name: str, module: nn.Module) -> str:
    """Which of the policy's ``fp32_modules`` entries made ``module`` an island."""
    for spec in policy.fp32_modules:
        if isinstance(spec, str):
            if fnmatch.fnmatchcase(name, spec) or fnmatch.fnmatchcase(type(module).__name__, spec):
                return f"fp32_modules pattern {spec!r}"
        elif isinstance(module, spec):
            if spec in DEFAULT_FP32_MODULES:
                return (
                    f"{spec.__name__}, a normalization layer: its statistics lose most in 16 bits"
                )
            return f"fp32_modules entry {spec.__name__}"
    return "one of the policy's fp32_modules"


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes of one export: the compute dtype and every module that differs from it.

    Build it with :meth:`from_training`; :meth:`promote` returns a new plan with one more fp32
    island (the export check's ``auto_islands``).

    Attributes:
        precision: the policy's precision name (``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp32"``).
        compute_dtype: the dtype everything else computes in (bf16 for ``"fp8"``; fp32 for
            ``"fp32"``, where nothing is cast).
        decisions: the modules that differ, outermost first (a module inside an fp32 island is
            covered by it and not listed).
        fp32_ops: the op names that run in fp32 wherever they are called (the policy's).
    """

    precision: str
    compute_dtype: torch.dtype
    decisions: tuple[ModuleDecision, ...] = ()
    fp32_ops: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_training(
        cls,
        model: nn.Module,
        policy: AutocastPolicy,
        promotions: Iterable[PrecisionChange] = (),
    ) -> PrecisionPlan:
        """The decisions training made for ``model``: the policy's islands, then the adaptive
        changes replayed in order (a demoted module is low precision again), then, with
        precision ``"fp8"``, the Linear layers that ran in float8 (exported in bf16).

        Raises:
            ValueError: a promotion names a module ``model`` does not have (the log belongs to
                another model), or a policy pattern matches nothing (as in training).
        """
        policy.check_patterns(model)
        modules = dict(named_model_modules(model))
        compute = policy.compute_dtype or torch.float32
        decisions: dict[str, ModuleDecision] = {}
        if policy.compute_dtype is not None:
            for name, module in policy.fp32_modules_of(model):
                reason = _policy_reason(policy, name, module)
                decisions[name] = ModuleDecision(name, "float32", "policy", reason)
        for change in promotions:
            if change.module not in modules:
                raise ValueError(
                    f"promotion {change}: the model has no module {change.module!r}; the change "
                    "log belongs to another model (export the model the run trained)"
                )
            held = decisions.get(change.module)
            if held is not None and held.source == "policy":
                continue  # fp32 by the policy: the rules never change those
            if change.after == "fp32":
                why = f"promoted at step {change.step}: {change.reason}"
                decisions[change.module] = ModuleDecision(change.module, "float32", "adaptive", why)
            elif change.before == "fp32":  # demoted: back to the low format
                decisions.pop(change.module, None)
        if policy.fp8 is not None:
            for choice in plan_linears(model, policy):
                fp8 = choice.fp8 or is_float8_linear(modules[choice.name])
                if fp8 and choice.name not in decisions:
                    why = (
                        "trained in float8 (" + choice.reason + "); exported as its bf16 "
                        "fallback: the float8 matmul is not exported"
                    )
                    decisions[choice.name] = ModuleDecision(
                        choice.name, "bfloat16", "fp8_fallback", why
                    )
        ordered = [decisions[n] for n in modules if n in decisions]
        return cls(
            precision=policy.precision.name,
            compute_dtype=compute,
            decisions=_outermost(ordered),
            fp32_ops=policy.fp32_ops if policy.compute_dtype is not None else frozenset(),
        )

    @property
    def fp32_modules(self) -> tuple[str, ...]:
        """The fp32 islands' names, outermost first."""
        return tuple(d.module for d in self.decisions if d.dtype == "float32")

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype module ``name`` computes in (an island's covers everything inside it)."""
        dtype = self.compute_dtype
        for decision in self.decisions:
            inside = decision.module == "" or name == decision.module
            inside = inside or name.startswith(decision.module + ".")
            if inside and decision.dtype == "float32":
                return torch.float32
            if name == decision.module:
                dtype = torch.bfloat16
        return dtype

    def promote(self, name: str, reason: str) -> PrecisionPlan:
        """This plan with ``name`` an fp32 island found by the export check."""
        added = ModuleDecision(name, "float32", "auto_islands", reason)
        return replace(self, decisions=_outermost([*self.decisions, added]))

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what is written next to the exported program)."""
        return {
            "precision": self.precision,
            "compute_dtype": _DTYPE_NAMES[self.compute_dtype],
            "modules": [asdict(d) for d in self.decisions],
            "fp32_ops": sorted(self.fp32_ops),
        }

    def describe(self) -> str:
        """One line per module that differs from the compute dtype."""
        head = f"{self.precision}: compute in {_DTYPE_NAMES[self.compute_dtype]}"
        return "\n".join([head, *(f"  {d}" for d in self.decisions)])


def _outermost(decisions: Sequence[ModuleDecision]) -> tuple[ModuleDecision, ...]:
    """Drop decisions inside an fp32 island (it covers them), keeping the order."""
    islands = [d.module for d in decisions if d.dtype == "float32"]

    def covered(d: ModuleDecision) -> bool:
        return any(i != d.module and (i == "" or d.module.startswith(i + ".")) for i in islands)

    return tuple(d for d in decisions if not covered(d))
