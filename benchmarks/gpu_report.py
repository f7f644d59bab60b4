"""One report per device run: the GPU tests and every GPU benchmark, in one JSON and one Markdown.

    python benchmarks/gpu_report.py --out DIR [--device cuda|cpu] [--budget 480]

Writes ``DIR/gpu_report.json`` (everything, raw outputs included) and ``DIR/gpu_report.md`` (the
tables the documentation quotes), headed by the device, driver, torch, Triton, date and commit.
The sections run one after another, each in its own process with its own time limit, sized to
fit together in about 8 minutes on one H100 or H200 (``--budget`` seconds; a section that would
start with less than :data:`MIN_SECONDS` left is recorded as skipped, and a failed or timed-out
one as such, with its output's tail: the others still run):

1. ``tests``: ``pytest -m gpu`` over the suite (the CUDA kernels, the scaler on CUDA, the fp8
   exchange kernels bit for bit against the eager path, the unscale routing on CUDA);
2. ``end_to_end``: the main job's medium GPT in fp16 and bf16, tokens/s of distamp's engine and
   of the drop-in scaler against a plain torch AMP loop (``benchmarks/end_to_end.py``);
3. ``host_overhead``: the scaler's host time per step against torch's, 500 tensors;
4. ``fp8_exchange``: the 8-bit exchange per bucket, eager against the kernels, and DDP steps;
5. ``unscale_bandwidth``: the fused unscale against torch's, in read-pass equivalents;
6. ``overflow_diagnostics``: the cost of the overflow report and tracer per step;
7. ``fp8``: fp8 against bf16 step time and losses at 1024 and 4096 wide (``torch.compile``);
8. ``policy_accuracy``: how far bf16 drifts from fp32, with and without a policy.

``--device cpu`` is a dry run of the same pipeline at tiny sizes (the GPU tests skip without
CUDA; the benchmarks run in this process, which spares a Python start per section): it checks
the pipeline, not the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import io
import json
import platform
import runpy
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
MIN_SECONDS = 15  # a section needs at least this much budget to start
CPU_TESTS = ("tests/test_unscale_routing.py", "tests/test_fp8_exchange.py", "tests/test_kernels.py")


@dataclass(frozen=True)
class Section:
    """One step of the report: a script and its arguments per device, a time limit, and whether
    the script writes ``--json``."""

    name: str
    title: str
    script: str
    cuda: tuple[str, ...]
    cpu: tuple[str, ...]
    timeout: float
    writes_json: bool = False


SECTIONS = (
    Section("end_to_end", "End to end: the main job's medium GPT, tokens/s", "end_to_end.py",
            ("--device", "cuda", "--size", "medium", "--precisions", "fp16,bf16", "--steps", "30",
             "--warmup", "5", "--batch-size", "32"),
            ("--device", "cpu", "--size", "tiny", "--precisions", "fp16,bf16", "--steps", "2",
             "--warmup", "1", "--batch-size", "2"), 90, True),
    Section("host_overhead", "Host time per step against torch's scaler (500 tensors)",
            "host_overhead.py", ("--device", "cuda", "--tensors", "500", "--rounds", "30"),
            ("--device", "cpu", "--tensors", "8", "--rounds", "2"), 90, True),
    Section("fp8_exchange", "The 8-bit gradient exchange: eager against the kernels",
            "fp8_exchange.py", ("--device", "cuda", "--bucket-mb", "25", "--world", "8",
                                "--size", "medium", "--batch-size", "16", "--steps", "20"),
            ("--device", "cpu", "--bucket-mb", "0.25", "--world", "4", "--repeats", "2",
             "--size", "tiny", "--batch-size", "2", "--steps", "2", "--warmup", "1"), 90, True),
    Section("unscale_bandwidth", "Fused unscale against torch's (read-pass equivalents)",
            "unscale_bandwidth.py", ("--device", "cuda", "--sizes", "10M,200M", "--tensors",
                                     "500", "--dtype", "fp32,bf16", "--repeats", "10"),
            ("--device", "cpu", "--sizes", "20K", "--tensors", "10", "--dtype", "fp32",
             "--repeats", "2", "--no-graphs"), 90),
    Section("overflow_diagnostics", "Cost of the overflow report per step",
            "overflow_diagnostics.py", ("--device", "cuda", "--steps", "20"),
            ("--device", "cpu", "--steps", "2"), 60),
    Section("fp8", "fp8 against bf16 (torch.compile on CUDA)", "fp8.py",
            ("--device", "cuda", "--widths", "1024,4096", "--steps", "20", "--warmup", "5"),
            ("--device", "cpu", "--widths", "32", "--steps", "2", "--warmup", "1",
             "--batch-size", "2", "--context", "16"), 150, True),
    Section("policy_accuracy", "bf16 drift from fp32, with and without a policy",
            "policy_accuracy.py", ("--device", "cuda", "--steps", "40"),
            ("--device", "cpu", "--steps", "2"), 60),
)  # fmt: skip


@dataclass
class Result:
    """What one section gave: status ``ok``, ``failed``, ``timeout`` or ``skipped``."""

    name: str
    title: str
    command: str
    status: str = "skipped"
    seconds: float = 0.0
    returncode: int | None = None
    output: str = ""
    data: Any = None
    notes: list[str] = field(default_factory=list)


def _run(cmd: list[str], timeout: float) -> tuple[str, int | None, str]:
    """(status, return code, output) of a subprocess run from the checkout's root."""
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return "timeout", None, out
    status = "ok" if proc.returncode == 0 else "failed"
    return status, proc.returncode, proc.stdout + ("\n" + proc.stderr if proc.stderr else "")


