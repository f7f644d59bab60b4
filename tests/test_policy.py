"""Precision parsing (every framework's spelling), the mixed-precision owner selector, and
``AutocastPolicy``'s arguments: fuzzed (a policy or a ``ValueError`` naming the argument), and
``fp32_ops`` names that are no torch function refused with the closest names."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_scenarios import JUNK, numeric
from hypothesis import event, example, given
from hypothesis import strategies as st

from distamp import AutocastPolicy
from distamp.precision.policy import VALID_PRECISIONS, Precision, parse_precision, select_mp_owner

FP32 = ("fp32", None, False)
FP16 = ("fp16", torch.float16, True)
BF16 = ("bf16", torch.bfloat16, False)
FP8 = ("fp8", torch.bfloat16, False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # distamp's own names
        ("fp32", FP32),
        ("fp16", FP16),
        ("bf16", BF16),
        # Lightning
        ("32-true", FP32),
        ("32", FP32),
        (32, FP32),
        ("16-mixed", FP16),
        ("16", FP16),
        (16, FP16),
        ("bf16-mixed", BF16),
        # Accelerate
        ("no", FP32),
        ("fp16-mixed", FP16),
        # torch dtypes and their names
        (torch.float32, FP32),
        (torch.float16, FP16),
        (torch.bfloat16, BF16),
        ("float16", FP16),
        ("half", FP16),
        ("bfloat16", BF16),
        # case and whitespace do not matter
        ("  BF16-Mixed ", BF16),
        ("FP16", FP16),
        # fp8: torchao float8 Linear layers, the rest bf16
        ("fp8", FP8),
        ("float8", FP8),
        ("FP8-mixed", FP8),
    ],
)
def test_spellings(value: Any, expected: tuple[str, torch.dtype | None, bool]) -> None:
    p = parse_precision(value)
    assert (p.name, p.compute_dtype, p.needs_scaler) == expected
    assert str(p) == expected[0]
    assert parse_precision(p) is p  # idempotent


@pytest.mark.parametrize(
    "value",
    [
        "fp8-true",
        "bf16-true",
        "16-true",
        "64",
        64,
        "",
        None,
        True,
        16.0,
        torch.float64,
        torch.int8,
        torch.float8_e4m3fn,
    ],
)
def test_unknown_values_echo_and_list_the_valid_ones(value: Any) -> None:
    with pytest.raises(ValueError) as info:
        parse_precision(value)
    message = str(info.value)
    assert f"precision={value!r}" in message
    assert all(repr(name) in message for name in ("fp16", "bf16", "16-mixed", "32-true", "no"))


def test_valid_list_round_trips() -> None:
    for name in VALID_PRECISIONS:
        assert isinstance(parse_precision(name), Precision)


@pytest.mark.parametrize(
    ("precision", "strategy", "device", "owner"),
    [
        ("fp32", "fsdp2", "cuda", "none"),
        ("fp32", "ddp", "cpu", "none"),
        ("bf16", "fsdp", "cuda", "fsdp"),
        ("fp16", "fsdp2", "cuda", "fsdp"),
        ("bf16", "fsdp2", "cpu", "autocast"),
        ("bf16", "hsdp", "cuda", "fsdp"),
        ("bf16", "hsdp", "cpu", "autocast"),
        ("fp16", "fsdp", "cpu", "autocast"),
        ("bf16", "ddp", "cuda", "autocast"),
        ("fp16", "none", "cpu", "autocast"),
    ],
)
def test_mp_owner(precision: str, strategy: str, device: str, owner: str) -> None:
    assert select_mp_owner(parse_precision(precision), strategy, device) == owner


# --------------------------------------------------------------- AutocastPolicy: refused arguments
@given(
    st.one_of(st.sampled_from(["fp8", "bf16", "fp16", 16, 32]), numeric(JUNK)),
    st.one_of(st.none(), numeric(st.integers(-5, 5000)), numeric(JUNK)),
)
@example("fp8", np.int64(64))
@example(np.int64(16), None)
@example(torch.tensor(32), None)
def test_fuzzed_policy_arguments(precision: Any, min_features: Any) -> None:
    try:
        policy = AutocastPolicy(precision, fp8_min_features=min_features)
    except ValueError as exc:
        assert "precision=" in str(exc) or "fp8_min_features" in str(exc), exc
        event("rejected with ValueError")
        return
    event("constructed")
    if policy.fp8 is not None:
        assert type(policy.fp8.min_features) is int and policy.fp8.min_features >= 0


@pytest.mark.parametrize(
    ("name", "closest"), [("softmx", "softmax"), ("F.softmax", "softmax"), ("torch.exp", "exp")]
)
def test_fp32_ops_names_that_are_no_torch_function_are_refused(name: str, closest: str) -> None:
    with pytest.raises(ValueError, match=rf"fp32_ops: '{re.escape(name)}' is not.*'{closest}'"):
        AutocastPolicy("bf16", fp32_ops=(name,))
    policy = AutocastPolicy("bf16", fp32_ops=(closest, "linalg_norm"))
    assert policy.fp32_ops == frozenset({closest, "linalg_norm"})
