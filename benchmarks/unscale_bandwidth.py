"""Unscale + overflow check + gradient clipping: torch's path vs distamp's fused pass.

Prints, per gradient size, the time of each path in *read-pass equivalents* (RPE): its time divided
by the time of one read of the gradients' bytes (a sum over a flat buffer of the same bytes). On
CUDA it also prints GB/s (the bytes each path must move, over its time), % of copy bandwidth, and
the same timings replayed from a CUDA graph, which removes host (Python) overhead: with hundreds
of tensors the eager figures are often host-bound.

Paths (all with one loss-scale factor and a max-norm clip):

- ``torch: unscale``: ``_amp_foreach_non_finite_check_and_unscale_`` — what GradScaler.unscale_
  runs (read + write).
- ``torch: unscale + clip``: the above, then ``clip_grad_norm_`` (a norm read, then a multiply).
- ``distamp: check+sumsq``: one read pass; the clip coefficient and 1/scale then fold into a fused
  optimizer's ``grad_scale`` (zero further passes over the gradients).
- ``distamp: check+sumsq, 1 mul``: the same, then one read-write pass by (1/scale * clip
  coefficient) for optimizers without ``grad_scale`` (distamp's kernel with write=True).
- ``distamp: unscale``: ``unscale_and_check_`` (read + write), the scaler's plain path; the
  automatic backend routes it to torch's fused op on CUDA (``--backend triton`` times the
  kernel instead), as it does ``check+sumsq, 1 mul``'s multiply.

Run: ``python benchmarks/unscale_bandwidth.py --device cuda --sizes 10M,50M,200M --dtype bf16``.
``--blocks``/``--warps`` sweep the Triton launch configuration (CUDA only). The scale factor is 1
so repeated runs leave the values unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from distamp import DistributedGradScaler
from distamp.kernels import dispatch, unscale_and_check_, unscale_check_sumsq_

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PROFILE = False  # --profile: where the host time of a cache-hit call goes


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def make_grads(total: int, count: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """``count`` tensors of log-normal sizes summing to ``total``, like weights and biases."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(count, generator=gen).mul(2.0).exp()
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[0] += total - int(sizes.sum())
    return [torch.randn(int(n), device=device).to(dtype) for n in sizes]


