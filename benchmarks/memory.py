"""Extra peak resident memory of one gradient clip, side by side with torch's path.

Each case runs in a fresh process with one thread: it builds the gradients, warms the same calls
up on a small model (first-use code pages and caches are not the clip's memory), records VmRSS,
resets the peak (``/proc/self/clear_refs``), runs ONE clip and reads VmHWM. The extra peak is
VmHWM minus VmRSS before the call, shown as a share of the gradient bytes. Paths:

- torch: ``torch.amp.GradScaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_``;
- distamp: ``DistributedGradScaler.clip_grad_norm_`` (one read pass, deferred unscale);
- drop-in: ``DistributedGradScaler.unscale_`` + ``torch.nn.utils.clip_grad_norm_``.

for fp32, bf16 and fp16 gradients, with a foreach SGD (unfused) or a fused AdamW. Neither scaler
unscales fp16 gradients (the parameters themselves are fp16): those rows use disabled scalers, so
torch's column is its plain ``clip_grad_norm_``, except distamp's fused one-pass clip, which
accepts them (the fused step unscales). A refused call shows as "refused". Target: distamp's
extra peak <= torch's + 1% of the gradient bytes.

    python benchmarks/memory.py [--elements 50000000] [--tensors 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("foreach SGD", "fused AdamW")
PATHS = ("torch", "distamp", "drop-in")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _setup(dtype: torch.dtype, opt_name: str, path: str, elements: int, tensors: int) -> Any:
    """Parameters with gradients, an optimizer, a scaler past ``scale()``, and the clip call."""
    from distamp import DistributedGradScaler

    size = max(1, elements // tensors)
    params = [nn.Parameter(torch.zeros(size, dtype=dtype)) for _ in range(tensors)]
    for i, p in enumerate(params):  # cheap to fill; the values do not change what is allocated
        p.grad = torch.full((size,), 1.0 + i % 7, dtype=dtype)
    if opt_name == "fused AdamW":
        opt: torch.optim.Optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    else:
        opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
    fp16 = dtype == torch.float16
    if fp16 and path == "distamp":
        # 16-bit gradients as the 16-bit weights mode makes them: its optimizer keeps the fp32
        # masters (distamp refuses to step 16-bit parameters of an optimizer without them)
        setattr(opt, "keeps_16bit_masters", True)  # noqa: B010
    scaler: Any
    if path == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=not fp16)
    else:
        enabled = not fp16 or (path == "distamp" and opt_name == "fused AdamW")
        scaler = DistributedGradScaler("cpu", init_scale=1024.0, enabled=enabled)
    scaler.scale(torch.ones(()))  # what backward would follow; creates the scale

    def clip() -> None:
        if path == "distamp":
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)

    return clip, sum(p.grad.numel() * p.grad.element_size() for p in params)  # type: ignore[union-attr]


def run_case(dtype_name: str, opt_name: str, path: str, elements: int, tensors: int) -> dict:
    """One case, in this process: the extra peak of one clip in bytes (or the refusal)."""
    torch.set_num_threads(1)
    dtype = DTYPES[dtype_name]
    try:
        warm, _ = _setup(dtype, opt_name, path, 4 * tensors * 1024, tensors)
        warm()
    except (ValueError, RuntimeError) as exc:
        return {"refused": f"{type(exc).__name__}: {str(exc)[:60]}"}
    clip, grad_bytes = _setup(dtype, opt_name, path, elements, tensors)
    before = _status_kib("VmRSS")
    if not _reset_peak():
        return {"refused": "cannot reset VmHWM (/proc/self/clear_refs)"}
    clip()
    peak = _status_kib("VmHWM")
    return {"extra": (peak - before) * 1024, "grad_bytes": grad_bytes}


def _spawn(dtype_name: str, opt_name: str, path: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--case", json.dumps([dtype_name, opt_name, path])]
    cmd += ["--elements", str(args.elements), "--tensors", str(args.tensors)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"refused": f"exit {proc.returncode}: {proc.stderr.strip()[-200:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cell(r: dict) -> str:
    if "refused" in r:
        return f"{'refused':>9}"
    return f"{100 * r['extra'] / r['grad_bytes']:8.2f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--elements", type=int, default=50_000_000)
    p.add_argument("--tensors", type=int, default=100)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        dtype_name, opt_name, path = json.loads(args.case)
        print(json.dumps(run_case(dtype_name, opt_name, path, args.elements, args.tensors)))
        return
    print(
        f"extra peak RSS of one clip, % of gradient bytes; {args.elements:,} elements in "
        f"{args.tensors} tensors, 1 thread, a fresh process per case (CPU, torch "
        f"{torch.__version__})"
    )
    header = (
        f"{'dtype':5} {'optimizer':12} | {'torch':>9} | {'distamp':>9} {'-torch':>8} | "
        f"{'drop-in':>9} {'-torch':>8}"
    )
    print(header)
    print("-" * len(header))
    worst = float("-inf")
    for dtype_name in DTYPES:
        for opt_name in OPTIMIZERS:
            r = {path: _spawn(dtype_name, opt_name, path, args) for path in PATHS}
            cells = [f"{dtype_name:5} {opt_name:12} | {_cell(r['torch'])}"]
            for path in ("distamp", "drop-in"):
                mine, ref = r[path], r["torch"]
                delta = ""
                if "extra" in mine and "extra" in ref:
                    d = 100 * (mine["extra"] - ref["extra"]) / mine["grad_bytes"]
                    worst = max(worst, d)
                    delta = f"{d:+7.2f}%"
                cells.append(f"{_cell(mine)} {delta:>8}")
            print(" | ".join(cells))
    print(f"largest excess over torch: {worst:+.2f}% of the gradient bytes (target <= +1.00%)")


if __name__ == "__main__":
    main()
