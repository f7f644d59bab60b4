"""Fused unscale kernels: the Triton kernel against the torch reference, the reference against fp64.

The Triton kernel runs on CUDA when there is a GPU, and on CPU under Triton's interpreter.
``TRITON_INTERPRET=1`` must be set before Triton is imported and other test modules may import it
first, so ``test_triton_interpreter_suite`` re-runs this file's kernel tests in a fresh process
with the variable set; in the parent those tests skip with a reason that says so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from distamp import kernels
from distamp.kernels import cpu_sumsq, dispatch, reference, unscale_check_sumsq_

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
}
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# dtype -> (relative tolerance of written values, of the sum of squares). The kernel rounds
# x * inv_scale once from fp32, like torch's unscale; fp32 and fp16 match bit for bit. bf16 may be
# one ulp off when inv_scale is not a power of two (GradScaler's always are): the interpreter's
# fp32 -> bf16 cast truncates, and torch's CUDA unscale lacks bf16, so the reference falls back to
# _foreach_mul_, which rounds inv_scale to bf16 first. The kernel sums squares of exact x * inv in
# fp64, the reference of norms of the stored values: about one ulp of the dtype apart.
TOL = {
    torch.float32: (0.0, 1e-5),
    torch.float16: (0.0, 2e-3),
    torch.bfloat16: (ULP[torch.bfloat16], 1e-2),
}

# The CPU kernel tests run under TRITON_INTERPRET=1 in a process of their own
# (test_triton_interpreter_suite): in this process they are not collected at all, rather than
# collected and skipped, so that a run's skips are only what this machine cannot run.
CPU_KERNELS = (
    [pytest.param("cpu")]
    if HAS_TRITON and INTERPRETED
    else [pytest.param("cpu", marks=pytest.mark.skip(reason="needs triton"))]
    if not HAS_TRITON
    else []
)
KERNEL_DEVICES = [
    *CPU_KERNELS,
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA) or INTERPRETED, reason="needs CUDA"),
        ],
    ),
]


def make_grads(
    sizes: Sequence[int], dtype: torch.dtype, device: str, seed: int = 0, magnitude: float = 100.0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, generator=gen) * magnitude).to(dtype=dtype, device=device) for n in sizes
    ]


def odd_sizes(count: int, seed: int = 0) -> list[int]:
    """Mostly small odd sizes, a few empties and a few spanning several kernel chunks."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 600, (count,), generator=gen).tolist()
    sizes[3] = sizes[17] = 0
    return [*sizes, 4095, 4097, 8191, 8193, 3 * 8192 + 5]


def assert_same(
    actual: torch.Tensor | None, expected: torch.Tensor, rtol: float, what: str
) -> None:
    """NaN-aware comparison that names the first mismatching index."""
    assert actual is not None, f"{what}: got None"
    a, e = actual.detach().double().cpu().flatten(), expected.detach().double().cpu().flatten()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    both_nan = a.isnan() & e.isnan()
    same = both_nan | (a == e) | ((a - e).abs() <= rtol * e.abs())
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: first mismatch at index {i}: got {a[i].item()!r}, expected {e[i].item()!r} "
            f"({int((~same).sum())} of {a.numel()} differ, rtol={rtol})"
        )


def assert_grads_same(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], rtol: float
) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_same(a, e, rtol, f"grads[{i}] ({e.dtype}, numel {e.numel()})")


@dataclass
class Outcome:
    grads: list[torch.Tensor]
    found: torch.Tensor
    flags: torch.Tensor
    sumsq: torch.Tensor


