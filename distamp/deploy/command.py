"""``distamp export CHECKPOINT_DIR -o FILE``: what the command prints and its exit codes.

The parser lives with the other subcommands in :mod:`distamp.cli`; this is the run: export the
checkpoint (:func:`~distamp.deploy.checkpoints.export_checkpoint`), then print where the file
went, what computes in fp32 and why, and the check's figures. A refusal (a missing extra, a
checkpoint of another model, a failed check) is one line on stderr naming the cause and the
fix, exit code 1; nothing is written then.
"""

from __future__ import annotations

import argparse
import sys

from distamp.deploy.check import ExportCheckError
from distamp.deploy.checkpoints import export_checkpoint
from distamp.deploy.targets import read_record
from distamp.engine.checkpoint import CheckpointError

__all__ = ["run_export"]


def run_export(args: argparse.Namespace) -> int:
    """Run ``distamp export`` with parsed ``args`` (checkpoint, output, target, check,
    auto_islands, max_batch, precision); returns the exit code."""
    try:
        path = export_checkpoint(
            args.checkpoint,
            args.output,
            target=args.target,
            check=args.check,
            auto_islands=args.auto_islands,
            max_batch=args.max_batch,
            precision=args.precision,
        )
    except (CheckpointError, ExportCheckError, ImportError, ValueError, RuntimeError) as exc:
        print(f"distamp export: error: {exc}", file=sys.stderr)
        return 1
    record = read_record(path)
    print(
        f"wrote {path} ({record['target']}; computes in {record['compute_dtype']}, "
        f"batch 1 to {record['dynamic_batch']['max']}); precision record: {path}.json"
    )
    for module in record["modules"]:
        name = module["module"] or "<model>"
        print(f"  {name}: {module['dtype']} ({module['source']}: {module['reason']})")
    check = record.get("check")
    if check is not None:
        for out in check["outputs"]:
            top1 = "" if out["top1"] is None else f", top-1 agreement {out['top1']:.4f}"
            print(
                f"  check on {check['samples']} inputs: {out['output']} max abs "
                f"{out['max_abs']:.3g}, max rel {out['max_rel']:.3g}{top1}"
            )
    runtime = record.get("runtime_check")
    if runtime is not None:
        print(
            f"  loaded and run with {runtime['runtime']}: max abs difference from the .pt2 "
            f"program {runtime['max_abs_vs_pt2']:.3g}"
        )
    return 0