def _run_here(script: Path, argv: list[str]) -> tuple[str, int | None, str]:
    """A benchmark's ``main`` in this process (the dry run): its stdout, and ``failed`` with the
    exception when it raises. Intra-op threads are restored afterwards."""
    threads, saved_argv = torch.get_num_threads(), sys.argv
    buffer = io.StringIO()
    status, code = "ok", 0
    try:
        sys.argv = [str(script), *argv]
        with contextlib.redirect_stdout(buffer):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        status = "ok" if code == 0 else "failed"
    except Exception as exc:  # recorded in the report: the next section still runs
        status, code = "failed", 1
        buffer.write(f"\n{type(exc).__name__}: {exc}\n")
    finally:
        sys.argv = saved_argv
        torch.set_num_threads(threads)
    return status, code, buffer.getvalue()


def _tests(out: Path, device: str, timeout: float) -> Result:
    """``pytest -m gpu``, parsed from its JUnit XML: counts and the failed tests' names."""
    xml = out / "gpu_tests.xml"
    paths = ["tests"] if device == "cuda" else list(CPU_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *paths]  # fmt: skip
    result = Result("tests", "GPU tests (pytest -m gpu)", shlex.join(["python", *cmd[1:]]))
    start = time.monotonic()
    result.status, result.returncode, output = _run(cmd, timeout)
    result.seconds = time.monotonic() - start
    result.output = output[-8000:]
    if result.returncode == 5:  # pytest: nothing selected (no test carries the mark)
        result.status = "ok"
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        assert suite is not None
        cases = suite.findall("testcase")
        failed = [
            f"{c.get('classname')}::{c.get('name')}"
            for c in cases
            if c.find("failure") is not None or c.find("error") is not None
        ]
        skipped = sum(c.find("skipped") is not None for c in cases)
        result.data = {
            "total": len(cases),
            "failed": failed,
            "skipped": skipped,
            "passed": len(cases) - len(failed) - skipped,
        }
    return result


def _section(section: Section, out: Path, device: str, timeout: float) -> Result:
    script = BENCH / section.script
    argv = list(section.cuda if device == "cuda" else section.cpu)
    json_path = out / f"{section.name}.json"
    if section.writes_json:
        argv += ["--json", str(json_path)]
    command = shlex.join(["python", f"benchmarks/{section.script}", *argv])
    result = Result(section.name, section.title, command)
    start = time.monotonic()
    if device == "cuda":
        cmd = [sys.executable, str(script), *argv]
        result.status, result.returncode, output = _run(cmd, timeout)
    else:
        result.status, result.returncode, output = _run_here(script, argv)
    result.seconds = time.monotonic() - start
    result.output = output[-8000:]
    if section.writes_json and json_path.exists():
        result.data = json.loads(json_path.read_text("utf-8"))
    return result


