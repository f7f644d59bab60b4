"""SLURM: the tasks of an ``srun`` step, and SLURM's host-list and tasks-per-node formats.

The parsing is pure Python, so no ``scontrol`` is needed on the node.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import NoReturn

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.base import (
    LauncherEnvironment,
    first_set,
    read_int,
    read_world,
)

__all__ = ["Slurm", "expand_nodelist"]


class Slurm(LauncherEnvironment):
    """A task of an ``srun`` step; not a bare ``salloc``/``sbatch`` shell (no SLURM_STEP_ID there).

    ``mpirun`` inside an allocation starts its daemons with ``srun``, so its ranks inherit step
    variables that count daemons (one per node), not ranks. When an MPI launcher's world size is
    present and disagrees with SLURM's, SLURM declines and the MPI environment describes the rank.
    """

    name = "slurm"
    _MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        in_step = ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env
        ntasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
        if not in_step or ntasks is None:
            return False
        return all(env[v].strip() == ntasks.strip() for v in cls._MPI_SIZES if v in env)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        size_var = first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        node = read_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        tasks_var = first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if tasks_var in env:
            per_node = _tasks_per_node(env[tasks_var], tasks_var)
            if node >= len(per_node):
                raise ValueError(
                    f"SLURM_NODEID={node} is out of range for {tasks_var}={env[tasks_var]!r}"
                )
            env = {**env, tasks_var: str(per_node[node])}
        elif "SLURM_NTASKS_PER_NODE" in env:  # srun sets it only with --ntasks-per-node
            tasks_var = "SLURM_NTASKS_PER_NODE"
        else:
            _no_tasks_per_node(env, size_var)
        r, w, lr, lw = read_world(env, "SLURM_PROCID", size_var, "SLURM_LOCALID", tasks_var)
        # The step's node list first: a step may run on a subset of the job's nodes, and rank 0 runs
        # on the first node of its step.
        list_var = first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        hosts = expand_nodelist(env[list_var]) if list_var in env else []
        address = hosts[0] if hosts else None
        # Every task derives the same port from the job id, so no communication is needed; two
        # steps of one job sharing a node at the same time must set MASTER_PORT.
        port = (
            10000 + read_int(env, "SLURM_JOB_ID", high=2**32 - 1) % 20000
            if "SLURM_JOB_ID" in env
            else None
        )
        return DistEnv(cls.name, r, w, lr, lw, node, address, port)


def _no_tasks_per_node(env: Mapping[str, str], size_var: str) -> NoReturn:
    """Raise for a step that says nothing about its tasks per node, naming what is read.

    A missing or malformed rank variable is reported first, as :func:`read_world` would.
    """
    for name in ("SLURM_PROCID", size_var, "SLURM_LOCALID"):
        read_int(env, name)
    raise ValueError(
        "none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE is set "
        "(read in that order; srun sets the first two in every step, the third only with "
        "--ntasks-per-node): start the tasks with srun, set SLURM_TASKS_PER_NODE to the tasks of "
        "each node (e.g. '4(x2)'), or name another launcher with DISTAMP_LAUNCHER"
    )


_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5.

    Zero padding follows the lower bound (``[08-10]`` -> 08 09 10); several bracket groups in one
    name give their cartesian product (``"a-[1-2]-b[3,4]"`` -> a-1-b3 a-1-b4 a-2-b3 a-2-b4). Pure
    Python, so no ``scontrol`` is needed on the node.
    """
    hosts: list[str] = []
    # Split on the commas outside brackets: re.split can't tell, so scan the depth.
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            start = i + 1
            if item:
                hosts.extend(_expand_host(item, nodelist))
    if depth:
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
    return hosts


def _expand_host(item: str, nodelist: str) -> list[str]:
    literals = _BRACKETS.split(item)[::2]  # text between the groups, then the groups themselves
    groups = [_expand_range(g, nodelist) for g in _BRACKETS.findall(item)]
    if any("[" in s or "]" in s for s in literals):
        raise ValueError(f"SLURM node list {nodelist!r}: malformed bracket in {item!r}")
    tails = literals[1:]
    return [
        literals[0] + "".join(n + t for n, t in zip(combo, tails, strict=True))
        for combo in itertools.product(*groups)
    ]


def _expand_range(group: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, _, hi = part.strip().partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"SLURM node list {nodelist!r}: bad range {part!r} in [{group}]")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_per_node(value: str, name: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` form: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"{name}={value!r} is not of the form '2(x3),1'")
        out += [int(m[1])] * int(m[2] or 1)
    return out