def run_both(
    grads: Sequence[torch.Tensor], inv: float, compute_sumsq: bool = True
) -> tuple[Outcome, Outcome]:
    """Run the triton and torch backends on copies of ``grads``; return what each produced."""
    out = []
    device = grads[0].device
    for backend in ("triton", "torch"):
        g = [t.clone() for t in grads]
        found = torch.zeros((), device=device)
        flags = torch.zeros(len(g), dtype=torch.uint8, device=device)
        sumsq = unscale_check_sumsq_(
            g,
            found,
            torch.tensor(inv, device=device),
            compute_sumsq=compute_sumsq,
            per_tensor_flags=flags,
            backend=backend,
        )
        assert (sumsq is not None) == compute_sumsq
        out.append(Outcome(g, found, flags, torch.zeros(()) if sumsq is None else sumsq))
    return out[0], out[1]


def exact_sumsq(grads: Sequence[torch.Tensor], inv: float) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        total += ((g.double().cpu() * inv) ** 2).sum()
    return total


# --- Triton kernel against the reference (CPU under the interpreter, or CUDA) -------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_kernel_matches_reference_on_many_odd_tensors(device: str, dtype: torch.dtype) -> None:
    grads = make_grads(odd_sizes(1000), dtype, device)
    kern, ref = run_both(grads, 1 / 3)
    assert_grads_same(kern.grads, ref.grads, TOL[dtype][0])
    assert float(kern.found) == float(ref.found) == 0.0
    assert not bool(kern.flags.any())
    assert_same(kern.sumsq, exact_sumsq(grads, 1 / 3), 1e-5, "kernel sumsq vs fp64")
    assert_same(kern.sumsq, ref.sumsq, TOL[dtype][1], "kernel sumsq vs reference")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["first", "last", "last_tensor", "random"])
