"""The step's temporaries, carved from flat buffers that every chunk of one step reuses.

A step rebuilds each chunk's fp32 masters, widens its 16-bit gradients (and bf16 moments), and
rounds the results back: a chunk's worth of fp32 temporaries. Allocated tensor by tensor, every
one of them is fresh memory, and on the CPU the first touch of fresh pages (one page fault per
4 KiB) costs about as much as the pass that writes them. :class:`Scratch` hands out views of one
flat buffer per purpose instead, grown to the largest chunk and reused by the next; the step
drops it at its end, so nothing is held between steps (the peak is the one chunk's, as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Scratch"]


class Scratch:
    """Flat fp32 buffers by purpose (``slot``) and device, lent out as contiguous views."""

    def __init__(self) -> None:
        self._flat: dict[tuple[str, torch.device], torch.Tensor] = {}

    def flat(self, slot: str, numel: int, device: torch.device) -> torch.Tensor:
        """A 1-D fp32 view of ``numel`` elements of ``slot``'s buffer on ``device`` (its
        previous contents are garbage); the buffer grows when it is too small."""
        key = (slot, device)
        buf = self._flat.get(key)
        if buf is None or buf.numel() < numel:
            self._flat.pop(key, None)  # freed before the larger one is allocated
            buf = self._flat[key] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel]

    def views(
        self, slot: str, shapes: Sequence[torch.Size], device: torch.device
    ) -> list[torch.Tensor]:
        """One contiguous fp32 view per shape, laid end to end in ``slot``'s buffer."""
        sizes = [s.numel() for s in shapes]
        buf = self.flat(slot, sum(sizes), device)
        return [part.view(shape) for part, shape in zip(buf.split(sizes), shapes, strict=True)]

    def clear(self) -> None:
        """Drop every buffer (the end of a step)."""
        self._flat.clear()
