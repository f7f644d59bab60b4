"""Running a launch to its end: signals passed on to the job, every process of it waited for, and
one exit code that says how the job ended.

``distamp launch`` forwards SIGTERM, SIGINT and SIGUSR1 (SLURM's "time is nearly up" signal, see
``multinode/*.sbatch``) to the processes that run the script, and exits with the job's code:

===================================  ============================================================
how the job ended                    exit code of ``distamp launch``
===================================  ============================================================
every rank exited 0                  0 (also after a signal the job handled: saved, then exited)
first failed rank exited with C      C (2: a usage error of the script); torchrun then stops the
                                     other ranks, whose codes do not count
first failed rank died of signal N   128 + N (SIGINT 130, SIGUSR1 138, SIGTERM 143)
alive ``grace_s`` after SIGTERM or   137 (SIGKILL). SIGUSR1 sets no deadline: the job decides
SIGINT                               when it has saved
===================================  ============================================================

torchrun runs in this process (:func:`run_torchrun`) rather than as a child, because a child
torchrun hides the ranks' exit codes: it exits 1 with a traceback whatever they were, and by
default it dies of SIGUSR1 at once, leaving its ranks running (checked with torch 2.13). Here the
ranks are this process's own children, so they are found, signalled, and waited for; none
outlives the launch. The other launchers (mpirun, srun, a single process) run as one child whose
own code is the job's (:func:`run_command`).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "FORWARDED",
    "GRACE_S",
    "SignalRelay",
    "child_pids",
    "shell_code",
    "run_command",
    "run_torchrun",
]

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOPPING = (signal.SIGTERM, signal.SIGINT)  # requests to stop now: a deadline, then SIGKILL
GRACE_S = 30.0  # torchrun's own default before it kills workers that ignore its stop signal
REAP_S = 5.0  # after SIGKILL: only a process stuck in the kernel (a hung device) takes longer


def shell_code(code: int) -> int:
    """A process's exit code as a shell reports it: 128 + N for death by signal N (which
    :mod:`subprocess` and torchrun report as -N)."""
    return 128 - code if code < 0 else code


def child_pids(parent: int) -> list[int]:
    """Live (not zombie) children of ``parent``, read from ``/proc``; empty without one."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # not Linux: callers fall back on the launcher's own shutdown
        return []
    found = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:  # exited while we looked
            continue
        # The command name (field 2) may hold spaces and ")": the fields after the last ")" are
        # state, ppid, ...
        fields = text[text.rindex(b")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] != b"Z":
            found.append(int(name))
    return found


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group when it leads one, else to ``pid``.

    torchrun starts every rank in a session of its own: signalling the group reaches the rank's
    own children too, as torchrun's shutdown does."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:  # already gone
        pass


class SignalRelay:
    """Passes SIGTERM, SIGINT and SIGUSR1 on to a running job while the ``with`` block runs.

    ``deliver(sig)`` sends a signal to the job's processes and says whether there was any. With
    none, ``on_idle(sig)`` runs (torchrun's: stop before starting ranks). After SIGTERM or SIGINT
    a timer sends SIGKILL to what is left after ``grace_s``. The previous handlers come back on
    exit. Handlers are installed only from the main thread (Python allows no other).
    """

    def __init__(
        self,
        deliver: Callable[[int], bool],
        *,
        grace_s: float = GRACE_S,
        on_idle: Callable[[int], None] | None = None,
    ) -> None:
        self.deliver = deliver
        self.grace_s = grace_s
        self.on_idle = on_idle
        self.received: list[int] = []
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalRelay:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self.handle) for s in FORWARDED}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def reinstall(self) -> None:
        """Take the signals back (from a library that installed its own handlers meanwhile)."""
        if self._previous:
            for sig in FORWARDED:
                signal.signal(sig, self.handle)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        """The signal handler. Nothing printed here: a handler may interrupt a write to the same
        stream, which Python refuses (a reentrant call)."""
        self.received.append(signum)
        if not self.deliver(signum) and self.on_idle is not None:
            self.on_idle(signum)
        if signum in STOPPING and self._timer is None:
            self._timer = threading.Timer(self.grace_s, self.deliver, args=(signal.SIGKILL,))
            self._timer.daemon = True
            self._timer.start()

    def note(self, code: int) -> None:
        """One line on stderr after a signal: what reached the job and how it ended."""
        if self.received:
            names = ", ".join(dict.fromkeys(signal.Signals(s).name for s in self.received))
            print(f"distamp launch: {names} passed to the job; exit code {code}", file=sys.stderr)


