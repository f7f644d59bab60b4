"""``DistAMP(...)``'s own arguments (distamp/engine/config.py): refused at construction.

- Fuzzed constructor arguments: either a working engine whose numbers are plain Python numbers,
  or a ``ValueError`` that names the offending field (the scaler's: tests/test_scaler.py).
- A device this machine lacks is refused with the device that would work.
- Flags are booleans; numbers are taken as torch takes them (numpy scalars included).
"""

from __future__ import annotations

import math
import numbers
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_scenarios import maybe, numeric
from hypothesis import event, example, given
from hypothesis import strategies as st

from distamp.engine import DistAMP
from distamp.parallel.strategies import STRATEGIES

ENGINE_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "precision": maybe(st.sampled_from(["bf16", "fp16", "fp32", "16-mixed", torch.float16])),
        "strategy": maybe(st.sampled_from(["auto", "none", "ddp", "fsdp", "fsdp2"])),
        "grad_accum_steps": maybe(numeric(st.integers(1, 4))),
        "max_grad_norm": maybe(st.one_of(st.none(), numeric(st.floats(0.1, 10.0)))),
        "timeout": maybe(st.one_of(st.floats(1.0, 600.0), st.just(timedelta(seconds=-1)))),
        "device": maybe(st.sampled_from(["cpu", "cpu:0", "cuda:7", "gpu"])),
        "comm_hook": maybe(st.sampled_from([None, "fp16", "bf16", "powersgd", "zip"])),
        "hsdp_shard_size": maybe(st.one_of(st.none(), numeric(st.integers(1, 4)))),
        "policy": maybe(st.sampled_from([None, "default", "fp32"])),
    },
)


@given(ENGINE_ARGS)
@example({"grad_accum_steps": np.int64(2), "max_grad_norm": np.float32(1.0)})
@example({"grad_accum_steps": 2**31})
@example({"timeout": 1e300})
@example({"device": 2**63})
def test_fuzzed_engine_arguments(kwargs: dict[str, Any]) -> None:
    must_fail = [
        name for name, ok in _ENGINE_DOMAINS.items() if name in kwargs and not ok(kwargs[name])
    ]
    try:
        amp = DistAMP(**kwargs)
    except ValueError as exc:
        assert any(f"{name}=" in str(exc) for name in kwargs), f"unnamed field: {exc}"
        event("rejected with ValueError")
        return
    event("constructed")
    assert not must_fail, f"accepted invalid {must_fail}: {kwargs}"
    for name in ("grad_accum_steps", "max_grad_norm", "timeout", "hsdp_shard_size"):
        value = getattr(amp.config, name)
        assert value is None or type(value) in (int, float), (name, value)


def _integral(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.ndim == 0 and not v.is_floating_point() and v.dtype != torch.bool
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _real(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.ndim == 0 and v.dtype != torch.bool and math.isfinite(v.item())
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


# Fields whose valid values are simple to state: an invalid one must be refused at construction.
_ENGINE_DOMAINS: dict[str, Any] = {
    "strategy": lambda v: v in STRATEGIES,
    "grad_accum_steps": lambda v: _integral(v) and 1 <= int(v) < 2**31,
    "max_grad_norm": lambda v: v is None or (_real(v) and v > 0),
    "timeout": lambda v: (
        (_real(v) and 0 < v < 2**31) or (isinstance(v, timedelta) and v > timedelta())
    ),
    "hsdp_shard_size": lambda v: v is None or (_integral(v) and 1 <= int(v) < 2**31),
}


def test_a_device_this_machine_lacks_is_refused_at_construction() -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: none on a CPU host
    with pytest.raises(ValueError, match=rf"device='{absent}'.*device='cpu'"):
        DistAMP(device=absent)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': torch sees 0 cuda device"):
            DistAMP(device="cuda")
    assert DistAMP(device="cpu:0").config.device == torch.device("cpu:0")


def test_flags_are_booleans_and_numbers_are_taken_as_torch_takes_them() -> None:
    with pytest.raises(TypeError, match="trace_nonfinite"):
        DistAMP("fp16", trace_nonfinite="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trust_ddp_sync"):
        DistAMP("fp16", trust_ddp_sync=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="numerics_interval"):
        DistAMP("fp16", numerics_interval=0)
    assert DistAMP("fp16", numerics_interval=np.int64(5)).config.numerics_interval == 5
