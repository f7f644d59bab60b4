"""Precision parsing (every framework's spelling) and the mixed-precision owner selector."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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