def run_command(cmd: Sequence[str], *, grace_s: float = GRACE_S) -> int:
    """Run ``cmd`` (mpirun, srun or the script itself) with the signals relayed; its exit code.

    Raises:
        FileNotFoundError: ``cmd[0]`` is not on PATH.
    """
    proc = subprocess.Popen(list(cmd))

    def deliver(sig: int) -> bool:
        # Ctrl-C in a terminal already reached the child (same foreground process group);
        # sending it twice would interrupt the child's own cleanup (mpirun's, srun's).
        if sig != signal.SIGINT or not terminal_foreground():
            proc.send_signal(sig)  # a no-op once the child is gone
        return True

    with SignalRelay(deliver, grace_s=grace_s) as relay:
        code = proc.wait()
    code = shell_code(code)
    relay.note(code)
    return code


def terminal_foreground() -> bool:
    """Whether this process's group owns the terminal (so Ctrl-C reached all of it)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal, closed or replaced stdin
        return False


def run_torchrun(argv: Sequence[str], *, grace_s: float = GRACE_S) -> int:
    """Run torchrun (``torch.distributed.run``'s options, the script, its arguments) in this
    process with the signals relayed to its ranks; the job's exit code (table above).

    A failure prints torchrun's summary of the failed ranks without this process's traceback;
    a usage error (the first failed rank exited 2) prints nothing more than the script did.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as elastic_run

    own = os.getpid()

    def deliver(sig: int) -> bool:
        ranks = child_pids(own)
        for pid in ranks:
            signal_group(pid, sig)
        return bool(ranks)

    def stop_agent(sig: int) -> None:
        # No rank to pass it to (rendezvous, or between starts): torchrun's own stop signal ends
        # its agent, which shuts down whatever it started with that signal.
        raise SignalException(f"distamp launch got {signal.Signals(sig).name}", signal.Signals(sig))

    options = list(argv)
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch >= 2.10: torchrun would install its own handlers for SIGTERM and SIGINT when the
        # ranks start, replacing the relay's. Older versions do so regardless; they then stop
        # the ranks themselves (exit 128 + N, the ranks' own codes unknown).
        options = ["--signals-to-handle", "SIGHUP,SIGQUIT", *options]
    relay = SignalRelay(deliver, grace_s=grace_s, on_idle=stop_agent)
    code = 0
    with relay:
        try:
            elastic_run(parse_args(options))
        except ChildFailedError as exc:
            # The root cause: the ranks torchrun stopped after it (SIGTERM) are failures too.
            code = shell_code(exc.get_first_failure()[1].exitcode)
            if code != 2 and not relay.received:  # not a usage error, not a stop we were asked for
                print(exc, file=sys.stderr)
        except SignalException as exc:  # before the ranks started, or torchrun's own handlers
            code = 128 + int(exc.sigval)
        finally:
            relay.on_idle = None  # from here a signal must not interrupt the cleanup below
            relay.reinstall()
            reap_children(own, grace_s=REAP_S)
    relay.note(code)
    return code


def reap_children(parent: int, *, grace_s: float) -> None:
    """Kill (SIGKILL, process group) and wait for any child left running: normally none, as
    torchrun waits for its ranks; a signal that came while the ranks were starting can leave one
    torchrun no longer tracks."""
    left = child_pids(parent)
    for pid in left:
        signal_group(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped by torchrun's own Popen meanwhile
                done = pid
            if done:
                left.remove(pid)
        time.sleep(0.05)