def test_kernel_flags_nonfinite(device: str, dtype: torch.dtype, value: float, where: str) -> None:
    grads = make_grads([7, 0, 4097, 1, 300, 8193, 5], dtype, device, seed=1)
    gen = torch.Generator().manual_seed(sum(map(ord, where)))
    hits = {"first": [(0, 0)], "last": [(2, 4096)], "last_tensor": [(6, 4)]}.get(where)
    if hits is None:
        hits = [(t, int(torch.randint(0, grads[t].numel(), (1,), generator=gen))) for t in (3, 5)]
    for t, i in hits:
        grads[t][i] = value
    grads[4][0] = torch.finfo(dtype).max  # finite: its square overflows, yet it is not flagged
    expected_flags = torch.zeros(len(grads), dtype=torch.uint8)
    expected_flags[[t for t, _ in hits]] = 1
    for compute_sumsq in (True, False):  # the kernel checks differently with and without sumsq
        kern, ref = run_both(grads, 0.25, compute_sumsq)
        for name, out in (("triton", kern), ("torch", ref)):
            assert float(out.found) == 1.0, (name, compute_sumsq)
            assert torch.equal(out.flags.cpu(), expected_flags), (name, compute_sumsq, out.flags)
            assert not compute_sumsq or not bool(out.sumsq.isfinite()), name
        assert_grads_same(kern.grads, ref.grads, 0.0)  # 0.25 is exact in every dtype


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_kernel_write_false_leaves_grads_untouched(device: str, dtype: torch.dtype) -> None:
    grads = make_grads([5, 4097, 0, 33], dtype, device, seed=2)
    grads[1][100] = float("nan")
    before = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    sumsq = unscale_check_sumsq_(
        grads,
        found,
        torch.tensor(0.5, device=device),
        write=False,
        compute_sumsq=True,
        backend="triton",
    )
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(
            g.view(torch.int16 if g.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )
    assert float(found) == 1.0 and sumsq is not None and not bool(sumsq.isfinite())
    grads[1][100] = 0.0
    sumsq = unscale_check_sumsq_(
        grads,
        found,
        torch.tensor(0.5, device=device),
        write=False,
        compute_sumsq=True,
        backend="triton",
    )
    assert float(found) == 1.0, "found_inf must never be reset"
    assert_same(sumsq, exact_sumsq(grads, 0.5), 1e-5, "sumsq of unscaled values")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_empty_and_mixed_dtypes(device: str) -> None:
    empty = [torch.empty(0, device=device), torch.empty(0, 3, device=device)]
    found = torch.zeros((), device=device)
    one = torch.ones((), device=device)
    sumsq = unscale_check_sumsq_(empty, found, one, compute_sumsq=True, backend="triton")
    assert sumsq is not None and float(sumsq) == 0.0 and float(found) == 0.0
    assert unscale_check_sumsq_([], found, one, compute_sumsq=True, backend="triton") is not None
    mixed = [
        *make_grads([9, 0, 5000], torch.float16, device),
        *make_grads([3, 8200], torch.bfloat16, device),
        *make_grads([4100], torch.float32, device),
        *make_grads([6], torch.float64, device),
    ]
    kern, ref = run_both(mixed, 0.125)
    assert_grads_same(kern.grads, ref.grads, 0.0)
    assert_same(kern.sumsq, exact_sumsq(mixed, 0.125), 1e-5, "mixed-dtype sumsq")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_kernel_non_contiguous(device: str, dtype: torch.dtype) -> None:
    base = make_grads([64 * 70], dtype, device, seed=3)[0].view(64, 70)
    conv = make_grads([2 * 8 * 5 * 5], dtype, device, seed=4)[0].view(2, 8, 5, 5)
    grads = [
        base.t(),  # dense, transposed: the kernel takes it
        base[:, ::3],  # strided: handed to the reference
        conv.contiguous(memory_format=torch.channels_last),
        base[1:, 2:9],
    ]
    grads[1][5, 5] = float("inf")
    kern, ref = run_both(grads, 1 / 1024)
    assert_grads_same(kern.grads, ref.grads, 0.0)
    assert torch.equal(kern.flags.cpu(), torch.tensor([1, 1, 0, 0], dtype=torch.uint8))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
def test_kernel_sumsq_does_not_overflow_or_underflow(device: str, dtype: torch.dtype) -> None:
    big = [
        torch.full((4097,), 1e30, dtype=dtype, device=device),
        torch.ones(3, device=device, dtype=dtype),
    ]
    found = torch.zeros((), device=device)
    one = torch.ones((), device=device)
    s64 = unscale_check_sumsq_(
        big,
        found,
        one,
        compute_sumsq=True,
        sumsq_dtype=torch.float64,
        backend="triton",
        write=False,
    )
    assert float(found) == 0.0
    assert_same(s64, exact_sumsq(big, 1.0), 1e-6, "sumsq of 1e30 elements")
    s32 = unscale_check_sumsq_(big, found, one, compute_sumsq=True, backend="triton", write=False)
    assert s32 is not None and s32.dtype == torch.float32 and float(s32) == float("inf")  # 1e63
    tiny = [torch.full((1000,), 1e-30, device=device).to(dtype)]
    s = unscale_check_sumsq_(
        tiny,
        found,
        one,
        compute_sumsq=True,
        sumsq_dtype=torch.float64,
        backend="triton",
        write=False,
    )
    assert_same(s, exact_sumsq(tiny, 1.0), 1e-6, "sumsq of 1e-30 elements")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_flags_float32_and_accumulate(device: str) -> None:
    grads = make_grads([10, 10, 10], torch.float32, device)
    grads[1][3] = float("nan")
    flags = torch.tensor([1.0, 0.0, 0.0], device=device)
    unscale_check_sumsq_(
        grads,
        torch.zeros((), device=device),
        torch.ones((), device=device),
        per_tensor_flags=flags,
        backend="triton",
    )
    assert flags.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_rejects_gradients_on_another_device(device: str) -> None:
    other = "meta" if device == "cpu" else "cpu"
    grads = [torch.ones(3, device=device), torch.ones(2, device=other)]
    with pytest.raises(ValueError, match=rf"grads\[1\] is on {other}"):
        unscale_check_sumsq_(
            grads, torch.zeros((), device=device), torch.ones((), device=device), backend="triton"
        )


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_launch_failure_falls_back_when_not_strict(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distamp.kernels import triton as kt

    class Broken:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("compilation failed")

    monkeypatch.setattr(kt, "_unscale_chunks_kernel", Broken())
    monkeypatch.setattr(kt, "_auto_failed", False)
    kt.plan_cache_clear()
    grads = make_grads([5, 5000], torch.float32, device)
    before = [g.clone() for g in grads]
    found, inv = torch.zeros((), device=device), torch.tensor(0.5, device=device)
    with pytest.raises(RuntimeError, match="compilation failed"):
        kt.unscale_check_sumsq_triton_(grads, found, inv)  # strict: an explicit request raises
    with pytest.warns(RuntimeWarning, match="torch reference"):
        sumsq = kt.unscale_check_sumsq_triton_(grads, found, inv, compute_sumsq=True, strict=False)
    assert kt.auto_failed()
    assert_grads_same(grads, [b * 0.5 for b in before], 0.0)  # unscaled once, by the reference
    assert_same(sumsq, exact_sumsq(before, 0.5), 1e-5, "fallback sumsq")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_pointer_tables_are_cached(device: str) -> None:
    from distamp.kernels import triton as kt

    kt.plan_cache_clear()
    grads = make_grads([100, 5000], torch.float32, device)
    args = (torch.zeros((), device=device), torch.ones((), device=device))
    for _ in range(3):
        unscale_check_sumsq_(grads, *args, backend="triton")
    assert kt.plan_cache_info()["misses"] == 1 and kt.plan_cache_info()["hits"] == 2
    unscale_check_sumsq_([grads[0], grads[1][:4000]], *args, backend="triton")  # new numel
    assert kt.plan_cache_info()["misses"] == 2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_tables_of_reallocated_gradients_are_readdressed(device: str) -> None:
    """``zero_grad(set_to_none=True)`` gives every step new gradients of the same sizes. Their
    table is re-addressed, not rebuilt, and the kernel reads the new tensors: each step unscales
    and sums its own gradients, and an inf in the third step's is found."""
    from distamp.kernels import triton as kt

    kt.plan_cache_clear()
    alive = []  # keeps each step's tensors, so that no address is reused
    for step in range(3):
        grads = make_grads([100, 5000, 7, 3000], torch.float32, device, seed=step)
        if step == 2:
            grads[2][1] = float("inf")
        before = [g.clone() for g in grads]
        found = torch.zeros((), device=device)
        sumsq = unscale_check_sumsq_(
            grads, found, torch.tensor(0.5, device=device), compute_sumsq=True, backend="triton"
        )
        alive.append(grads)
        assert found.item() == (1.0 if step == 2 else 0.0), step
        if step < 2:
            assert_grads_same(grads, [b * 0.5 for b in before], 0.0)
            assert_same(sumsq, exact_sumsq(before, 0.5), 1e-5, f"step {step}")
    assert kt.plan_cache_info() == {"hits": 0, "misses": 3, "readdressed": 2, "size": 3}
    # New addresses may be on another device too: still refused, naming the tensor.
    other = "meta" if device == "cpu" else "cpu"
    moved = [alive[0][0], alive[0][1], torch.ones(7, device=other), alive[0][3]]
    with pytest.raises(ValueError, match=rf"grads\[2\] is on {other}"):
        unscale_check_sumsq_(
            moved, torch.zeros((), device=device), torch.ones((), device=device), backend="triton"
        )


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA), reason="needs CUDA and Triton")
def test_cuda_auto_uses_triton_without_host_sync() -> None:
    from distamp.kernels import triton as kt

    kt.plan_cache_clear()
    grads = make_grads(odd_sizes(50), torch.bfloat16, "cuda")
    found, inv = torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
    unscale_check_sumsq_(grads, found, inv, compute_sumsq=True)  # compile outside the check
    kt.plan_cache_clear()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # a cache miss (table upload), then a hit
            unscale_check_sumsq_(grads, found, inv, compute_sumsq=True, per_tensor_flags=None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kt.plan_cache_info() == {"hits": 1, "misses": 1, "readdressed": 0, "size": 1}


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_triton_interpreter_suite() -> None:
    """Run this file's CPU kernel tests in a fresh process with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-k",
        "test_kernel_ and cpu",
        "-p",
        "no:cacheprovider",
        "-x",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"interpreter suite failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


# --- the torch reference and the dispatcher (in process, CPU) ------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=NAMES.get)
@pytest.mark.parametrize("write", [True, False])
@pytest.mark.parametrize("strategy", ["cpu", "fp64", "split"])
def test_reference_matches_fp64(
    dtype: torch.dtype, write: bool, strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every norm strategy of the reference (the device picks one; forced here on CPU)."""
    monkeypatch.setattr(reference, "_norm_strategy", lambda device, dtype: strategy)
    grads = make_grads(odd_sizes(40), dtype, "cpu", seed=5)
    grads[-1][-1] = float("nan")
    grads[0][0] = float("-inf")
    grads[5][0] = 6e4 if dtype == torch.float16 else 1e30  # finite, its fp32 square is not
    before = [g.clone() for g in grads]
    found = torch.zeros(())
    flags = torch.zeros(len(grads), dtype=torch.uint8)
    inv = torch.tensor(1 / 3)
    sumsq = unscale_check_sumsq_(
        grads,
        found,
        inv,
        write=write,
        compute_sumsq=True,
        per_tensor_flags=flags,
        backend="torch",
        sumsq_dtype=torch.float64,
    )
    expected = [(b.float() * inv).to(dtype) if write else b for b in before]
    if dtype == torch.float64:
        expected = [b * inv.double() if write else b for b in before]
    assert_grads_same(grads, expected, 0.0)
    assert float(found) == 1.0
    assert flags.nonzero().flatten().tolist() == [0, len(grads) - 1]
    assert sumsq is not None and bool(sumsq.isnan())
    clean = [g[g.isfinite()] for g in before]
    if strategy != "fp64":  # fp32 norms: overflow like clip_grad_norm_ beyond ~1e19
        clean[5][0] = 1.0
    sumsq = unscale_check_sumsq_(
        clean,
        torch.zeros(()),
        inv,
        write=False,
        compute_sumsq=True,
        backend="torch",
        sumsq_dtype=torch.float64,
    )
    assert_same(sumsq, exact_sumsq(clean, 1 / 3), 1e-5, "reference sumsq")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=NAMES.get)
