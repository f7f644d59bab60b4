"""The 8-bit gradient exchange's fused kernels against the eager reference, bit for bit.

``distamp.kernels.fp8_exchange`` (Triton) and ``distamp.kernels.fp8_wire``'s eager torch ops must
give the same bytes on the wire and the same reduced gradients. The kernels run on CUDA when
there is a GPU, and on CPU under Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before
Triton is imported, so ``test_interpreter_suite`` re-runs this file's kernel tests in a fresh
process with the variable set (in the parent they are not collected). The ranks of an exchange
are simulated in one process: each rank's quantised bucket is computed, the all-to-all and the
all-gather are slices and concatenations, no process group is involved.

"Equal" is bitwise, except that a NaN's sign and payload are not compared (which NaN an operation
on a NaN returns is the hardware's choice; an overflowed bucket is NaN everywhere either way).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from distamp.kernels import dispatch, fp8_wire

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

INTERPRETER = [pytest.param("cpu")] if HAS_TRITON and INTERPRETED else []
KERNEL_DEVICES = [
    *INTERPRETER,
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not (HAS_TRITON and HAS_CUDA) or INTERPRETED, reason="needs CUDA"),
        ],
    ),
]


def _nan_code(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        return (codes & 0x7F) == 0x7F
    return ((codes & 0x7C) == 0x7C) & ((codes & 0x03) != 0)


def assert_equal(
    actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype
) -> None:
    """Bitwise (NaN payloads aside); names the first mismatching index."""
    a, e = actual.detach().cpu().flatten(), expected.detach().cpu().flatten()
    assert a.dtype == e.dtype and a.shape == e.shape, f"{what}: {a.dtype}{a.shape} vs {e.shape}"
    if a.dtype == torch.uint8:
        same = (a == e) | (_nan_code(a, dtype) & _nan_code(e, dtype))
    else:
        same = (a.view(torch.int32) == e.view(torch.int32)) | (a.isnan() & e.isnan())
    if not bool(same.all()):
        i = int((~same).nonzero()[0])
        raise AssertionError(
            f"{what}: first mismatch at {i}: got {a[i].item()!r}, expected {e[i].item()!r} "
            f"({int((~same).sum())} of {a.numel()} differ)"
        )


def exchange(
    xs: Sequence[torch.Tensor], dtype: torch.dtype, chunk: int, backend: str, residual: bool
) -> dict[str, list[torch.Tensor]]:
    """One DDP bucket's exchange over ``len(xs)`` simulated ranks: every intermediate."""
    world, fmax = len(xs), float(torch.finfo(dtype).max)
    rows = [x.view(-1, chunk) for x in xs]
    amaxes = [fp8_wire.chunk_amax(r, backend=backend) for r in rows]
    agreed = torch.stack(amaxes).amax(0)  # the MAX all-reduce
    nonfinite = fp8_wire.overflows(agreed, fmax / world)
    sent = [
        fp8_wire.quantise(
            r, agreed, fmax / world, dtype, nonfinite, residual=residual, backend=backend
        )
        for r in rows
    ]
    k = agreed.numel() // world
    shards = []
    for rank in range(world):
        received = torch.cat(
            [q.reshape(-1)[rank * k * chunk : (rank + 1) * k * chunk] for q, _ in sent]
        )
        mine = agreed[rank * k : (rank + 1) * k]
        shards.append(
            fp8_wire.sum_shards(
                received,
                mine,
                fmax / world,
                dtype,
                nonfinite,
                world,
                requantise=(fmax, world),
                backend=backend,
            )
        )
    gathered = torch.cat([s.reshape(-1) for s in shards])  # the all-gather
    out = {
        "amax": amaxes,
        "sent": [q for q, _ in sent],
        "requantised": shards,
        "reduced": [fp8_wire.dequantise(gathered, agreed, fmax, dtype, backend=backend)],
    }
    if residual:
        out["lost"] = [lost for _, lost in sent if lost is not None]
    # FSDP2's reduce-scatter keeps the fp32 sum of its shard (no requantising)
    received = torch.cat([q.reshape(-1)[: k * chunk] for q, _ in sent])
    out["fsdp_sum"] = [
        fp8_wire.sum_shards(
            received, agreed[:k], fmax / world, dtype, nonfinite, world, backend=backend
        )
    ]
    return out


