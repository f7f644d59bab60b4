"""Which Linear layers run in fp8: a pure decision from the precision policy (no torchao needed).

:func:`plan_linears` decides, from the policy alone, before anything is converted, and the
audit shows the same decisions. A layer stays in bf16 when

1. it is (inside) one of the policy's fp32 islands: the policy promised fp32 there;
2. its name matches ``fp8_exclude`` (e.g. an output head, whose logits feed the loss);
3. its in/out features are not multiples of 16: float8 GEMMs (``torch._scaled_mm``) require it;
4. in or out features are below ``fp8_min_features`` (default :data:`DEFAULT_MIN_FEATURES`):
   scaling and casting cost a pass over each operand, which small GEMMs do not earn back.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from distamp.arguments import INT64_MAX
from distamp.model_names import named_model_modules
from distamp.precision.fp8_parallel import is_float8_linear
from distamp.precision.settings import Fields

__all__ = [
    "DEFAULT_MIN_FEATURES",
    "FP8_GEMMS",
    "FP8_RECIPES",
    "Float8Settings",
    "Fp8Policy",
    "LinearChoice",
    "plan_linears",
]

FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
"""torchao's recipes: one scale per tensor (cuBLAS kernel; the only one with float8 FSDP
all-gather), or one per row (CUTLASS kernel, more accurate, power-of-2 scales)."""

FP8_GEMMS: tuple[str, ...] = ("auto", "scaled_mm", "emulated")
"""How a float8 layer multiplies: ``"scaled_mm"``, the float8 GEMM (``torch._scaled_mm``: float8
tensor cores on CUDA); ``"emulated"``, the same float8 operands and scales multiplied in fp32
(torchao's ``emulate``: the rounding to float8 is identical, only the accumulation order
differs); ``"auto"`` (default), the GEMM on CUDA and the emulation on the CPU. A CPU runs
``_scaled_mm`` through oneDNN, whose float8 matmul is a fast kernel only on CPUs with AMX-FP16
and a scalar reference kernel elsewhere: 6 s for one 1024x256x1024 product on a Sapphire Rapids
core against 4 ms in bf16, so training through it on such a CPU takes minutes a step. The
emulation makes the CPU run the same for every CPU and every rank alike."""

DEFAULT_MIN_FEATURES = 2048
"""A Linear runs in fp8 only when both its in and out features are at least this.

