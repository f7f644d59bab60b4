"""Per-gradient overflow flags of the current iteration, and those of the last skipped step.

The unscale pass looks at every gradient, so it can as well raise one flag per gradient tensor
(the kernels' ``per_tensor_flags``). :class:`OverflowRecorder` keeps such flags on the device: at
every ``update()`` the flags of a skipped step replace the kept ones (a ``torch.where`` on the
agreed found_inf, no host sync), so after any number of good steps the last skipped step's flags
are still there for :func:`distamp.observe.diagnostics.build_report`.

Where the step's decision reaches the host anyway (every scaler but a sync-free one) the flags are
not raised at every step at all: they are computed at ``update()`` of a skipped step only, from the
gradients, which still hold their inf/NaN then. The unscale pass then needs no per-gradient output
and, on CUDA, runs as torch's own fused op (:func:`distamp.kernels.dispatch.auto_backend`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distamp.agreement.topology import local_grad

__all__ = ["OverflowRecorder"]


class OverflowRecorder:
    """Per-gradient non-finite flags of the current iteration, and those of the last skip.

    Keys are the ordered parameter lists the scaler passes to the unscale kernels (one list per
    optimizer and device), so the kept flags line up with parameters across iterations.

    Args:
        lazy: compute the flags at ``commit`` for a skipped step only (see :meth:`new_flags`);
            ``False`` for sync-free scalers, which never read the decision on the host.
    """

    def __init__(self, lazy: bool = True) -> None:
        self.lazy = lazy
        self._current: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
        self._kept: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._iteration: torch.Tensor | None = None
        self._last_skip: torch.Tensor | None = None
        self._lazy: list[tuple[tuple[torch.Tensor, ...], torch.device]] = []
        self._host_iteration: int | None = None  # on the host: the two counters as ints
        self._last_skip_host = -1

    def new_flags(
        self, params: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor | None:
        """A zeroed float32 flag per parameter, filled by the unscale pass (no host sync).

        ``None`` when ``lazy``: the flags are then computed at ``commit`` only for a skipped
        step, from the gradients themselves (they still hold their inf/NaN: unscaling keeps
        them, and a skipped step does not touch them). Filling them at every step would cost the
        torch reference one op per gradient, and on CUDA it would keep the unscale off torch's
        fused op (about 50 us of host time for 500 gradients) and on the Triton kernel (0.4 to
        0.9 ms). Not lazy for sync-free scalers: no host read at all, e.g. under
        ``torch.compile``.
        """
        if self.lazy:
            self._lazy.append((tuple(params), device))
            return None
        flags = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._current.append((tuple(params), flags))
        return flags

    def _materialise_lazy(self, skipped: bool) -> None:
        lazy, self._lazy = self._lazy, []
        if not lazy or not skipped:
            return
        for params, device in lazy:
            self._current.append((params, _nonfinite(params, device)))

    def discard(self) -> None:
        """Forget the current iteration's flags (``update(new_scale)`` and the like)."""
        self._current = []
        self._lazy = []

    def commit(self, found: torch.Tensor, found_on_host: bool | None = None) -> None:
        """At ``update()``: keep this iteration's flags where the agreed ``found`` is set.

        ``found_on_host``: the same decision, already read on the host (every scaler but a
        sync-free one, which keeps no lazy flags): the iteration counters are then plain ints
        and a clean step costs no op at all.
        """
        if found_on_host is not None:
            self._commit_on_host(found_on_host)
            return
        if self._iteration is None:
            self._iteration = torch.zeros((), dtype=torch.int64, device=found.device)
            self._last_skip = torch.full((), -1, dtype=torch.int64, device=found.device)
        assert self._last_skip is not None
        if self._lazy:  # lazy flags come with a host decision (above): this read is a fallback
            self._materialise_lazy(bool(found.item()))
        torch.where(found, self._iteration, self._last_skip, out=self._last_skip)
        fresh = set()
        for params, flags in self._current:
            key = tuple(map(id, params))
            fresh.add(key)
            old = self._kept.get(key)
            base = old[1] if old is not None else torch.zeros_like(flags)
            self._kept[key] = (params, torch.where(found.to(flags.device), flags, base))
        for key, (_, flags) in self._kept.items():  # a skip without them: clear theirs
            if key not in fresh:
                flags.masked_fill_(found.to(flags.device), 0.0)
        self._iteration += 1
        self._current = []

    def _commit_on_host(self, skipped: bool) -> None:
        if self._host_iteration is None:
            self._host_iteration, self._last_skip_host = 0, -1
        self._materialise_lazy(skipped)
        if skipped:
            self._last_skip_host = self._host_iteration
            fresh = set()
            for params, flags in self._current:
                key = tuple(map(id, params))
                fresh.add(key)
                self._kept[key] = (params, flags)
            for key, (_, flags) in self._kept.items():  # a skip without them: clear theirs
                if key not in fresh:
                    flags.zero_()
        self._host_iteration += 1
        self._current = []

    @property
    def iterations(self) -> int:
        """How many ``update()`` calls were committed (host sync on a device)."""
        if self._host_iteration is not None:
            return self._host_iteration
        return 0 if self._iteration is None else int(self._iteration.item())

    def params(self) -> list[torch.Tensor]:
        """Every parameter the kept flags cover, in order, without repeats."""
        seen: dict[int, torch.Tensor] = {}
        for params, _ in self._kept.values():
            for p in params:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def flagged(self) -> tuple[int, list[torch.Tensor]]:
        """Host side (syncs): the iteration of the last skip (-1: none) and its flagged params."""
        if self._host_iteration is not None:
            step = self._last_skip_host
        elif self._last_skip is None:
            return -1, []
        else:
            step = int(self._last_skip.item())
        out: list[torch.Tensor] = []
        for params, flags in self._kept.values():
            hits = flags.cpu().tolist()
            out.extend(p for p, hit in zip(params, hits, strict=True) if hit)
        return step, out


def _nonfinite(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One float32 flag per parameter on ``device``: whether its gradient holds an inf or NaN.
    No host read (called for a skipped step only)."""
    flags = []
    for p in params:
        if p.grad is None:
            flags.append(torch.zeros((), dtype=torch.bool, device=device))
            continue
        local = local_grad(p.grad)
        if local.is_sparse:
            local = local.coalesce().values()
        flags.append(~torch.isfinite(local).all().to(device))
    return torch.stack(flags).to(torch.float32)
