"""Shared fixtures: fail a test that leaks a process group or launcher environment variables."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

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