def _git_commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
    return (done.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


def environment(device: str) -> dict[str, Any]:
    """The machine and the software the figures come from."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    env: dict[str, Any] = {
        "device": "CPU (dry run: tiny sizes, the figures mean nothing)",
        "driver": "n/a",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "n/a",
        "triton": triton,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git_commit(),
        "host": f"{platform.machine()}, {torch.get_num_threads()} threads",
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["device"] = f"{props.name} (sm_{props.major}{props.minor}, " \
                        f"{props.total_memory / 2**30:.0f} GiB)"  # fmt: skip
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            )  # fmt: skip
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "unknown"
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = "unknown (no nvidia-smi)"
    return env


# --- Markdown ---------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _md_tests(data: dict[str, Any]) -> list[str]:
    counts = [data["passed"], len(data["failed"]), data["skipped"], data["total"]]
    lines = _table(["passed", "failed", "skipped", "total"], [counts])
    return lines + [f"- failed: `{name}`" for name in data["failed"]]


def _md_end_to_end(data: dict[str, Any]) -> list[str]:
    rows = []
    for row in data["rows"]:
        for kind in ("torch", "drop-in", "engine"):
            r = row[kind]
            ratio = f"{r['vs_torch']:.2f}" if "vs_torch" in r else "1.00"
            rows.append([row["precision"], kind, f"{r['ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                         ratio, f"{r['loss']:.4f}"])  # fmt: skip
    return _table(["precision", "loop", "ms/step", "tokens/s", "vs torch", "last loss"], rows)


def _md_host_overhead(data: dict[str, Any]) -> list[str]:
    rows = []
    for row in data["rows"]:
        t = row["torch"]
        cells = [row["optimizer"], row["path"], f"{t['ms']:.3f} / {t['scaler_ms']:.3f}"]
        for kind in ("distamp", "drop-in"):
            d = row[kind]
            ratios = f"{d['ms'] / t['ms']:.2f} / {d['scaler_ms'] / t['scaler_ms']:.2f}"
            cells.append(f"{d['ms']:.3f} / {d['scaler_ms']:.3f} ({ratios})")
        rows.append(cells)
    head = ["optimizer", "path", "torch step / scaler ms", "distamp (ratio)", "drop-in (ratio)"]
    return _table(head, rows)


def _md_fp8_exchange(data: dict[str, Any]) -> list[str]:
    lines = _table(["backend", "host ms per bucket", "device ms per bucket"],
                   [[b, f"{r['host_ms']:.3f}", f"{r['device_ms']:.3f}"]
                    for b, r in data["buckets"].items()])  # fmt: skip
    base = data["steps"]["fp32"]["torch"]
    rows = [[hook, backend, f"{ms:.2f}", f"{ms / base:.2f}"]
            for hook, by in data["steps"].items() for backend, ms in by.items()]  # fmt: skip
    return [*lines, "", *_table(["hook", "backend", "ms/step", "vs fp32 hook"], rows)]


def _md_fp8(data: dict[str, Any]) -> list[str]:
    rows = [[r["d"], f"{r['lr']:.1e}", f"{r['bf16_ms']:.1f}", f"{r['fp8_ms']:.1f}",
             f"{r['ratio']:.2f}", f"{r['bf16_first']:.3f} -> {r['bf16_loss']:.3f}",
             f"{r['fp8_first']:.3f} -> {r['fp8_loss']:.3f}"] for r in data["rows"]]  # fmt: skip
    return _table(["d", "lr", "bf16 ms", "fp8 ms", "fp8/bf16", "bf16 loss", "fp8 loss"], rows)


RENDER: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "tests": _md_tests,
    "end_to_end": _md_end_to_end,
    "host_overhead": _md_host_overhead,
    "fp8_exchange": _md_fp8_exchange,
    "fp8": _md_fp8,
}


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = ["# distamp device report", ""]
    lines += _table(["", ""], [[k, v] for k, v in env.items()] + [["command", report["command"]]])
    lines += ["", "## Sections", ""]
    lines += _table(["section", "status", "seconds", "command"],
                    [[r["name"], r["status"], f"{r['seconds']:.0f}", f"`{r['command']}`"]
                     for r in report["sections"]])  # fmt: skip
    for r in report["sections"]:
        lines += ["", f"## {r['title']}", ""]
        render = RENDER.get(r["name"])
        if r["status"] == "skipped":
            lines.append("Skipped: " + "; ".join(r["notes"] or ["no budget left"]) + ".")
        elif render is not None and r["data"] is not None:
            lines += render(r["data"])
        if r["status"] not in ("ok", "skipped") or (render is None and r["output"]):
            if r["status"] != "ok":
                lines += [f"Status `{r['status']}`; the output's end:", ""]
            tail = "\n".join(r["output"].strip().splitlines()[-40:])
            lines += ["```text", tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the report files")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all sections")
    p.add_argument("--only", default="", help="comma-separated section names (default: all)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device (--device cpu: the dry run)")
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = {s for s in args.only.split(",") if s}
    deadline = time.monotonic() + args.budget
    results: list[Result] = []
    names = ["tests", *(s.name for s in SECTIONS)]
    for name in names:
        if wanted and name not in wanted:
            continue
        left = deadline - time.monotonic()
        section = next((s for s in SECTIONS if s.name == name), None)
        if left < MIN_SECONDS:
            script = "pytest -m gpu" if section is None else f"benchmarks/{section.script}"
            results.append(Result(name, name if section is None else section.title, script,
                                  notes=[f"{left:.0f} s of the budget left"]))  # fmt: skip
            continue
        timeout = min(left, 180.0 if section is None else section.timeout)
        result = (_tests(args.out, args.device, timeout) if section is None
                  else _section(section, args.out, args.device, timeout))  # fmt: skip
        print(f"{result.name:22} {result.status:8} {result.seconds:6.1f} s", flush=True)
        results.append(result)
    report = {
        "environment": environment(args.device),
        "command": shlex.join(["python", "benchmarks/gpu_report.py", *(argv or sys.argv[1:])]),
        "budget_s": args.budget,
        "sections": [vars(r) for r in results],
    }
    (args.out / "gpu_report.json").write_text(json.dumps(report, indent=1) + "\n", "utf-8")
    (args.out / "gpu_report.md").write_text(markdown(report), "utf-8")
    print(f"wrote {args.out / 'gpu_report.json'} and {args.out / 'gpu_report.md'}")
    return 0 if all(r.status in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
