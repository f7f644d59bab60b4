"""Each rank's random streams, saved with a checkpoint so that a resumed run draws what an
uninterrupted one would have drawn (dropout masks, data order)."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture_rng", "check_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's random streams: torch (CPU and every CUDA device), ``random``, numpy.

    numpy's global stream is saved only when numpy is already imported: a process that never
    imported it never drew from it. Its state is stored as tensors and plain values so that the
    file loads with ``weights_only=True``.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss)
    return state


def check_rng(state: Any) -> None:
    """Check that ``state`` has the structure :func:`capture_rng` gives, so that a damaged file
    is refused before a checkpoint is applied rather than half-way through (``ValueError``
    naming the entry)."""
    if not isinstance(state, dict) or not {"torch", "python"} <= set(state):
        raise ValueError(f"expected a dict with 'torch' and 'python' streams, got {state!r:.120}")
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        raise ValueError(f"'torch' must be a uint8 tensor, got {state['torch']!r:.120}")
    if not isinstance(state["python"], tuple) or len(state["python"]) != 3:
        raise ValueError(f"'python' must be random.getstate()'s, got {state['python']!r:.120}")
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) for t in cuda):
        raise ValueError(f"'cuda' must be a list of tensors, got {cuda!r:.120}")
    numpy_state = state.get("numpy", ("", torch.zeros(0), 0, 0, 0.0))
    if not isinstance(numpy_state, tuple) or len(numpy_state) != 5:
        raise ValueError(f"'numpy' must be a 5-tuple, got {numpy_state!r:.120}")


def restore_rng(state: dict[str, Any]) -> None:
    """Put back the streams of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy(), pos, has_gauss, gauss))