def test_reference_cpu_chunks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, 16-bit sums of squares go through a small fp32 buffer in chunks: the sum is the
    whole one's (tensors straddling chunks, non-contiguous ones, rows longer than a chunk), and
    the flags still name whole tensors."""
    monkeypatch.setattr(cpu_sumsq, "CHUNK_ELEMENTS", 64)
    grads = make_grads([1000, 64, 65, 3, 0, 4097], dtype, "cpu", seed=7, magnitude=2.0)
    grads.append(make_grads([40 * 30], dtype, "cpu", seed=8)[0].view(40, 30).t())  # rows of 40
    grads.append(make_grads([3 * 200], dtype, "cpu", seed=9)[0].view(3, 200).t()[::2])  # strided
    grads.append(make_grads([2 * 150], dtype, "cpu", seed=10)[0].view(150, 2).t())  # row > chunk
    inv = 1 / 3
    sumsq = unscale_check_sumsq_(
        grads,
        torch.zeros(()),
        torch.tensor(inv),
        write=False,
        compute_sumsq=True,
        backend="torch",
        sumsq_dtype=torch.float64,
    )
    assert_same(sumsq, exact_sumsq(grads, inv), 1e-6, "sumsq over chunks")
    whole = cpu_sumsq.sumsq_fp32_chunked([g for g in grads if g.numel()], chunk=1 << 20)
    assert_same(whole, exact_sumsq(grads, 1.0), 1e-6, "sumsq in one chunk")
    with pytest.raises(ValueError, match="chunk"):
        cpu_sumsq.sumsq_fp32_chunked(grads, chunk=0)
    grads[5][4096] = float("inf")
    found = torch.zeros(())
    flags = torch.zeros(len(grads), dtype=torch.uint8)
    sumsq = unscale_check_sumsq_(
        grads,
        found,
        torch.tensor(inv),
        write=False,
        compute_sumsq=True,
        per_tensor_flags=flags,
        backend="torch",
    )
    assert float(found) == 1.0 and sumsq is not None and not bool(sumsq.isfinite())
    assert flags.nonzero().flatten().tolist() == [5]


@pytest.mark.parametrize(("inv", "rtol"), [(0.125, 0.0), (1 / 3, ULP[torch.bfloat16])])
def test_reference_without_amp_op_support(
    inv: float, rtol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA builds may lack bf16 in torch's fused unscale op: the fallback must agree with it,
    exactly for power-of-two scales (it multiplies by inv_scale rounded to bf16)."""
    grads = make_grads([5, 0, 700], torch.bfloat16, "cpu", seed=6)
    grads[2][699] = float("inf")
    outs = []
    for supported in (True, False):
        monkeypatch.setitem(reference._amp_support, ("cpu", torch.bfloat16), supported)
        g = [t.clone() for t in grads]
        found = torch.zeros(())
        unscale_check_sumsq_(g, found, torch.tensor(inv), backend="torch")
        outs.append((g, float(found)))
    assert outs[0][1] == outs[1][1] == 1.0
    assert_grads_same(outs[1][0], outs[0][0], rtol)


