"""Public path of :mod:`distamp.precision.fp8` (``distamp.fp8.*`` as documented)."""

from __future__ import annotations

from distamp.precision.fp8 import (
    DEFAULT_MIN_FEATURES,
    FP8_RECIPES,
    TORCHAO_RANGE,
    Float8Settings,
    Float8Training,
    LinearChoice,
    SaturatedLayer,
    convert_for_fp8,
    fp8_support,
    install_compile_guard,
    plan_linears,
    require_torchao,
    torchao_version_tested,
)

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