class Timer:
    def __init__(self, device: str, repeats: int, graphs: bool) -> None:
        self.device, self.repeats, self.graphs = device, repeats, graphs

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float | None]:
        """Median eager seconds per call, and (CUDA, ``graphs``) seconds per CUDA-graph replay."""
        for _ in range(3):
            fn()
        if self.device != "cuda":
            times = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times), None
        eager = self._events(fn)
        graphed = None
        if self.graphs:
            try:
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    fn()
                    with torch.cuda.graph(graph, stream=stream):
                        fn()
                torch.cuda.current_stream().wait_stream(stream)
                graphed = self._events(graph.replay)
            except Exception as exc:  # a path that cannot be captured: report it, keep going
                print(f"  (graph capture failed: {exc!r})")
        return eager, graphed

    def _events(self, fn: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(self.repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / self.repeats


def paths(
    grads: list[torch.Tensor], device: str, max_norm: float
) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (callable, passes over the gradient bytes it must make: 1 per read or write)."""
    found = torch.zeros((), device=device)
    inv = torch.ones((), device=device)
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty(1, dtype=g.dtype, device=device).expand(g.shape))
        p.grad = g
        params.append(p)

    def torch_unscale() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)

    def torch_clip() -> None:
        torch_unscale()
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def fused_factor() -> torch.Tensor:
        sumsq = unscale_check_sumsq_(grads, found, inv, write=False, compute_sumsq=True)
        assert sumsq is not None
        coef = (max_norm / (sumsq.sqrt() + 1e-6)).clamp(max=1.0)
        return inv * coef  # what a fused optimizer takes as grad_scale's reciprocal

    def fused_mul() -> None:
        # distamp's own pass (its check is redundant here, and free): torch's _foreach_mul_
        # takes a slow per-tensor route when the factor's dtype differs from 16-bit gradients.
        unscale_and_check_(grads, found, fused_factor())

    def plain() -> None:
        unscale_and_check_(grads, found, inv)

    def reference_factor() -> None:
        unscale_check_sumsq_(grads, found, inv, write=False, compute_sumsq=True, backend="torch")

    # The user-facing call, state machine and all: DistributedGradScaler.clip_grad_norm_ + update
    # (no optimizer step, so the gradients stay as they are between repeats).
    scaler = DistributedGradScaler(device, init_scale=1.0, growth_interval=10**9)
    scaler.scale(torch.ones((), device=device))

    def api(opt: torch.optim.Optimizer) -> Callable[[], None]:
        def call() -> None:
            scaler.clip_grad_norm_(opt, max_norm)
            scaler.update()

        return call

    fused_opt = torch.optim.SGD(params, lr=0.0, fused=True)
    plain_opt = torch.optim.SGD(params, lr=0.0, foreach=True)

    return {
        "distamp[torch]: check+sumsq": (reference_factor, 1),
        "torch: unscale": (torch_unscale, 2),
        "torch: unscale + clip": (torch_clip, 2),
        "distamp: check+sumsq": (fused_factor, 1),
        "distamp: check+sumsq, 1 mul": (fused_mul, 2),
        "distamp: unscale": (plain, 2),
        "scaler.clip_grad_norm_ (fused opt)": (api(fused_opt), 1),
        "scaler.clip_grad_norm_ (other opt)": (api(plain_opt), 3),
    }


def run_size(args: argparse.Namespace, total: int, dtype: torch.dtype, timer: Timer) -> None:
    grads = make_grads(total, args.tensors, dtype, args.device)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    flat = torch.cat([g.flatten() for g in grads])  # real data: untouched pages read as zeros
    flat_dst = torch.empty_like(flat)
    copy_t, copy_g = timer(lambda: flat_dst.copy_(flat))
    read_t, read_g = timer(lambda: flat.sum())  # one read of the same bytes
    copy_bw = 2 * nbytes / copy_t
    print(
        f"\n{total / 1e6:.0f}M {args.dtype} elements in {len(grads)} tensors "
        f"({nbytes / 1e6:.0f} MB), {args.device}; one read (flat sum) = {read_t * 1e3:.3f} ms"
    )
    header = f"{'path':36} {'ms':>9} {'RPE':>6}"
    if args.device == "cuda":
        header += f" {'GB/s':>7} {'%copy':>6} {'graph ms':>9} {'graph RPE':>9}"
    print(header)
    rows: dict[str, tuple[Callable[[], object], int]] = {
        "copy (flat, same bytes)": ((lambda: flat_dst.copy_(flat)), 2),
        "sum (flat, one read)": ((lambda: flat.sum()), 1),
    }
    rows.update(paths(grads, args.device, args.max_norm))
    for name, (fn, passes) in rows.items():
        try:
            eager, graphed = {
                "copy (flat, same bytes)": (copy_t, copy_g),
                "sum (flat, one read)": (read_t, read_g),
            }.get(name) or timer(fn)
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # e.g. no bf16 unscale
            print(f"{name:36} n/a: {str(exc).splitlines()[0][:70]}")
            continue
        line = f"{name:36} {eager * 1e3:9.3f} {eager / read_t:6.2f}"
        if args.device == "cuda":
            bw = passes * nbytes / eager
            line += f" {bw / 1e9:7.0f} {100 * bw / copy_bw:5.0f}%"
            if graphed is not None and read_g:
                line += f" {graphed * 1e3:9.3f} {graphed / read_g:9.2f}"
        print(line)
    if args.device == "cuda":
        host_overhead(grads, args.device)


def host_overhead(grads: list[torch.Tensor], device: str) -> None:
    """Python cost of one call, measured without waiting for the GPU: a table cache hit, new
    addresses of known sizes (every step after ``zero_grad(set_to_none=True)``), and a miss."""
    from distamp.kernels import triton as kt

    found, inv = torch.zeros((), device=device), torch.ones((), device=device)
    out = {}
    for label, clear in (("hit", None), ("new addresses", True), ("miss", False)):
        times = []
        for _ in range(20):
            if clear is not None:
                kt.plan_cache_clear(keep_layouts=clear)
            torch.cuda.synchronize()
            start = time.perf_counter()
            unscale_check_sumsq_(grads, found, inv, write=False, compute_sumsq=True)
            times.append(time.perf_counter() - start)
        out[label] = statistics.median(times) * 1e6
    print(
        f"host time per call, {len(grads)} tensors: "
        f"hit {out['hit']:.0f} us, new addresses {out['new addresses']:.0f} us, "
        f"miss {out['miss']:.0f} us"
    )
    if PROFILE:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(50):
                unscale_check_sumsq_(grads, found, inv, write=False, compute_sumsq=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def sweep(args: argparse.Namespace, total: int, dtype: torch.dtype, timer: Timer) -> None:
    """Time the check+sumsq and unscale paths over Triton launch configurations."""
    from distamp.kernels import triton as kt

    grads = make_grads(total, args.tensors, dtype, args.device)
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    flat = torch.cat([g.flatten() for g in grads])  # real data: untouched pages read as zeros
    read_e, read_g = timer(lambda: flat.sum())
    found, inv = torch.zeros((), device=args.device), torch.ones((), device=args.device)
    saved = dict(kt._CONFIG)
    graphs = read_g is not None
    print(
        f"\nsweep {total / 1e6:.0f}M {args.dtype} (RPE, {'CUDA-graph' if graphs else 'eager'} "
        "timings): block warps  check+sumsq  unscale  check GB/s"
    )
    for block in args.blocks:
        for warps in args.warps:
            kt._CONFIG[dtype, False] = kt._CONFIG[dtype, True] = (block, warps)
            kt.plan_cache_clear()
            times = []
            for write in (False, True):

                def call(write: bool = write) -> None:
                    unscale_check_sumsq_(grads, found, inv, write=write, compute_sumsq=not write)

                eager, graphed = timer(call)
                times.append(graphed if graphs and graphed is not None else eager)
            read_t = read_g if graphs and read_g is not None else read_e
            print(
                f"  {block:6d} {warps:4d} {times[0] / read_t:12.2f} {times[1] / read_t:8.2f}"
                f" {nbytes / times[0] / 1e9:11.0f}"
            )
    kt._CONFIG.update(saved)
    kt.plan_cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,50M", help="total gradient elements, e.g. 10M,200M")
    parser.add_argument("--tensors", type=int, default=500, help="number of gradient tensors")
    parser.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (comma list allowed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-norm", type=float, default=1e9, help="large: keeps values fixed")
    parser.add_argument("--backend", default=None, help="distamp backend: auto, triton or torch")
    parser.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph timings")
    parser.add_argument("--blocks", default="", help="sweep Triton block sizes, e.g. 4096,8192")
    parser.add_argument("--warps", default="8", help="num_warps values for --blocks")
    parser.add_argument("--profile", action="store_true", help="cProfile the host side (CUDA)")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    args.blocks = [int(b) for b in args.blocks.split(",") if b]
    args.warps = [int(w) for w in args.warps.split(",") if w]
    if args.backend:
        dispatch.set_default_backend(args.backend)
    torch.manual_seed(0)
    timer = Timer(args.device, args.repeats, graphs=not args.no_graphs)
    backend = dispatch.get_default_backend()
    print(
        f"torch {torch.__version__}, distamp backend {backend}, device {args.device}"
        + (
            f" ({torch.cuda.get_device_name()})"
            if args.device == "cuda"
            else f" ({torch.get_num_threads()} threads)"
        )
    )
    for name in args.dtype.split(","):
        args.dtype = name
        for size in args.sizes.split(","):
            total = parse_count(size)
            run_size(args, total, DTYPES[name], timer)
        if args.blocks:  # at the largest size only: each configuration compiles anew
            sweep(args, max(map(parse_count, args.sizes.split(","))), DTYPES[name], timer)


if __name__ == "__main__":
    main()
