"""The settings a run was set up with, kept in its folder: ``DIR/settings.json``.

Why a file of its own: the report must never guess a setting from the absence of a number. A
run without a gradient norm in ``metrics.jsonl`` may not clip, or may clip without logging the
norm; only what the run itself recorded at setup tells the two apart. The engine writes the
settings its ranks agreed on at setup (:attr:`distamp.DistAMP.settings`) into its telemetry
folder, and :class:`~distamp.observe.recorder.MetricsRecorder` writes the ones a loop of one's
own passes it; :mod:`distamp.observe.report` reads them back.

Rank 0 writes, once: every rank holds the same settings (the engine compared them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distamp.cluster import is_distributed

__all__ = ["SETTINGS", "read_settings", "write_settings"]

SETTINGS = "settings.json"
"""The file of a run folder that holds its settings (one JSON object)."""


def _plain(value: Any) -> Any:
    """A JSON value for ``value``: numbers, strings, booleans and ``None`` as they are (a
    non-finite float as ``None``: JSON has none), containers element-wise, anything else as its
    text (a mesh's names, a policy's description)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def write_settings(directory: str | Path, settings: Mapping[str, Any]) -> Path | None:
    """Write ``settings`` to ``directory/settings.json`` on rank 0 (replacing an older file: a
    resumed run is set up again). No collective.

    Returns:
        The file written, or ``None`` on the other ranks.
    """
    if is_distributed() and dist.get_rank() != 0:
        return None
    path = Path(directory) / SETTINGS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(dict(settings)), indent=1, sort_keys=True) + "\n")
    return path


def read_settings(directory: str | Path) -> dict[str, Any]:
    """The settings run folder ``directory`` recorded; empty when it recorded none (or the file
    is unreadable: a report is drawn from what there is)."""
    path = Path(directory) / SETTINGS
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
