"""The test suite's multi-process harness: :func:`distamp.cluster.spawn.run_ranks` (see there)."""

from __future__ import annotations

from distamp.cluster import free_port
from distamp.cluster.spawn import run_ranks

__all__ = ["free_port", "run_ranks"]  # free_port: re-exported for the tests that import it here