torchao's own H100 microbenchmark (torchao/float8/README.md, torch.compile on) has a float8
linear at 0.80x the speed of bf16 at M, K, N = 1024, 2048, 1024 and 1.39x at 4096, 8192, 16384:
below about 2048 features the scaling and casting passes cost more than the faster GEMM saves.
torchao's tensorwise auto-filter draws a similar line (skips K <= 4096 with N <= 1024). The
threshold cannot see the token count M, so it is a per-model knob (``fp8_min_features``);
``benchmarks/fp8.py`` measures where it sits on the machine at hand."""

_FP8_ALIGN = 16  # torch._scaled_mm: both GEMM dims of each operand must be multiples of 16


@dataclass(frozen=True, kw_only=True)
class Float8Settings:
    """How ``precision="fp8"`` selects and runs Linear layers (held by an AutocastPolicy).

    Attributes:
        recipe: ``"tensorwise"`` (default) or ``"rowwise"`` (see :data:`FP8_RECIPES`).
        min_features: both in and out features must be at least this for a Linear to run in
            fp8, a whole number in ``[0, 2**63 - 1]`` (see :data:`DEFAULT_MIN_FEATURES` for why
            the default is 2048).
        exclude: a sequence of name patterns (``fnmatch`` on the qualified name, e.g.
            ``"head"``, ``"blocks.0.*"``) of Linear layers kept in bf16; one string is refused,
            and each must match a Linear layer of the model (:mod:`distamp.precision.patterns`).
        fsdp_float8_all_gather: a ``bool``: under FSDP2/HSDP, all-gather the selected weights
            in float8 (half of bf16's bytes). Tensorwise only: torchao has no rowwise float8
            all-gather, so with ``recipe="rowwise"`` the weights are gathered in bf16.
        gemm: how the float8 layers multiply, one of :data:`FP8_GEMMS` (default ``"auto"``:
            the float8 GEMM on CUDA, its fp32 emulation on the CPU).
    """

    recipe: str = "tensorwise"
    min_features: int = DEFAULT_MIN_FEATURES
    exclude: tuple[str, ...] = ()
    fsdp_float8_all_gather: bool = True
    gemm: str = "auto"

    def __post_init__(self) -> None:
        # Named as AutocastPolicy's arguments, which build these settings.
        labels = {
            "min_features": "fp8_min_features",
            "exclude": "fp8_exclude",
            "gemm": "fp8_gemm",
        }
        f = Fields(self, {"recipe": "recipe", "fsdp_float8_all_gather": "fp8_all_gather", **labels})
        f.choice("recipe", FP8_RECIPES)
        f.whole("min_features", 0, INT64_MAX)
        f.patterns("exclude", "head", optional=False, empty=True)
        f.flag("fsdp_float8_all_gather")
        f.choice("gemm", FP8_GEMMS)

    def emulated(self, device: torch.device) -> bool:
        """Whether the float8 layers multiply in fp32 on ``device`` (see :data:`FP8_GEMMS`)."""
        if self.gemm == "auto":
            return device.type == "cpu"
        return self.gemm == "emulated"


@dataclass(frozen=True)
class LinearChoice:
    """Whether one Linear layer runs in fp8, and why (or why not)."""

    name: str
    in_features: int
    out_features: int
    fp8: bool
    reason: str

    def __str__(self) -> str:
        shape = f"{self.in_features}->{self.out_features}"
        return f"{self.name} ({shape}): {'fp8' if self.fp8 else 'bf16'}, {self.reason}"


class Fp8Policy(Protocol):
    """What :func:`plan_linears` reads of a precision policy (:class:`~distamp.AutocastPolicy`
    is one). The policy holds :class:`Float8Settings`, so this module names only the part of
    the policy it asks, rather than importing the policy back."""

    @property
    def fp8(self) -> Float8Settings | None:
        """The fp8 settings; ``None`` for a policy of another precision."""

    def fp32_modules_of(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs of ``model`` that run in fp32, outermost only."""

    def short(self) -> str:
        """The policy in a few words, for messages."""


def plan_linears(model: nn.Module, policy: Fp8Policy) -> list[LinearChoice]:
    """Decide, for every ``nn.Linear`` of ``model``, whether it runs in fp8 (no torchao needed).

    Pure: reads module types, names and shapes only. The rules and their order are the module
    docstring's. Layers that already are torchao ``Float8Linear`` are reported as fp8.

    Args:
        model: the unwrapped model (names as in its ``named_modules``).
        policy: an fp8 :class:`~distamp.AutocastPolicy` (its ``fp8`` settings and fp32 islands).

    Raises:
        ValueError: the policy's precision is not fp8.
    """
    settings = policy.fp8
    if settings is None:
        raise ValueError(
            f"not an fp8 policy: pass AutocastPolicy('fp8', ...) (got {policy.short()})"
        )
    islands: dict[int, str] = {}
    for name, module in policy.fp32_modules_of(model):
        for sub in module.modules():
            islands[id(sub)] = name or "<root>"
    choices = []
    for name, module in named_model_modules(model):
        if not isinstance(module, nn.Linear):
            continue
        k, n = module.in_features, module.out_features
        if is_float8_linear(module):
            fp8, why = True, "already a torchao Float8Linear"
        elif id(module) in islands:
            fp8, why = False, f"fp32 island of the policy ({islands[id(module)]})"
        elif any(fnmatch.fnmatchcase(name, p) for p in settings.exclude):
            fp8, why = False, "excluded by name (fp8_exclude)"
        elif k % _FP8_ALIGN or n % _FP8_ALIGN:
            fp8, why = False, "in/out features not multiples of 16 (float8 GEMMs need them)"
        elif min(k, n) < settings.min_features:
            fp8, why = False, f"smaller than fp8_min_features={settings.min_features}"
        else:
            fp8, why = True, f"{settings.recipe} float8"
        choices.append(LinearChoice(name, k, n, fp8, why))
    return choices
