"""Shared fixtures and settings.

- Fail a test that leaks a process group or launcher environment variables.
- Hypothesis profiles: ``ci`` (the default) is derandomized, so every run of the suite draws the
  same examples and a red CI means a real regression; ``campaign`` draws many thousands of fresh
  examples per property, to be run before a release:
  ``pytest tests -k fuzzed --hypothesis-profile=campaign --hypothesis-show-statistics``
  (or ``DISTAMP_HYPOTHESIS_PROFILE=campaign``). Cases a campaign finds are pinned with
  ``@example`` in the test itself, so that ``ci`` checks them on every run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

_HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", derandomize=True, max_examples=100, database=None, **_HYPOTHESIS)
settings.register_profile("campaign", max_examples=2000, database=None, **_HYPOTHESIS)
settings.load_profile(os.environ.get("DISTAMP_HYPOTHESIS_PROFILE", "ci"))

_WATCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTAMP_LAUNCHER")


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    before = {k: os.environ.get(k) for k in _WATCHED}
    yield
    leaked_pg = dist.is_available() and dist.is_initialized()
    if leaked_pg:
        dist.destroy_process_group()
    after = {k: os.environ.get(k) for k in _WATCHED}
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    assert not leaked_pg, "test left a torch.distributed process group initialized"
    assert before == after, f"test leaked environment variables: {before} -> {after}"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test (restored after): tiny matmuls run faster than when
    contending for a shared machine's cores, and bitwise comparisons see one reduction order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def telemetry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One 2-rank run with telemetry and metrics (tests/telemetry_scenarios.py), trained once
    and read by the telemetry and the run report's tests: ``(run folder, per-rank results)``."""
    import telemetry_scenarios
    from _dist import run_ranks

    out = tmp_path_factory.mktemp("telemetry_run")
    return out, run_ranks(telemetry_scenarios.train, 2, str(out), timeout=240)
