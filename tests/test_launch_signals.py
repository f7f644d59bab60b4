"""``distamp launch`` with real processes: signals reach every rank, the exit code is the one the
README's table gives, and no process of the job outlives the launcher.

Each test starts ``distamp launch --nproc-per-node 2`` on ``tests/scripts/sleeper.py`` (two gloo
ranks that record their pids and wait), signals the launcher alone, and checks what is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _dist import script_env

from distamp.cluster.supervise import child_pids

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

REPO = Path(__file__).resolve().parents[1]
SLEEPER = "tests/scripts/sleeper.py"
START_S = 60.0  # two ranks importing torch on a loaded 2-core machine: a few seconds, usually
END_S = 30.0  # from the signal to the launcher's exit


def _env() -> dict[str, str]:
    """This environment without a launcher's variables (the test may itself run under one)."""
    return script_env()


def _name(value: object) -> str:
    """Test ids: signal names, not numbers."""
    return value.name if isinstance(value, signal.Signals) else str(value)


def _alive(pid: int) -> bool:
    """Running, or stopped: anything but gone or a zombie (dead, its parent not yet told)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return text[text.rindex(b")") + 2 :].split()[0] != b"Z"


class Launch:
    """``distamp launch`` in a session of its own, its output captured, everything it started
    killed at the end whatever the test found."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "distamp.cli", "launch", *args],
            cwd=REPO,
            env=_env(),
            text=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # only the signals the test sends reach it
        )
        self.pids: set[int] = set()  # every process of the job seen so far
        self.output = ""

    def wait_for_ranks(self, out: Path, ranks: int = 2) -> dict[int, tuple[int, int]]:
        """Each rank's (pid, parent pid), once every rank has joined the group."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            self.pids.update(child_pids(self.proc.pid))
            files = [out / f"rank{r}.pid" for r in range(ranks)]
            if all(f.exists() for f in files):
                found = {}
                for rank, file in enumerate(files):
                    pid, parent = map(int, file.read_text().split())
                    found[rank] = (pid, parent)
                self.pids.update(pid for pid, _ in found.values())
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher ended before the ranks were up:\n{self.finish()}")
            time.sleep(0.1)
        pytest.fail(f"the ranks did not start within {START_S}s:\n{self.finish()}")

    def finish(self, timeout: float = END_S) -> str:
        """Wait for the launcher; its output."""
        try:
            self.output, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.output, _ = self.proc.communicate()
            pytest.fail(f"the launcher ran over {timeout}s after the signal:\n{self.output}")
        return self.output

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.pids]:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for launch in started:  # a failed test leaves nothing running either
        launch.kill()
        launch.proc.wait(timeout=10)


def _stop(
    launches: list[Launch], out: Path, sig: signal.Signals, *extra: str, opts: tuple[str, ...] = ()
) -> tuple[Launch, int]:
    """Launch the sleeper, send ``sig`` to the launcher once both ranks are up; the launch and
    its exit code, after checking that no process of the job is left."""
    launch = Launch(["--nproc-per-node", "2", *opts, SLEEPER, str(out), *extra])
    launches.append(launch)
    ranks = launch.wait_for_ranks(out)
    # The ranks are the launcher's own children: torchrun runs inside it.
    assert {parent for _, parent in ranks.values()} == {launch.proc.pid}
    launch.proc.send_signal(sig)
    launch.finish()
    left = sorted(pid for pid in launch.pids if _alive(pid))
    assert not left, f"still running after the launcher's exit: {left}\n{launch.output}"
    assert launch.proc.returncode is not None
    return launch, launch.proc.returncode


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGUSR1, 138)],
    ids=_name,
)
def test_signal_stops_every_rank(
    launches: list[Launch], tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """Ranks that die of the signal: 128 + N, the launcher's own traceback never printed."""
    launch, returned = _stop(launches, tmp_path, sig)
    assert returned == code, launch.output
    for text in ("SignalException", "ChildFailedError", "FAILED"):
        assert text not in launch.output
    if sig != signal.SIGINT:  # SIGINT is a KeyboardInterrupt in the ranks, with their traceback
        assert "Traceback" not in launch.output
    assert f"{sig.name} passed to the job; exit code {code}" in launch.output


