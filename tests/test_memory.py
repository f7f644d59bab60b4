"""No gradient-sized temporary on any clip path: bytes allocated inside the call (deterministic,
from torch's profiler), the extra peak resident memory of one clip in a fresh process (what a user
pays), and on CUDA the Triton path's peak device memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from distamp import DistributedGradScaler
from distamp.kernels import unscale_check_sumsq_

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _largest_allocation(fn: object) -> int:
    """The largest CPU allocation (bytes) made while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_kernel_sumsq_allocates_no_gradient_sized_temporary(dtype: torch.dtype) -> None:
    grads = [torch.full((1_000_000,), 3.0, dtype=dtype) for _ in range(4)]
    grads.append(torch.full((700, 900), 2.0, dtype=dtype).t())  # not contiguous
    grads += [torch.full((500,), 1.0, dtype=dtype) for _ in range(50)]
    found, inv = torch.zeros(()), torch.tensor(0.5)
    for flags in (None, torch.zeros(len(grads), dtype=torch.uint8)):

        def call(flags: torch.Tensor | None = flags) -> None:
            unscale_check_sumsq_(
                grads, found, inv, write=False, compute_sumsq=True, per_tensor_flags=flags
            )

        call()  # reusable buffers are made on the first call
        largest = _largest_allocation(call)
        assert largest < 0.02 * grads[0].numel() * grads[0].element_size(), (dtype, largest)
    assert float(found) == 0.0


def _clip_model(dtype: torch.dtype, fused: bool) -> tuple[DistributedGradScaler, object, int]:
    params = [nn.Parameter(torch.zeros(1_000_000, dtype=dtype)) for _ in range(4)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    opt = torch.optim.AdamW(params, fused=True) if fused else torch.optim.SGD(params, lr=0.1)
    scaler = DistributedGradScaler("cpu", init_scale=1024.0)
    return scaler, opt, 4 * 1_000_000 * params[0].element_size()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaler_clip_allocates_no_gradient_sized_temporary(dtype: torch.dtype, fused: bool) -> None:
    for _ in range(2):  # the second clip is measured (first-use buffers and probes excluded)
        scaler, opt, grad_bytes = _clip_model(dtype, fused)
        scaler.scale(torch.ones(()))
        largest = _largest_allocation(lambda s=scaler, o=opt: s.clip_grad_norm_(o, 1.0))
    assert largest < 0.02 * grad_bytes, (dtype, fused, largest)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize(
    "case",
    [("bf16", "foreach SGD", "distamp"), ("fp16", "fused AdamW", "distamp")],
    ids=lambda c: f"{c[0]}-{c[1].split()[0]}",
)
def test_clip_extra_peak_rss_in_a_fresh_process(case: tuple[str, str, str]) -> None:
    """The upcast path kept up to a full fp32 copy of 16-bit gradients resident (25% here at
    least: one 4 MB copy per 1M-element piece); the bound leaves room for allocator noise."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--case", json.dumps(case)]
    cmd += ["--elements", "8000000", "--tensors", "4"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "refused" in result and "clear_refs" in result["refused"]:
        pytest.skip(f"this kernel cannot reset the peak: {result['refused']}")
    assert "extra" in result, result
    assert result["extra"] < 0.10 * result["grad_bytes"], result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_clip_peak_device_memory(dtype: torch.dtype) -> None:
    """On CUDA (Triton when it imports), the sum of squares and the clip allocate at most 1% of
    the gradient bytes beyond what is already allocated."""
    elements = 64 * 1024 * 1024
    params = [nn.Parameter(torch.zeros(elements // 16, dtype=dtype, device="cuda"))]
    params += [
        nn.Parameter(torch.zeros(elements // 16, dtype=dtype, device="cuda")) for _ in range(15)
    ]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    grad_bytes = elements * params[0].element_size()
    opt = torch.optim.AdamW(params, fused=True)
    found, inv = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    grads = [p.grad for p in params]

    def kernel() -> None:
        unscale_check_sumsq_(grads, found, inv, write=False, compute_sumsq=True)  # type: ignore[arg-type]

    def clip() -> None:
        scaler = DistributedGradScaler("cuda", init_scale=1024.0)
        scaler.scale(torch.ones((), device="cuda"))
        scaler.clip_grad_norm_(opt, 1.0)

    for fn in (kernel, clip):
        fn()  # compile and first-use allocations
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
        assert extra <= 0.01 * grad_bytes, (fn.__name__, dtype, extra, grad_bytes)
