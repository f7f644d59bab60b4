"""Reference unscale kernels in torch's multi-tensor ops: the CPU path and the fallback."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

__all__ = ["unscale_and_check_"]


def unscale_and_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and raise ``found_inf`` to 1 on a non-finite.

    All tensors live on ``found_inf``'s device. ``write=False`` only checks (one read pass), which
    is what a fused optimizer needs: it unscales inside its own kernel.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.numel():
            by_dtype[g.dtype].append(g)
    one = torch.ones((), dtype=torch.float32, device=found_inf.device)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, found_inf, inv_scale if write else one
        )
