"""Run a function on N real processes joined by a gloo process group, with a hard timeout.

The one multi-process harness of the tests and the benchmarks: every multi-process test and
benchmark goes through :func:`run_ranks`, so that a hang fails within ``timeout`` seconds
instead of stalling CI, a worker's traceback reaches the caller, and every worker leaves its
process group destroyed.

Workers are forked from a ``forkserver`` that imported torch and distamp once (where the
platform has one; ``spawn`` elsewhere). Each call still gets fresh processes, so nothing one
call does reaches the next, but not a fresh interpreter: importing torch and distamp costs
about 5 s a process on a small CPU machine, and most tests' scenarios run for less than
that. The caller's environment at the call is the worker's (a forked worker would otherwise
see the server's, taken when it started).
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distamp.cluster.main_address import free_port

__all__ = ["RankPool", "run_ranks"]

# Imported once by the fork server, before it forks any worker: torch, the torch.distributed
# layers the parallel layouts use (DTensor, FSDP, DCP, pipelining) and dynamo (torch.compile),
# about 4 s a process between them. Nothing here may start a thread or initialise CUDA at import
# (a fork would copy a half-held lock or an unusable CUDA context): none does. Nothing here may
# read at import an environment variable a caller may change between calls either: dynamo
# brings Triton in, which reads ``TRITON_INTERPRET`` when a kernel is defined, and distamp's
# kernels are defined in the worker, on first use. The frameworks stay out for that reason.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch._dynamo",
    "distamp",
    "distamp.cluster.spawn",
]


def _context() -> Any:
    """The start method's context: a fork server that preloaded :data:`_PRELOAD` if the
    platform has one, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs: it keeps its own
    return ctx


def _caller_environment(env: dict[str, str]) -> None:
    """Make the worker's environment the caller's at the call, as ``spawn`` would have it."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)


def _rank_environment(
    rank: int, world_size: int, port: int, threads: int, env: dict[str, str]
) -> None:
    """The caller's environment plus what a launcher would set for this rank (rendezvous on
    this host), and its threads."""
    _caller_environment(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    args: tuple[Any, ...],
    results: Any,
    threads: int,
    env: dict[str, str],
) -> None:
    _rank_environment(rank, world_size, port, threads, env)
    try:
        try:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        except Exception as exc:  # the port may be taken between free_port() and the bind
            if "address already in use" in str(exc).lower() or "eaddrinuse" in str(exc).lower():
                results.put((rank, "port", str(exc)))
                return
            raise
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
    except BaseException:  # report everything, including AssertionError from the scenario
        results.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Each rank runs with ``threads`` intra-op threads (1 by default: N ranks on a small machine
    would otherwise oversubscribe its cores). Returns the per-rank return values (which must be
    picklable), in rank order. Raises
    ``RuntimeError`` with the worker's traceback if any rank failed, and ``TimeoutError`` (after
    killing every worker) if the ranks did not all finish within ``timeout`` seconds. A
    rendezvous port taken by another process before rank 0 bound it is retried with a new one.
    """
    for _ in range(2):
        try:
            return _spawn(fn, world_size, args, timeout, threads)
        except _PortTaken:
            continue  # another process took the port before rank 0 bound it: a new one
    try:
        return _spawn(fn, world_size, args, timeout, threads)
    except _PortTaken:
        raise RuntimeError("3 free ports in a row were taken before rank 0 bound them") from None


class _PortTaken(Exception):
    """Rank 0 could not bind the port :func:`free_port` returned: another process took it in
    between (the rendezvous failed before ``fn`` ran, so a new port is safe to try)."""


def _spawn(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float, threads: int
) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, timeout, args, results, threads, env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, tuple[str, Any]] = {}
    errors: list[str] = []
    port_taken = False
    try:
        deadline = time.monotonic() + timeout
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish "
                    f"within {timeout:.0f}s"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and all(i not in collected for i in dead):
                    # A rank crashed hard (segfault, os._exit) without reporting.
                    codes = {i: procs[i].exitcode for i in dead}
                    raise RuntimeError(f"rank(s) died without a result: {codes}") from None
                continue
            collected[rank] = (status, payload)
            if status == "port":
                port_taken = True
                break
            if status == "err":
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not (errors or port_taken) else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if port_taken:
        raise _PortTaken
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [collected[r][1] for r in range(world_size)]


def _pool_worker(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    tasks: Any,
    results: Any,
    threads: int,
    env: dict[str, str],
) -> None:
    """One rank of a :class:`RankPool`: join the group once, then run tasks until told to stop."""
    _rank_environment(rank, world_size, port, threads, env)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, "ok", fn(rank, world_size, *args)))
            except BaseException:
                results.put((rank, "err", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks started once, then handed many calls: for a property test
    that runs a few steps per example, where starting processes per example would cost more
    than the example.

    :meth:`run` has :func:`run_ranks`' contract (per-rank results in rank order; a rank's
    traceback as ``RuntimeError``; ``TimeoutError`` after ``timeout`` seconds). A failed or
    timed-out call stops the ranks (one may be inside a collective the others left); the next
    call starts fresh ones. Use it as a context manager.
    """

    def __init__(self, world_size: int = 2, *, timeout: float = 120.0, threads: int = 1) -> None:
        self.world_size, self.timeout, self.threads = world_size, timeout, threads
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port, world, env = free_port(), self.world_size, dict(os.environ)
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(
                    r,
                    world,
                    port,
                    self.timeout,
                    self._tasks[r],
                    self._results,
                    self.threads,
                    env,
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank of the pool (``fn`` importable by name:
        a module-level function)."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        collected: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        try:
            while len(collected) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.world_size)) - set(collected))
                    raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} in time")
                try:
                    rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = {i: p.exitcode for i, p in enumerate(self._procs) if not p.is_alive()}
                    if dead:
                        raise RuntimeError(f"rank(s) died without a result: {dead}") from None
                    continue
                collected[rank] = (status, payload)
        except BaseException:
            self.close()
            raise
        errors = [f"--- rank {r} ---\n{p}" for r, (s, p) in sorted(collected.items()) if s == "err"]
        if errors:
            self.close()
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
        return [collected[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (politely when they are idle, else killed)."""
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