def test_unscale_and_check_is_write_and_check() -> None:
    grads = make_grads([3, 4], torch.float16, "cpu")
    before = [g.clone() for g in grads]
    found = torch.zeros(())
    kernels.unscale_and_check_(grads, found, torch.tensor(0.5))
    assert_grads_same(grads, [b * 0.5 for b in before], 0.0)
    kernels.unscale_and_check_(grads, found, torch.tensor(0.5), write=False)
    assert_grads_same(grads, [b * 0.5 for b in before], 0.0)
    assert float(found) == 0.0


def test_argument_errors_name_the_argument() -> None:
    g = [torch.ones(3)]
    one = torch.ones(())
    with pytest.raises(TypeError, match="found_inf"):
        unscale_check_sumsq_(g, torch.zeros((), dtype=torch.float16), one)
    with pytest.raises(TypeError, match="inv_scale"):
        unscale_check_sumsq_(g, torch.zeros(()), torch.ones(2))
    with pytest.raises(ValueError, match="per_tensor_flags"):
        unscale_check_sumsq_(g, torch.zeros(()), one, per_tensor_flags=torch.zeros(2))
    with pytest.raises(ValueError, match="sumsq_dtype"):
        unscale_check_sumsq_(g, torch.zeros(()), one, sumsq_dtype=torch.float16)
    with pytest.raises(ValueError, match="backend='cuda'"):
        unscale_check_sumsq_(g, torch.zeros(()), one, backend="cuda")
    with pytest.raises(TypeError, match="floating point"):
        unscale_check_sumsq_([torch.ones(3, dtype=torch.int32)], torch.zeros(()), one)
    with pytest.raises(ValueError, match=r"grads\[1\] is on meta"):
        unscale_check_sumsq_([*g, torch.ones(2, device="meta")], torch.zeros(()), one)


