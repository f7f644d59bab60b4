"""Which launcher started this process: a pure function of an environment mapping.

:func:`detect_environment` reads, never writes, and never loads an MPI runtime, so every launcher
can be tested with a plain dict. The launchers themselves live in
:mod:`distamp.cluster.environments`; :data:`ENVIRONMENTS` is the one place that orders them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments import (
    MPICH,
    MVAPICH,
    LauncherEnvironment,
    OpenMPI,
    RayTrain,
    Single,
    Slurm,
    TorchElastic,
)
from distamp.cluster.environments.base import read_int

__all__ = ["ENVIRONMENTS", "LAUNCHERS", "detect_environment"]

# The one place that orders launchers; the first whose `detect` matches wins.
ENVIRONMENTS: tuple[type[LauncherEnvironment], ...] = (
    # Ray Train first: its workers carry the env:// variables torchrun's detection matches, plus
    # Ray's own (RayTrain.detect declines when a torchrun runs inside a Ray worker).
    RayTrain,
    # torchrun first: it also runs inside SLURM steps and MPI jobs (one agent per node), and then
    # its variables describe the workers it started while the outer launcher's describe the agents.
    TorchElastic,
    # srun next: an srun-launched MPI program (--mpi=pmi2) also carries PMI_* variables, and SLURM
    # knows the main address; Slurm.detect declines inside an mpirun (see its docstring).
    Slurm,
    OpenMPI,
    # MVAPICH before MPICH: its Hydra launcher may set PMI_* too, and the MV2_* names are specific.
    MVAPICH,
    MPICH,
    # Last: it matches every environment.
    Single,
)
LAUNCHERS: tuple[str, ...] = tuple(e.name for e in ENVIRONMENTS)
"""Launcher names :func:`detect_environment` returns and ``DISTAMP_LAUNCHER`` accepts."""


def detect_environment(env: Mapping[str, str] | None = None) -> DistEnv:
    """Describe this process from its launcher's environment variables.

    A pure function of ``env`` (default ``os.environ``): nothing is written and no MPI runtime is
    loaded. ``DISTAMP_LAUNCHER`` forces a launcher; explicit ``MASTER_ADDR``/``MASTER_PORT`` always
    win over the address a launcher implies.

    Raises:
        ValueError: unknown ``DISTAMP_LAUNCHER``, or a launcher variable that is missing, not an
            integer or inconsistent (e.g. rank >= world size); the message names the variable.
    """
    env = os.environ if env is None else env
    forced = env.get("DISTAMP_LAUNCHER", "").strip().lower()
    if forced in ("", "auto"):
        chosen = next(e for e in ENVIRONMENTS if e.detect(env))
    else:
        matches = [e for e in ENVIRONMENTS if e.name == forced]
        if not matches:
            valid = ", ".join((*LAUNCHERS, "auto"))
            raise ValueError(f"DISTAMP_LAUNCHER={env['DISTAMP_LAUNCHER']!r} is not one of {valid}")
        chosen = matches[0]
    found = chosen.read(env)
    address = env.get("MASTER_ADDR", "").strip() or found.main_address
    port = (
        read_int(env, "MASTER_PORT", low=-(2**63), high=2**63)  # range checked below, as a port
        if env.get("MASTER_PORT", "").strip()
        else found.main_port
    )
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (expected 1-65535)")
    return dataclasses.replace(found, main_address=address, main_port=port)
