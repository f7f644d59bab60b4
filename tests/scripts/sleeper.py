"""A rank that joins a gloo group, records its pid and its parent's, then waits to be stopped.

Started by tests/test_launch_signals.py under ``distamp launch``: the test sends a signal to the
launcher and checks every recorded process is gone. Usage: ``sleeper.py DIR [SIGNAL CODE]``; with
SIGNAL and CODE the rank handles SIGNAL by exiting with CODE (a job that saves and exits), or
ignores it when CODE is ``ignore``; without them the signal's default action applies. Nearly idle
while it waits: the tests share small machines.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from distamp.cluster import init_distributed, shutdown_distributed

WAIT_S = 120.0  # longer than any test's timeout: the launcher must end it, not the clock


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    if len(argv) == 3 and argv[2] == "ignore":
        signal.signal(signal.Signals[argv[1]], signal.SIG_IGN)
    elif len(argv) == 3:
        code = int(argv[2])
        # os._exit: no interpreter teardown, which could wait on a gloo peer that is also leaving.
        signal.signal(signal.Signals[argv[1]], lambda _n, _f: os._exit(code))
    env = init_distributed(backend="gloo", timeout=30.0)
    dist.barrier()  # every rank is up before any of them says so
    # Written then renamed: the test reads a whole line or nothing.
    tmp = out / f".rank{env.rank}.tmp"
    tmp.write_text(f"{os.getpid()} {os.getppid()}\n")
    tmp.rename(out / f"rank{env.rank}.pid")
    time.sleep(WAIT_S)
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
