"""A policy as plain text, for comparing it across ranks (:mod:`distamp.cluster.agreement`).

Everything that changes what a rank computes is spelled out (fp32 modules and ops, cast and
reduce dtypes, the fp8 settings, the adaptive and backward-scale rules), so that two ranks whose
policies differ in any of these are caught at setup rather than training apart.
"""

from __future__ import annotations

from typing import Any

from distamp.precision.policy import AutocastPolicy

__all__ = ["describe_policy"]


def describe_policy(policy: Any) -> dict[str, Any]:
    """``policy``'s settings as a flat mapping of plain values. ``None``, and objects that only
    behave like a policy (the plug-ins accept those), are described by their type alone."""
    if not isinstance(policy, AutocastPolicy):
        return {"policy": None if policy is None else type(policy).__qualname__}
    adaptive, scales = policy.adaptive, policy.backward_scales
    return {
        "policy": repr(policy),
        "policy.fp32_ops": tuple(sorted(str(op) for op in policy.fp32_ops)),
        "policy.reduce_dtype": str(policy.reduce_dtype),
        "policy.fp8": repr(policy.fp8),
        "policy.adaptive": None if adaptive is None else repr(adaptive.rules),
        "policy.backward_scales": None if scales is None else repr(scales.rules),
    }
