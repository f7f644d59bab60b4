"""What every launcher environment provides, and the parsing its variables share.

A launcher environment is a stateless class: :meth:`LauncherEnvironment.detect` says whether that
launcher started this process, :meth:`LauncherEnvironment.read` parses its variables into a
:class:`~distamp.cluster.DistEnv`. Both take the environment as a ``Mapping`` and only read it,
so each launcher is tested with plain dicts. Every parsing error names the variable and echoes
its value.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from distamp.cluster.dist_env import DistEnv

__all__ = ["LauncherEnvironment", "block_node_rank", "first_set", "read_int", "read_world"]


class LauncherEnvironment(ABC):
    """One launcher family: how to recognise it and how to read where this process sits.

    Never instantiated: detection asks the classes, in the order of
    :data:`distamp.cluster.detection.ENVIRONMENTS`.
    """

    name: ClassVar[str]
    """The launcher's name in :class:`DistEnv` and in ``DISTAMP_LAUNCHER``."""

    mpi: ClassVar[bool] = False
    """True when the environment carries no main address: rank 0 shares one over MPI."""

    @classmethod
    @abstractmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        """Whether this launcher started the process whose environment is ``env``.

        Only looks at which variables are present (and, where launchers nest, whether they
        agree); never parses values, so a malformed variable is reported by :meth:`read` with
        its name rather than silently selecting another launcher.
        """

    @classmethod
    @abstractmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        """Parse this launcher's variables into a :class:`DistEnv`.

        Called when :meth:`detect` matched or when ``DISTAMP_LAUNCHER`` names this launcher, so
        a required variable may be missing. ``MASTER_ADDR``/``MASTER_PORT`` are applied by the
        caller afterwards; the address and port returned here are the launcher's own.

        Raises:
            ValueError: a variable is missing, not an integer or inconsistent with another;
                the message names it.
        """


INT32_MAX = 2**31 - 1
"""Ranks, sizes and node indices end up in torch's int32 arguments: larger values are refused."""


def read_int(env: Mapping[str, str], name: str, *, low: int = 0, high: int = INT32_MAX) -> int:
    """The integer value of ``env[name]`` in ``[low, high]``, or a ``ValueError`` naming ``name``,
    echoing the value and giving the range. No launcher variable is negative, so a ``-1`` is
    refused here rather than used as a Python index further on."""
    value = env.get(name)
    if value is None:
        raise ValueError(
            f"{name} is not set, though other variables of its launcher are: set it, or name the "
            "launcher with DISTAMP_LAUNCHER"
        )
    # Stricter than int(), which takes "1_0"; 30 digits at most, below int()'s own length limit;
    # ASCII blanks only around it (regex \s also matches "\x1f", which int() refuses).
    match = re.fullmatch(r"[ \t\r\n]*(-?[0-9]{1,30})[ \t\r\n]*", value)
    if match is None:
        raise ValueError(
            f"{name}={value!r} is not an integer (expected a whole number in [{low}, {high}])"
        )
    number = int(match[1])
    if not low <= number <= high:
        raise ValueError(
            f"{name}={number} is out of range: expected a whole number in [{low}, {high}]"
        )
    return number


def first_set(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set, else the preferred one (for the error message)."""
    return next((n for n in names if n in env), names[0])


def read_world(
    env: Mapping[str, str], rank: str, size: str, local_rank: str, local_size: str
) -> tuple[int, int, int, int]:
    """Rank, world size, local rank and local world size from the four named variables.

    All four are read (missing or malformed ones reported in this order) before they are checked
    against each other.
    """
    r, w, lr, lw = (read_int(env, n) for n in (rank, size, local_rank, local_size))
    if w < 1:
        raise ValueError(f"{size}={w} must be at least 1")
    if not 0 <= r < w:
        raise ValueError(f"{rank}={r} is out of range for {size}={w}")
    if not 1 <= lw <= w:
        raise ValueError(f"{local_size}={lw} is out of range for {size}={w}")
    if not 0 <= lr < lw:
        raise ValueError(f"{local_rank}={lr} is out of range for {local_size}={lw}")
    return r, w, lr, lw


def block_node_rank(rank: int, world: int, local_rank: int, local_world: int) -> int | None:
    """``rank // local_world`` when this rank fits a block layout (equal nodes, consecutive ranks).

    MPI launchers map ranks to nodes by slot (consecutive) by default, but ``--map-by node`` or a
    rankfile interleave them, and the environment of one rank cannot prove which: a layout that
    contradicts the block formula for this rank gives ``None`` rather than a wrong node index.
    """
    if world % local_world or rank % local_world != local_rank:
        return None
    return rank // local_world
