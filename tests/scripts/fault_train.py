"""A small deterministic DistAMP training job for the fault tests (kill, resume, stall).

Started by ``torchrun`` from ``tests/test_resume.py`` and ``tests/test_reliability.py``. It trains
a tiny MLP in fp16 (so the loss scaler is live) with a NaN loss on rank 1 at fixed steps (each is
skipped on every rank), checkpoints every ``--checkpoint-interval`` steps, resumes from ``--out``
when a checkpoint is there, and appends one line per step to ``--progress`` so that a test can
SIGKILL a worker from outside at the step it chose. At the end every rank writes its full model,
optimizer and scaler state to ``--result``/``rank_<r>.pt`` for a bitwise comparison.

Two faults are injected from inside, because they need an exact point rather than a step:
``--kill-in-save STEP:POINT`` SIGKILLs a rank in the middle of the checkpoint write of STEP (only
in the first round, so the restarted job can finish), and ``--stall-at STEP`` makes rank 1 stop
participating (it sleeps) so that the other rank's collective must time out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import distamp.engine.checkpoint as ckpt
import distamp.engine.checkpoint_save as ckpt_save
from distamp.engine import DistAMP

NAN_LOSS_STEPS = (3, 11)  # rank 1's loss is NaN before scaling at these steps
ROUND = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--checkpoint-interval", type=int, default=2)
    p.add_argument("--progress", type=Path, default=None, help="one line per step, appended")
    p.add_argument("--result", type=Path, default=None, help="where rank_<r>.pt goes at the end")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--timeout", type=float, default=30.0, help="DistAMP(timeout=...)")
    p.add_argument("--kill-in-save", default=None, help="STEP:POINT, POINT in state|trainer|commit")
    p.add_argument("--stall-at", type=int, default=None, help="rank 1 stops at this step")
    return p.parse_args()


def batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Micro-batch ``k`` of ``rank``: a pure function of both, so a resumed run draws the same."""
    g = torch.Generator().manual_seed(1000 * k + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True), rank == 1 and k in NAN_LOSS_STEPS


def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor, bool]) -> torch.Tensor:
    x, y, poisoned = b
    loss = (model(x).float() - y).square().mean()
    return loss * float("nan") if poisoned else loss


def arm_kill_in_save(spec: str, rank: int) -> None:
    """SIGKILL this process at POINT of the save of STEP (first round only).

    state: rank 1, after DCP wrote its shards (the temporary directory is half full);
    trainer: rank 0, before trainer.pt is written; commit: rank 0, just before the manifest is
    replaced (the step directory is already renamed into place, the manifest still old).
    """
    step_s, point = spec.split(":")
    tmp_name = f".step_{int(step_s):08d}.tmp"
    if ROUND != 0:
        return

    def die() -> None:
        sys.stderr.write(f"fault_train: SIGKILL in save of step {step_s} at {point}\n")
        os.kill(os.getpid(), signal.SIGKILL)

    save = ckpt_save._save_synced

    def save_or_die(obj: Any, path: Path) -> None:
        if path.parent.name == tmp_name:
            if point == "state" and rank == 1 and path.name.startswith("rng_"):
                die()
            if point == "trainer" and rank == 0 and path.name == "trainer.pt":
                die()
        save(obj, path)

    replace = os.replace

    def replace_or_die(src: Any, dst: Any) -> None:
        committed = Path(dst).parent / f"step_{int(step_s):08d}"
        if point == "commit" and Path(dst).name == ckpt.MANIFEST and committed.is_dir():
            die()
        replace(src, dst)

    ckpt_save._save_synced = save_or_die  # type: ignore[assignment]
    os.replace = replace_or_die  # type: ignore[assignment]


def dump_result(amp: DistAMP, path: Path, rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    msd, osd = get_state_dict(amp.model, amp.optimizer, options=options)
    path.mkdir(parents=True, exist_ok=True)
    state = {"model": msd, "optim": osd, "scaler": amp.scaler.state_dict(), "step": amp.step_count}
    torch.save(state, path / f"rank_{rank}.pt")


def main() -> int:
    args = parse()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # identical init on every rank
    amp = DistAMP(precision="fp16", strategy=args.strategy, max_grad_norm=1.0, timeout=args.timeout)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    amp.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-2))
    rank = torch.distributed.get_rank()
    if args.kill_in_save:
        arm_kill_in_save(args.kill_in_save, rank)
    resumed_from = amp.step_count if amp.load_state(args.out) else None

    def on_step(done: int) -> None:
        if args.progress is not None:
            with open(args.progress, "a") as f:  # one short write per line: ranks share the file
                f.write(json.dumps({"step": done, "rank": rank, "pid": os.getpid(), "round": ROUND})
                        + "\n")  # fmt: skip
        if args.stall_at is not None and done == args.stall_at and rank == 1:
            sys.stderr.write(f"fault_train: rank 1 stalls after step {done}\n")
            time.sleep(3600)
        time.sleep(args.step_delay)

    t0 = time.monotonic()
    try:
        amp.fit(
            lambda k: batch(rank, k),
            loss_fn,
            steps=args.steps,
            log_interval=4,
            on_step=on_step,
            checkpoint_dir=args.out,
            checkpoint_interval=args.checkpoint_interval,
        )
    except Exception as exc:
        # What a stalled peer looks like from here: report how long it took and the message.
        sys.stderr.write(
            json.dumps({"rank": rank, "error": str(exc), "type": type(exc).__name__,
                        "failed_after_s": round(time.monotonic() - t0, 2)}) + "\n"
        )  # fmt: skip
        raise
    if args.result is not None:
        dump_result(amp, args.result, rank)
    if rank == 0:
        print(json.dumps({"steps": amp.step_count, "resumed_from": resumed_from, "round": ROUND,
                          "skipped_steps": amp.scaler.skipped_steps}), flush=True)  # fmt: skip
    amp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
