"""distamp.precision.audit: per-module dtypes of one real forward pass, and the problems it
explains."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distamp.precision.audit import audit
from distamp.precision.policy import AutocastPolicy
from distamp.scaler import DistributedGradScaler


class _Attn(nn.Module):
    """An explicit softmax attention (no fused kernel), as older models write it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.qk = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.qk(x)
        return self.norm(torch.softmax(h @ h.transpose(-1, -2), dim=-1) @ h)


def test_plain_autocast_on_cpu_flags_low_precision_softmax_and_norm() -> None:
    report = audit(_Attn(), torch.randn(2, 4, 8), precision="bf16")
    root, norm, qk = report.record(""), report.record("norm"), report.record("qk")
    assert qk.param_dtypes == ["float32"] and qk.output_dtypes == ["bfloat16"]
    assert "addmm" in qk.low_precision_ops
    assert "_softmax" in root.low_precision_ops  # CPU autocast keeps softmax in bf16
    assert norm.output_dtypes == ["bfloat16"]
    assert any("AutocastPolicy" in issue for issue in report.issues)
    text = str(report)
    assert "qk" in text and "addmm" in text and "AutocastPolicy" in text


def test_policy_removes_the_low_precision_softmax() -> None:
    report = audit(_Attn(), torch.randn(2, 4, 8), policy=AutocastPolicy("bf16"))
    assert "_softmax" not in report.record("").low_precision_ops
    assert report.record("norm").output_dtypes == ["float32"]
    assert report.issues == []
    assert "no precision issues found" in report.table()


def test_fp16_parameters_with_a_scaler_are_explained() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).half()
    scaler = DistributedGradScaler(device="cpu")
    report = audit(model, torch.randn(3, 4).half(), precision="fp16", scaler=scaler)
    assert report.record("0").param_dtypes == ["float16"]
    (issue,) = [i for i in report.issues if "stored in float16" in i]
    assert "4 parameter(s)" in issue and "float32" in issue
    # The problem the report predicts is real: the scaler refuses to step these parameters.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(F.mse_loss(model(torch.randn(3, 4).half()).float(), torch.zeros(3, 2))).backward()
    try:
        scaler.unscale_(opt)
    except ValueError as exc:
        assert "16-bit parameter(s) with no master" in str(exc)
    else:
        raise AssertionError("unscale_ accepted fp16 gradients")


def test_fp32_model_without_scaler_is_clean_and_hooks_are_removed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    report = audit(model, torch.randn(2, 4), precision="fp32")
    assert all(not r.low_precision_ops for r in report.records) and report.issues == []
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
