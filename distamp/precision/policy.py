"""Precision policies: :class:`AutocastPolicy`, which modules and ops stay in fp32.

The precision vocabulary (:class:`Precision`, :func:`parse_precision`, :func:`select_mp_owner`)
lives in :mod:`distamp.precision.vocabulary` and is re-exported here, where callers have always
imported it from.

:class:`AutocastPolicy` says which modules and ops stay in fp32, identically on every device: CPU
autocast keeps softmax, layer_norm, exp, sum... in bf16/fp16 when their input is low precision,
while CUDA autocast runs them in fp32, so the same model would otherwise train with different
numerics on CPU and GPU.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from distamp.arguments import as_bool
from distamp.model_names import named_model_modules
from distamp.precision.adaptive import AdaptivePrecision, AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules, BackwardScales
from distamp.precision.fp8_select import Float8Settings
from distamp.precision.fsdp_settings import fsdp_mixed_precision
from distamp.precision.op_names import fp32_op_names
from distamp.precision.patterns import as_patterns, check_module_patterns, module_specs
from distamp.precision.regions import Fp32Ops, can_carry_region, region_of, release_region
from distamp.precision.settings import reduce_dtype_of
from distamp.precision.vocabulary import (
    VALID_PRECISIONS,
    MPOwner,
    Precision,
    PrecisionLike,
    parse_precision,
    select_mp_owner,
)
from distamp.torch_compat import compiled_backward_without_autocast

__all__ = [
    "VALID_PRECISIONS",
    "AutocastPolicy",
    "MPOwner",
    "Precision",
    "PrecisionLike",
    "parse_precision",
    "select_mp_owner",
]

# ---------------------------------------------------------------------------- precision policies

DEFAULT_FP32_MODULES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)
"""Normalization layers: their mean/variance reductions lose the most in 8 mantissa bits."""

DEFAULT_FP32_OPS: frozenset[str] = frozenset(
    {
        # normalization (functional forms, for models that call them directly)
        "layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "normalize",
        # softmax and friends: attention probabilities, log-likelihoods
        "softmax", "log_softmax", "logsumexp", "softmin",
        # losses
        "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
        "kl_div", "binary_cross_entropy_with_logits", "poisson_nll_loss",
        # reductions and transcendental ops that CUDA autocast runs in fp32
        "sum", "cumsum", "prod", "cumprod", "norm", "exp", "expm1", "log", "log1p", "log2",
        "log10", "pow", "rsqrt", "reciprocal", "softplus", "cosine_similarity", "cdist",
    }
)  # fmt: skip
"""Ops forced to fp32: the ones CUDA autocast runs in fp32 and CPU autocast does not (measured on
torch 2.13: softmax, log_softmax, layer_norm, group_norm, exp, sum and cumsum stay bf16 on CPU),
plus the losses. Matched by name, so ``torch.softmax``, ``F.softmax`` and ``Tensor.softmax`` all
count. ``F.scaled_dot_product_attention`` is one op, not a softmax: its kernels accumulate the
softmax in fp32 internally on both device types."""

ModuleSpec = type[nn.Module] | str
"""A module class (matched with ``isinstance``) or a pattern (``fnmatch``, matched against the
qualified name, e.g. ``"blocks.*.ln1"`` or ``"lm_head"``, and against the class name)."""


class AutocastPolicy:
    """Declarative precision: which modules and ops stay in fp32 under mixed precision.

    Autocast alone decides per op and per device type, so a model trains with different numerics
    on CPU and CUDA, and nothing says "keep this module in fp32" (FSDP1 keeps only BatchNorm;
    FSDP2's policy is per ``fully_shard`` unit). A policy states it once and is applied the same
    way everywhere: by :class:`~distamp.DistAMP` (``DistAMP(policy=...)``), or alone::

        policy = AutocastPolicy("bf16")
        policy.apply(model)                       # fp32 modules: autocast off inside them
        with policy.autocast("cpu"):              # autocast + fp32 ops
            loss = loss_fn(model(x), y)

    With ``"fp8"``, the Linear layers outside the fp32 modules that pass the fp8 rules run in
    float8 and everything else as under ``"bf16"`` (see :mod:`distamp.precision.fp8`); the fp32
    modules are never converted.

    Args:
        precision: the low-precision compute dtype (any :func:`parse_precision` spelling).
        fp32_modules: a sequence of module classes or name patterns (see :data:`ModuleSpec`;
            one string is refused) that run with autocast off. Default: the normalization
            layers. Each pattern must match a module when applied (:meth:`check_patterns`).
        fp32_ops: op names run in fp32 under autocast, a sequence of names as torch's functions
            carry them (``"softmax"``; a name that is none is refused, with the closest ones:
            :mod:`~distamp.precision.op_names`). Default: :data:`DEFAULT_FP32_OPS`.
        cast_inputs: a ``bool``: cast low-precision floating inputs of fp32 modules and ops to
            fp32. With ``False`` the regions only turn autocast off, so they compute in their
            inputs' dtype (for modules that manage their own casting).
        reduce_dtype: the floating dtype FSDP reduces gradients in. fp32 by default: the loss
            scaler then sees fp32 gradients and an fp16 reduction of scaled gradients cannot
            overflow.
        recipe: fp8 only: torchao's scaling recipe, ``"tensorwise"`` (default) or
            ``"rowwise"``.
        fp8_min_features: fp8 only: Linear layers with fewer in or out features stay in bf16
            (default :data:`distamp.precision.fp8_select.DEFAULT_MIN_FEATURES`, 2048).
        fp8_exclude: fp8 only: a sequence of name patterns of Linear layers kept in bf16 (e.g.
            ``("head",)``); each must match a Linear layer when applied.
        fp8_all_gather: fp8 only: under FSDP2/HSDP, all-gather the fp8 layers' weights in
            float8 (default True; tensorwise recipe only).
        fp8_gemm: fp8 only: how the float8 layers multiply, ``"auto"`` (default: the float8
            GEMM on CUDA, its fp32 emulation on the CPU), ``"scaled_mm"`` or ``"emulated"``
            (see :data:`distamp.precision.fp8_select.FP8_GEMMS`).
        adaptive: ``True`` or an :class:`~distamp.precision.adaptive.AdaptiveRules`: modules
            are promoted to fp32 when the agreed numbers say so (see
            :mod:`distamp.precision.adaptive`; driven by :class:`~distamp.DistAMP`).
        backward_scales: fp16 only, ``True`` or a
            :class:`~distamp.precision.backward_scales.BackwardScaleRules`: each block's
            gradients get their own power-of-two scale on top of the loss scale (see
            :mod:`distamp.precision.backward_scales`; driven by :class:`~distamp.DistAMP`).

    Raises:
        ValueError: a bad precision, an fp8 option with another precision, or an unknown op.
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a value of the wrong kind:
            one string where a sequence is expected, a non-bool flag, an entry of
            ``fp32_modules`` that is neither a module class nor a string.
    """

    def __init__(
        self,
        precision: PrecisionLike = "bf16",
        *,
        fp32_modules: Iterable[ModuleSpec] = DEFAULT_FP32_MODULES,
        fp32_ops: Iterable[str] = DEFAULT_FP32_OPS,
        cast_inputs: bool = True,
        reduce_dtype: torch.dtype = torch.float32,
        recipe: str | None = None,
        fp8_min_features: int | None = None,
        fp8_exclude: Iterable[str] = (),
        fp8_all_gather: bool | None = None,
        fp8_gemm: str | None = None,
        adaptive: bool | AdaptiveRules = False,
        backward_scales: bool | BackwardScaleRules = False,
    ) -> None:
        self.precision = parse_precision(precision)
        self.adaptive = AdaptivePrecision.from_arg(adaptive, self.precision.name)
        self.backward_scales = BackwardScales.from_arg(backward_scales, self.precision.name)
        exclude = as_patterns("fp8_exclude", fp8_exclude, "head", optional=False, empty=True) or ()
        fp8_options = {
            "recipe": recipe,
            "fp8_min_features": fp8_min_features,
            "fp8_all_gather": fp8_all_gather,
            "fp8_gemm": fp8_gemm,
        }
        self.fp8: Float8Settings | None = None
        if self.precision.float8_linears:
            defaults = Float8Settings()
            self.fp8 = Float8Settings(
                recipe=defaults.recipe if recipe is None else recipe,
                min_features=defaults.min_features
                if fp8_min_features is None
                else fp8_min_features,
                exclude=exclude,
                fsdp_float8_all_gather=defaults.fsdp_float8_all_gather
                if fp8_all_gather is None
                else fp8_all_gather,
                gemm=defaults.gemm if fp8_gemm is None else fp8_gemm,
            )
        else:
            given = [k for k, v in fp8_options.items() if v is not None]
            given += ["fp8_exclude"] if exclude else []
            if given:
                raise ValueError(
                    f"{', '.join(given)}: fp8 options with precision="
                    f"{self.precision.name!r}; pass them with AutocastPolicy('fp8', ...)"
                )
        self.fp32_modules: tuple[ModuleSpec, ...] = module_specs("fp32_modules", fp32_modules)
        self.fp32_ops = fp32_op_names("fp32_ops", fp32_ops)
        self.cast_inputs = as_bool("cast_inputs", cast_inputs)
        self.reduce_dtype = reduce_dtype_of("reduce_dtype", reduce_dtype)
        # The fp32-op mode, entered by policy.autocast() and by each module's forward when
        # nothing above it has (a forward recomputed by activation checkpointing).
        self._ops = Fp32Ops(self.fp32_ops, cast_inputs=self.cast_inputs)
        self._applied: dict[int, nn.Module] = {}

    def __repr__(self) -> str:
        mods = ", ".join(s if isinstance(s, str) else s.__name__ for s in self.fp32_modules)
        fp8 = (
            ""
            if self.fp8 is None
            else f", recipe={self.fp8.recipe!r}, fp8_min_features={self.fp8.min_features}"
        )
        return (
            f"AutocastPolicy({self.precision.name!r}, fp32_modules=({mods}), "
            f"fp32_ops=<{len(self.fp32_ops)} ops>, cast_inputs={self.cast_inputs}{fp8})"
        )

    def short(self) -> str:
        """The policy in a few words, for messages: its precision and the settings that differ
        from the defaults (``AutocastPolicy('fp16')``, ``AutocastPolicy('bf16'; fp32_modules,
        adaptive)``), so that an error leads with its cause instead of the whole repr."""
        defaults = AutocastPolicy(self.precision.name)
        differs = [
            name
            for name, mine, default in (
                ("fp32_modules", self.fp32_modules, defaults.fp32_modules),
                ("fp32_ops", self.fp32_ops, defaults.fp32_ops),
                ("cast_inputs", self.cast_inputs, defaults.cast_inputs),
                ("reduce_dtype", self.reduce_dtype, defaults.reduce_dtype),
                ("fp8", self.fp8, defaults.fp8),
                ("adaptive", self.adaptive is not None, False),
                ("backward_scales", self.backward_scales is not None, False),
            )
            if mine != default
        ]
        more = f"; {', '.join(differs)}" if differs else ""
        return f"AutocastPolicy({self.precision.name!r}{more})"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.precision.compute_dtype

    # ------------------------------------------------------------------ modules
    def is_fp32_module(self, name: str, module: nn.Module) -> bool:
        """Whether ``module`` (qualified ``name`` in its model) must run in fp32."""
        for spec in self.fp32_modules:
            if isinstance(spec, str):
                if fnmatch.fnmatchcase(name, spec) or fnmatch.fnmatchcase(
                    type(module).__name__, spec
                ):
                    return True
            elif isinstance(module, spec):
                return True
        return False

    def fp32_modules_of(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` pairs of ``model`` that run in fp32, outermost only (a module
        inside an fp32 module is covered by it); names are model names
        (:mod:`distamp.model_names`), so patterns match whatever wraps the model."""
        found: list[tuple[str, nn.Module]] = []
        covered: set[int] = set()
        for name, module in named_model_modules(model):
            if id(module) in covered or not self.is_fp32_module(name, module):
                continue
            found.append((name, module))
            covered.update(id(m) for m in module.modules())
        return found

    def apply(self, model: nn.Module) -> nn.Module:
        """Make the policy part of every module's own forward (:mod:`distamp.precision.regions`):
        the fp32 modules run with autocast off (inputs cast to fp32 when ``cast_inputs``), and
        each module's forward enters the fp32-op mode where nothing above it has, so that a
        forward recomputed by activation checkpointing, outside :meth:`autocast`, computes
        exactly as the first one. Idempotent. No host sync.

        Everything acts only while autocast is on, so the model still trains unchanged in fp32.
        Apply before or after wrapping for FSDP or checkpointing: the forwards travel with the
        modules ``fully_shard`` converts and the ones a checkpoint wrapper calls.

        Returns:
            ``model`` itself.

        Raises:
            ValueError: a pattern matching nothing in ``model`` (:meth:`check_patterns`).
        """
        self.check_patterns(model)
        fp32 = {id(module) for _, module in self.fp32_modules_of(model)}
        for module in model.modules():
            if not can_carry_region(module):  # a compiled wrapper: the module inside carries it
                continue
            region = region_of(module)
            region.ops = self._ops
            if id(module) in fp32:
                region.fp32, region.cast_inputs = True, self.cast_inputs
            self._applied[id(module)] = module
        return model

    def check_patterns(self, model: nn.Module) -> None:
        """Refuse a name pattern of this policy (``fp32_modules``, ``fp8_exclude``, the adaptive
        ``watch``, the backward-scale ``blocks``) that matches nothing in ``model``: a
        ``ValueError`` naming the field, the pattern and the closest names. Reads names only;
        module classes and defaults are never refused (:mod:`distamp.precision.patterns`)."""
        adaptive, scales = self.adaptive, self.backward_scales
        check_module_patterns(
            model,
            fp32_modules=self.fp32_modules,
            fp8_exclude=self.fp8.exclude if self.fp8 is not None else (),
            watch=adaptive.rules.watch if adaptive is not None else None,
            blocks=scales.rules.blocks if scales is not None else None,
        )

    def remove(self) -> None:
        """Take the policy out of every module :meth:`apply` reached (promotions stay)."""
        for module in self._applied.values():
            region = region_of(module)
            region.ops, region.fp32 = None, False
            release_region(module)
        self._applied.clear()

    # ------------------------------------------------------------------ ops
    @contextmanager
    def autocast(self, device_type: str, *, enabled: bool = True) -> Iterator[None]:
        """The forward context: ``torch.autocast(device_type, dtype=compute_dtype)`` with the
        fp32 ops forced to fp32. Nothing at all for an fp32 policy or ``enabled=False``."""
        if not enabled or self.compute_dtype is None:
            yield
            return
        with (
            torch.autocast(device_type, dtype=self.compute_dtype),
            self._ops,
            compiled_backward_without_autocast(),  # islands stay fp32 in a compiled backward
        ):
            yield

    # ------------------------------------------------------------------ FSDP
    def fsdp2_policy(self, *, fp32: bool = False) -> Any:
        """FSDP2 ``MixedPrecisionPolicy`` for an ordinary unit (gather in the compute dtype) or,
        with ``fp32``, for an fp32 module's own unit (gather, compute and reduce in fp32); see
        :func:`~distamp.precision.fsdp_settings.fsdp_mixed_precision`."""
        return fsdp_mixed_precision(
            2, self.compute_dtype, reduce_dtype=self.reduce_dtype, fp32=fp32
        )

    def fsdp1_policy(self, *, fp32: bool = False) -> Any:
        """FSDP1 ``MixedPrecision``, as :meth:`fsdp2_policy`. fp32 units cast their inputs to
        fp32 themselves when the policy says so (FSDP1 casts only at the root by default)."""
        return fsdp_mixed_precision(
            1,
            self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            fp32=fp32,
            cast_inputs=self.cast_inputs,
        )