def test_default_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert kernels.get_default_backend() == "auto"
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert kernels.get_default_backend() == "torch"
    kernels.set_default_backend("triton")
    try:
        assert kernels.get_default_backend() == "triton"
    finally:
        kernels.set_default_backend(None)
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        kernels.get_default_backend()
    with pytest.raises(ValueError, match="backend"):
        kernels.set_default_backend("gpu")


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="needs triton, without the interpreter")
def test_explicit_triton_on_cpu_raises() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        unscale_check_sumsq_([torch.ones(3)], torch.zeros(()), torch.ones(()), backend="triton")


def test_import_and_fallback_without_triton() -> None:
    """`import distamp` must not need Triton; auto falls back, an explicit request raises."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, distamp, distamp.kernels as k\n"
        "assert not k.triton_available()\n"
        "g = [torch.full((4,), 2.0)]; f = torch.zeros(())\n"
        "k.unscale_check_sumsq_(g, f, torch.tensor(0.5), backend='auto')\n"
        "assert g[0].tolist() == [1.0] * 4 and float(f) == 0.0\n"
        "try:\n"
        "    k.unscale_check_sumsq_(g, f, torch.tensor(0.5), backend='triton')\n"
        "except ImportError as e:\n"
        "    assert 'torch' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_torch_compile_keeps_the_custom_op() -> None:
    def step(grads: list[torch.Tensor], found: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        sumsq = unscale_check_sumsq_(grads, found, inv, compute_sumsq=True, backend="torch")
        assert sumsq is not None
        return sumsq.sqrt()

    grads = make_grads([5, 7], torch.float32, "cpu")
    expected = exact_sumsq(grads, 0.5).sqrt()
    before = [g.clone() for g in grads]
    found = torch.zeros(())
    norm = torch.compile(step, backend="aot_eager", fullgraph=True)(grads, found, torch.tensor(0.5))
    assert_same(norm, expected, 1e-6, "compiled norm")
    assert_grads_same(grads, [b * 0.5 for b in before], 0.0)
    assert float(found) == 0.0


def test_cpu_check_and_sumsq_stays_exact_when_squares_overflow() -> None:
    """The CPU path skips its second pass when the sum of squares is finite; a non-finite sum
    from huge *finite* values must still leave found_inf at 0 (and a real inf must raise it)."""
    huge = [torch.ones(8), torch.tensor([1e30, 2.0])]  # finite, but 1e60 overflows fp32
    found = torch.zeros(())
    sumsq = unscale_check_sumsq_(
        huge, found, torch.tensor(1.0), write=False, compute_sumsq=True, backend="torch"
    )
    assert sumsq is not None and not bool(torch.isfinite(sumsq))
    assert float(found) == 0.0
    bad = [torch.ones(8), torch.tensor([float("inf"), 2.0])]
    sumsq = unscale_check_sumsq_(
        bad, found, torch.tensor(1.0), write=False, compute_sumsq=True, backend="torch"
    )
    assert float(found) == 1.0
    assert torch.equal(bad[0], torch.ones(8))  # a check never writes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, a NaN equal to any NaN (the exact check may rewrite a 16-bit NaN's
    payload, as torch's check-and-unscale op does on the reference route too)."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv", [1.0, 2.0**-10, 0.3])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan"), 1e30])
def test_cpu_check_and_sum_is_the_reference_without_its_dispatcher(
    dtype: torch.dtype, inv: float, poison: float | None
) -> None:
    """``check_sumsq_cpu_`` (the clip's CPU route) gives bitwise the torch backend's sum and
    flag and leaves the gradients' values as they were; finite squares beyond fp32 (``1e30``)
    take the exact check, which raises nothing."""
    if dtype == torch.float16 and poison == 1e30:
        pytest.skip("1e30 is not a finite fp16 value")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in (3, 1000, 0, 257)]
    if poison is not None:
        grads[1][7] = poison
    before = [g.clone() for g in grads]
    inv_scale = torch.tensor(inv)
    flag, ref_flag = torch.zeros(()), torch.zeros(())
    got = kernels.check_sumsq_cpu_(grads, flag, inv_scale)
    want = unscale_check_sumsq_(
        [g.clone() for g in before],
        ref_flag,
        inv_scale,
        write=False,
        compute_sumsq=True,
        sumsq_dtype=torch.float64,
        backend="torch",
        grouped=True,
    )
    assert want is not None and got.dtype == torch.float64 and _same(got, want)
    nonfinite = poison is not None and poison != 1e30
    assert flag.item() == ref_flag.item() == float(nonfinite)
    assert all(_same(a, b) for a, b in zip(grads, before, strict=True))
