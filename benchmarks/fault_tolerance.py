"""torchft with distamp's scaler against torchft without a scaler, side by side in one run.

Two replica groups of one rank each (gloo, CPU, an in-process Lighthouse, torchft's DDP and
optimizer wrapper, fp16 autocast), each a separate process running the tests' replica script
(``tests/scripts/ft_replica.py``). Prints:

- the per-step time of replica 0 (median over the steps after the first five), with the scaler
  agreeing through the Manager (one extra all-reduce of one float per step, and the commit vote
  it makes instead of the optimizer wrapper) and without a scaler;
- the time to heal: replica 1 dies at step 10 and is restarted; from its Manager being up to the
  end of its first committed step (the quorum, the checkpoint transfer from replica 0 and one
  step), with the scaler's state registered with the Manager and without it.

    python benchmarks/fault_tolerance.py [--steps 40] [--width 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "ft_replica.py"  # the tests' replica, reused as is
TIMEOUT = 600


def _run(lighthouse: str, tmp: Path, name: str, pairs: list[tuple[int, list[str]]]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs, outs = [], []
    for replica, extra in pairs:
        out = tmp / f"{name}{replica}.json"
        cmd = [sys.executable, str(SCRIPT), str(replica), lighthouse, str(out), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL))
        outs.append(out)
    for p in procs:
        p.wait(timeout=TIMEOUT)
    return [json.loads(o.read_text()) for o in outs if o.exists()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=2000
    )
    addr = lighthouse.address()
    common = ["--steps", str(args.steps), "--width", str(args.width)]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for label, flags in (("torchft, no scaler", ["--no-scaler"]), ("torchft + distamp", [])):
            key = "plain" if flags else "distamp"
            ready = [str(tmp / f"{key}{r}.ready") for r in range(2)]
            sync = ["--wait-for", *ready]
            a, _ = _run(addr, tmp, key, [
                (r, [*common, *flags, "--ready", ready[r], *sync]) for r in range(2)
            ])  # fmt: skip
            times = a["step_times"][5:]
            rows.append((label, statistics.median(times) * 1e3))
        heal = []
        for label, flags in (
            ("with scaler state", []),
            ("without scaler state", ["--no-heal-state"]),
        ):
            key = "heal" if not flags else "noheal"
            first = [str(tmp / f"{key}{r}.ready") for r in range(2)]
            back = str(tmp / f"{key}1b.ready")
            env_pairs = [
                (0, [*common, *flags, "--ready", first[0], "--wait-for", *first,
                     "--pause-at", "12", "--pause-until", back]),
                (1, [*common, *flags, "--ready", first[1], "--wait-for", *first,
                     "--exit-at", "10"]),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            procs = []
            for replica, extra in env_pairs:
                out = tmp / f"{key}{replica}.json"
                cmd = [sys.executable, str(SCRIPT), str(replica), addr, str(out), *extra]
                procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL))
            procs[1].wait(timeout=TIMEOUT)
            (b,) = _run(addr, tmp, f"{key}b", [(1, [*common, *flags, "--ready", back])])
            procs[0].wait(timeout=TIMEOUT)
            heal.append((label, b["first_commit_s"] * 1e3))
    lighthouse.shutdown()

    print(f"torchft {args.steps} steps, width {args.width}, 2 replica groups x 1 rank (gloo, CPU)")
    print(f"{'per-step time':<28}{'median ms':>12}")
    for label, ms in rows:
        print(f"{label:<28}{ms:>12.2f}")
    print(f"ratio distamp / no scaler: {rows[1][1] / rows[0][1]:.2f}x")
    print(f"{'time to heal (ready -> first commit)':<40}{'ms':>8}")
    for label, ms in heal:
        print(f"{label:<40}{ms:>8.1f}")


if __name__ == "__main__":
    main()
