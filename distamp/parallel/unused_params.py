"""Parameters DDP would wait for in vain, found at the first synchronising backward.

``DistributedDataParallel`` without ``find_unused_parameters`` (and without ``static_graph``)
expects every parameter that requires a gradient to receive one in each backward that
synchronises. A parameter the forward skips leaves its bucket un-reduced: the optimizer then
steps the other buckets' averaged gradients and that bucket's local ones, so the replicas differ
after the first step, and torch raises only at the next forward ("Expected to have finished
reduction in the prior iteration"). Measured on 2 gloo ranks (torch 2.13, a 3-layer model with
one unused ``nn.Linear``, one bucket): without a comm hook and under every hook of
``COMM_HOOKS`` (fp32, fp16, bf16, fp8, fp8-ef, powersgd) alike, the parameters differed by
1e-2 to 2e-2 between the ranks after step 1 and DDP raised at step 2; with ``static_graph=True``
they stayed identical (DDP finds the unused parameters in its first iteration). The hooks do not
change this: DDP calls a hook only for a bucket that is ready, so the check is DDP's, not one
hook's.

:class:`UnusedParameterCheck` records, during the first synchronising backward only, which
parameters received a gradient, and refuses the run on every rank (one small all-reduce, once)
before any optimizer step, naming the parameters and the fix. It covers a parameter that no
rank uses (the usual case: a layer built and never called), where every rank's DDP leaves the
same bucket pending and the check's all-reduce is the next collective everywhere. A parameter
used on some ranks only is beyond it: those ranks' DDP has already issued the bucket's
collective, which the others' all-reduce then meets (measured: gloo aborts on the size mismatch
without a hook; under the fp8 hook the ranks wait until the group's timeout), as it would meet
the scaler's collective without the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.cluster.agreement import agree_failures

__all__ = ["UnusedParameterCheck"]


class UnusedParameterCheck:
    """Watches one backward of a DDP model for parameters that receive no gradient.

    Build it with :meth:`arm`, which returns ``None`` where DDP copes with unused parameters
    itself; wrap backwards in :meth:`watch`. After the first synchronising backward it has done
    its work and watches nothing more (no per-step cost).
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.names = {
            p: name for name, p in ddp.module.named_parameters() if p.requires_grad
        }  # what DDP reduces: the parameters that require a gradient, each once
        self.done = False

    @classmethod
    def arm(cls, model: nn.Module) -> UnusedParameterCheck | None:
        """A check for ``model`` when it is a DDP module that will not look for unused
        parameters itself (``find_unused_parameters`` and ``static_graph`` both off), else
        ``None``. Reads DDP's own attributes, so a model the user wrapped is judged as built."""
        if not isinstance(model, DistributedDataParallel):
            return None
        if model.find_unused_parameters or getattr(model, "static_graph", False):
            return None
        return cls(model)

    @contextmanager
    def watch(self, syncs: bool) -> Iterator[None]:
        """Around one backward. ``syncs``: whether this backward synchronises gradients (the
        last micro-batch of a cycle); micro-batches under ``no_sync`` are not DDP's concern.

        Collective after the first synchronising backward (every rank must call it there): one
        all-reduce of an int, and a gather of the reasons only when a rank found some.

        Raises:
            ValueError: on every rank, when a parameter on any rank received no gradient,
                naming the rank, the parameters and ``ddp_kwargs={"find_unused_parameters":
                True}``. Raised before the optimizer steps: the replicas are still identical.
        """
        if self.done or not syncs:
            yield
            return
        used: set[torch.nn.Parameter] = set()
        handles = [p.register_post_accumulate_grad_hook(lambda q: used.add(q)) for p in self.names]
        try:
            yield  # the backward; a failing one propagates without the check's collective
        finally:
            for handle in handles:
                handle.remove()
        self.done = True
        missing = [name for p, name in self.names.items() if p not in used]
        error = None
        if missing:
            shown = ", ".join(repr(n) for n in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            error = f"parameter(s) {shown}{more} received no gradient"
        failures, _ = agree_failures(error)
        if failures:
            raise ValueError(
                f"DDP without find_unused_parameters: {'; '.join(failures)} in the first "
                "backward. DDP would leave their gradient bucket un-averaged, the ranks would "
                "step different gradients and their parameters would differ from this step on; "
                "pass DistAMP(..., ddp_kwargs={'find_unused_parameters': True}) for a forward "
                "that skips parameters, or set requires_grad=False on the ones it never uses"
            )