def bucket(case: str, world: int, chunk: int, device: str, seed: int) -> list[torch.Tensor]:
    """Each rank's padded bucket (``world * 2`` chunks), chunks of mixed magnitudes."""
    g = torch.Generator().manual_seed(seed)
    n = world * 2 * chunk
    mags = 10.0 ** torch.randint(-6, 6, (n // chunk, 1), generator=g).float()
    xs = [(torch.randn(n // chunk, chunk, generator=g) * mags).flatten() for _ in range(world)]
    if case == "inf":
        xs[-1][5] = float("inf")
    elif case == "-inf":
        xs[0][n - 1] = -float("inf")
    elif case == "nan":
        xs[world // 2][chunk + 3] = float("nan")
    elif case == "zeros":
        xs = [torch.zeros(n) for _ in range(world)]
        xs[0][7] = -0.0
    elif case == "huge":  # near fp32's largest: scales down to 2**-126, still finite
        xs[0][:chunk] = 3e38
        xs[-1][chunk : 2 * chunk] = -1e30
    elif case == "tiny":  # fp32 subnormals and values scaled into them
        xs = [x * 1e-40 for x in xs]
    return [x.to(device) for x in xs]


CASES = ("random", "inf", "-inf", "nan", "zeros", "huge", "tiny")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
def test_cast_and_decode_match_torch(device: str, dtype: torch.dtype) -> None:
    """With every amax 0 the scale is 1: the kernel's bytes are torch's ``.to(dtype)`` of the
    values themselves, on random bit patterns (every exponent, NaNs, infinities, subnormals)
    and on the rounding boundaries; and every one of the 256 codes decodes as torch decodes it."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 15,), generator=g, dtype=torch.int64)
    specials = [
        float("inf"),
        -float("inf"),
        float("nan"),
        470.0,
        464.0,
        480.0,
        61440.0,
        57344.0,
        2.0**-10,
        -(2.0**-10),
        3 * 2.0**-11,
        2.0**-17,
        1e-45,
        -0.0,
    ]
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.tensor(specials)])
    x = torch.cat([x, torch.zeros(-x.numel() % 256)]).view(-1, 256).to(device)
    zero = torch.zeros(x.shape[0], device=device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=device)
    q, _ = fp8_wire.quantise(x, zero, 448.0, dtype, nonfinite, residual=False, backend="triton")
    assert_equal(q, x.to(dtype).view(torch.uint8), "cast", dtype)
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    decoded = fp8_wire.dequantise(codes, zero[:1], 448.0, dtype, backend="triton")
    assert_equal(decoded, codes.view(dtype).float(), "decode", dtype)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_exchange_is_bitwise_equal_to_the_reference(
    device: str, dtype: torch.dtype, world: int
) -> None:
    """Every intermediate of a bucket's exchange, over simulated ranks: each rank's amax, the
    bytes it sends, its residual, the requantised shard sums, the reduced bucket and FSDP2's fp32
    sum, for random data, an inf, a -inf or a NaN in one element of one rank, zeros, values
    beyond the scales' range and fp32 subnormals; chunks of 256 and of 100 elements."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy on inf * 0
        for i, case in enumerate(CASES):
            chunk = 100 if i % 3 == 2 else 256
            xs = bucket(case, world, chunk, device, seed=world * 100 + i)
            want = exchange(xs, dtype, chunk, "torch", residual=True)
            got = exchange(xs, dtype, chunk, "triton", residual=True)
            for name, parts in want.items():
                for r, (a, e) in enumerate(zip(got[name], parts, strict=True)):
                    assert_equal(a, e, f"{case}, world {world}: {name}[{r}]", dtype)
            reduced = want["reduced"][0]
            if case in ("inf", "-inf", "nan"):  # an overflow is NaN on every rank
                assert bool(reduced.isnan().all()), case
            else:
                assert bool(reduced.isfinite().all()), case


def _hooks_under_both_backends(rank: int, world: int) -> dict[str, list[Any]]:
    """Rank ``rank`` of 2 gloo ranks: two backwards (the second carries error feedback's
    residual) of a DDP model (3 buckets) and an FSDP2 model, through the fp8 hooks, once with the
    eager reference and once with the kernels; every reduced gradient (plus an inf in the
    second backward's)."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from distamp.parallel.comm_hooks import register_comm_hook

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 3)
    )
    out: dict[str, list[Any]] = {}
    for backend in ("torch", "triton"):
        dispatch.set_default_backend(backend)
        assert fp8_wire.backend_for(torch.device("cpu")) == backend
        try:
            for kind, strategy in (("fp8", "ddp"), ("fp8-ef", "ddp"), ("fp8-ef", "fsdp2")):
                inner = model = copy.deepcopy(net)
                if strategy == "ddp":
                    model = nn.parallel.DistributedDataParallel(inner, bucket_cap_mb=0.02)
                else:
                    fully_shard(inner[2])
                    fully_shard(inner)
                register_comm_hook(model, kind, chunk=100)
                grads = []
                for step in range(2):
                    g = torch.Generator().manual_seed(10 * step + rank)
                    loss = model(torch.randn(8, 64, generator=g) * 30).square().sum()
                    if step == 1 and rank == 1:
                        loss = loss + inner[0].weight[0, 0] * float("inf")
                    model.zero_grad()
                    loss.backward()
                    grads += [
                        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        for p in model.parameters()
                    ]
                # numpy copies: tensors would travel as shared memory the rank frees on exit
                out[f"{kind} {strategy} {backend}"] = [t.detach().numpy().copy() for t in grads]
        finally:
            dispatch.set_default_backend(None)
    return out


@pytest.mark.parametrize("device", INTERPRETER)  # gloo ranks on CPU: the interpreter's run
def test_ddp_and_fsdp2_hooks_give_the_same_gradients_with_the_kernels(device: str) -> None:
    """The hooks themselves (two real gloo ranks): the kernels in place of the eager ops change
    no bit of any reduced gradient, error feedback's second step and an overflow included."""
    from _dist import run_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        results = run_ranks(_hooks_under_both_backends, 2, timeout=240)
    for rank, got in enumerate(results):
        for name in ("fp8 ddp", "fp8-ef ddp", "fp8-ef fsdp2"):
            kernel = [torch.from_numpy(a) for a in got[f"{name} triton"]]
            eager = [torch.from_numpy(a) for a in got[f"{name} torch"]]
            for i, (a, e) in enumerate(zip(kernel, eager, strict=True)):
                assert_equal(a, e, f"rank {rank}, {name}, gradient {i}", torch.float8_e4m3fn)
            step2 = len(kernel) // 2  # the first layer's weight at the second step: its bucket
            assert bool(kernel[step2].isnan().all()), f"{name}: the inf reached every rank"
            assert bool(kernel[step2 - 1].isfinite().all()), f"{name}: a clean step stays finite"


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiles, not interprets; triton")
@pytest.mark.parametrize("dtype", FORMATS, ids=NAMES.get)
def test_kernels_compile_for_sm90_without_fused_multiply_add(dtype: torch.dtype) -> None:
    """No GPU needed: the kernels compile for sm_90 as a launch would (integer arguments
    equal to 1 specialised as constants included), with no fused multiply-add (it would round
    once where torch rounds twice) and no flush of subnormals to zero."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from distamp.kernels import fp8_exchange as k

    fmt = k._format(dtype)
    decode = {n: v for n, v in fmt.items() if n not in ("MAX_CODE", "OVER_CODE")}
    t1 = dict(zip(("SIG_T", "EXP_T"), fp8_wire.target_parts(448 / 3), strict=True))
    t2 = dict(zip(("SIG_T2", "EXP_T2"), fp8_wire.target_parts(448.0), strict=True))
    shape = {"ROWS": 16, "COLS": 256}
    ptr = {"f": "*fp32", "u": "*u8"}
    kernels = [
        (k._amax_kernel, "ff", {}, shape),
        (k._quantise_kernel, "ffuuf", {"RESIDUAL": True, **t1, **fmt}, shape),
        (k._sum_kernel, "ufuu", {"REQUANT": True, **t1, **t2, **fmt}, shape),
        (k._sum_kernel, "ufuf", {"rows": 1, "world": 1, "REQUANT": False, **t1, **t2, **fmt},
         shape),
        (k._dequantise_kernel, "uff", {**t1, **decode}, shape),
    ]  # fmt: skip
    for fn, pointers, constants, sizes in kernels:
        names = list(fn.arg_names)
        signature: dict[str, str] = dict(zip(names, (ptr[p] for p in pointers), strict=False))
        scalars = {"rows": "i32", "chunk": "i32", "world": "i32", "divisor": "fp32"}
        constexprs = {**constants, **sizes}
        for name in names[len(pointers) :]:
            signature[name] = "constexpr" if name in constexprs else scalars[name]
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                             options={"enable_fp_fusion": False}).asm["ptx"]  # fmt: skip
        assert "fma.rn.f32" not in ptx and ".ftz" not in ptx, fn.__name__


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="parent process only; needs triton")
def test_interpreter_suite() -> None:
    """Run this file's kernel tests on CPU in a fresh process with TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-p",
        "no:cacheprovider",
        "-x",
        "-k",
        "cpu",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, proc.stdout[-2000:]


# --- in this process: the reference's numbers and the dispatch --------------------------------


@pytest.mark.parametrize("target", [448.0, 224.0, 448 / 3, 57344.0 / 5, 0.25])
def test_scales_are_the_largest_power_of_two_under_the_target(target: float) -> None:
    g = torch.Generator().manual_seed(1)
    amax = torch.rand(20000, generator=g) * 10.0 ** torch.randint(-44, 38, (20000,), generator=g)
    amax = torch.cat([amax, torch.tensor([0.0, float("inf"), 1e-45, 3e38, 448.0, target])])
    scale = fp8_wire.chunk_scales(amax, target)
    t32 = torch.tensor(target, dtype=torch.float32).double()
    ok = torch.isfinite(amax) & (amax > 0)
    a, s = amax.double(), scale.double()
    exponent = torch.log2(s)
    assert bool((exponent == exponent.round()).all()), "scales are powers of two"
    assert bool((s[~ok] == 1).all())
    fits = (a * s <= t32) | (exponent == -126)
    largest = (a * s * 2 > t32) | (exponent == 126)
    assert bool((fits & largest)[ok].all()), "the largest power of two with amax * s <= target"
    # the previous definition, floor(log2(target / amax)), agrees away from rounding edges
    old = torch.exp2(torch.floor(torch.log2(target / amax[ok])).clamp(-126.0, 126.0))
    assert float((old == scale[ok]).double().mean()) > 0.999


def test_the_exchange_runs_the_kernels_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: Triton for CUDA tensors (when it imports), the reference elsewhere; an explicit
    backend wins on any device."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fp8_wire.backend_for(cpu) == "torch"
    assert fp8_wire.backend_for(cuda) == ("triton" if HAS_TRITON else "torch")
    assert fp8_wire.backend_for(cuda, "torch") == "torch"
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    assert fp8_wire.backend_for(cuda) == "torch"
    if HAS_TRITON:
        assert fp8_wire.backend_for(cpu, "triton") == "triton"


def test_reference_sum_is_exact_in_any_order() -> None:
    """The shards' sum is taken in fp64, where float8 values add exactly: the same result
    whatever order a kernel adds them in (e5m2 values span 2**-16 to 2**16)."""
    g = torch.Generator().manual_seed(2)
    dtype, world, chunk = torch.float8_e5m2, 7, 64
    codes = torch.randint(0, 0x7B, (world * chunk,), generator=g, dtype=torch.uint8)
    amax = torch.zeros(1)
    nonfinite = torch.zeros((), dtype=torch.bool)
    forward = fp8_wire.sum_shards(codes, amax, 1.0, dtype, nonfinite, world, backend="torch")
    backward = codes.view(world, chunk).flip(0).reshape(-1)
    again = fp8_wire.sum_shards(backward, amax, 1.0, dtype, nonfinite, world, backend="torch")
    assert_equal(again, forward, "reversed order", dtype)
    exact = sum(math.fsum(col) for col in [codes.view(dtype).double().view(world, chunk)[:, 0]])
    assert forward[0, 0].item() == torch.tensor(exact, dtype=torch.float32).item()