@pytest.mark.timeout(120)
def test_handled_signal_gives_the_jobs_code(launches: list[Launch], tmp_path: Path) -> None:
    """Ranks that handle SIGTERM and exit 0 (launch/train.py saves, then exits 0 on SIGTERM or
    SIGUSR1): 0, not 143, so a batch script can tell a job that saved from one killed before it
    could. torchrun's own SIGTERM handler would have stopped the ranks itself and lost the code:
    this also shows the launcher kept the signal."""
    launch, returned = _stop(launches, tmp_path, signal.SIGTERM, "SIGTERM", "0")
    assert returned == 0, launch.output
    assert "Traceback" not in launch.output


@pytest.mark.timeout(120)
def test_ranks_ignoring_sigterm_are_killed(launches: list[Launch], tmp_path: Path) -> None:
    """SIGTERM ignored: SIGKILL after --grace-period, exit 137."""
    start = time.monotonic()
    launch, returned = _stop(
        launches, tmp_path, signal.SIGTERM, "SIGTERM", "ignore", opts=("--grace-period", "1")
    )
    assert returned == 128 + signal.SIGKILL, launch.output
    assert time.monotonic() - start < START_S + END_S


@pytest.mark.timeout(60)
def test_single_process_launch_passes_sigusr1(launches: list[Launch], tmp_path: Path) -> None:
    """``--launcher single`` (no torchrun): SIGUSR1 reaches the script, which dies of it: 138."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    launch = Launch(["--launcher", "single", str(script)])
    launches.append(launch)
    assert launch.proc.stdout is not None
    assert launch.proc.stdout.readline().strip() == "ready"
    launch.pids.update(child_pids(launch.proc.pid))
    launch.proc.send_signal(signal.SIGUSR1)
    launch.finish()
    assert launch.proc.returncode == 128 + signal.SIGUSR1, launch.output
    assert not [pid for pid in launch.pids if _alive(pid)]


@pytest.mark.timeout(90)
def test_usage_error_printed_once(launches: list[Launch]) -> None:
    """A usage error of the script under two ranks: exit 2, the message once, no traceback."""
    launch = Launch(["--nproc-per-node", "2", "launch/train.py", "--steps", "0"])
    launches.append(launch)
    output = launch.finish(timeout=START_S)
    assert launch.proc.returncode == 2, output
    assert output.count("usage: train.py") == 1, output
    assert output.count("error: argument --steps") == 1, output
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ctrl_c_saves_and_exits_130(launches: list[Launch], tmp_path: Path) -> None:
    """SIGINT to ``distamp launch ... launch/train.py --out DIR``: handled like SIGTERM (every
    rank stops at the next logging step after saving), exit 130 so that a shell still sees an
    interrupted command, and no KeyboardInterrupt traceback from the ranks."""
    out = tmp_path / "run"
    launch = Launch(
        ["--nproc-per-node", "2", "launch/train.py", "--steps", "200", "--log-interval", "1",
         "--threads", "1", "--out", str(out)]
    )  # fmt: skip
    launches.append(launch)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + START_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if launch.proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no progress from the job:\n{launch.finish()}")
        time.sleep(0.1)
    launch.pids.update(child_pids(launch.proc.pid))
    launch.proc.send_signal(signal.SIGINT)
    output = launch.finish(timeout=END_S + 30)
    assert launch.proc.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    summary = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
    assert summary["stopped_by_signal"] and 2 <= summary["steps"] < 200, summary
    assert (out / "latest.json").exists(), sorted(p.name for p in out.iterdir())
    assert "SIGINT passed to the job; exit code 130" in output
