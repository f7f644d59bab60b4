"""8-bit gradients across torchft replica groups: ``DistAMP(ft_manager=..., comm_hook="fp8")``.

Across replica groups is where bandwidth is scarcest (replicas may sit in other clusters or
regions), and torchft's own all-reduce of the gradients runs at full width. With
``comm_hook="fp8"`` (or ``"fp8-ef"``) the engine wraps the model in torchft's DDP with the
exchange of :mod:`distamp.parallel.fp8_comm` in place of torchft's hook; what differs is the
transport and who counts:

- **Agreement through the Manager.** The chunks' amax and the raw bucket's non-finite flag are
  MAX-reduced with ``Manager.allreduce`` (so a failure there is recorded by torchft and the
  step is not committed); the shards then travel over the Manager's process group (the one the
  user built the Manager with): all-to-all, then all-gather, as on a DDP group.
- **Who counts.** The scales are sized for the quorum's whole process group (every member adds
  its values, so ``world * amax`` must fit), the average divides by the participating replicas
  (``Manager.num_participants()``), and a replica healing this step takes part in the
  collectives with zeros, as torchft's own all-reduce makes it do.
- **Failures.** When a replica dies inside the exchange, the error is reported to the Manager
  (``report_error``): this replica's ``should_commit()`` is then false, the scaler's agreed
  flag says skip (:class:`~distamp.agreement.replicas.ManagerGroup`), and the zeroed bucket is
  never applied.
- **Error feedback** stays per replica (each replica's own residuals, rescaled and reset with
  its scaler as on DDP); a replica that restarts starts with none (what heals is the weights,
  the optimizer and the scaler, not another replica's residuals).

torchft has no accessor for the Manager's process group: it is read through
:func:`distamp.torch_compat.torchft_manager_group`.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations
# against the real `dist.GradBucket` / `torch.futures.Future[torch.Tensor]` objects.
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from distamp.model_names import model_name
from distamp.parallel.fp8_comm import BucketExchange, Fp8CommState
from distamp.torch_compat import torchft_manager_group

__all__ = ["ManagerComm", "ReplicaFp8", "fp8_replica_hook", "replica_fp8_ddp"]


class ManagerComm:
    """The exchange's collectives over a torchft Manager's process group (the transport
    :class:`~distamp.parallel.fp8_comm.BucketExchange` takes), for the current quorum."""

    def __init__(self, manager: Any) -> None:
        pg = torchft_manager_group(manager)
        if pg is None:
            raise RuntimeError(
                "comm_hook='fp8' with ft_manager: this torchft Manager keeps no process group "
                "where torchft 0.2 does (Manager._pg); use comm_hook=None with this torchft"
            )
        self.pg = pg
        self.world = pg.size()
        self.rank = getattr(pg, "parent", pg).rank()  # torchft's wrapper: the configured group
        self.divisor = max(manager.num_participants(), 1)

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        self.pg.alltoall_base(recv, send, [], [], AllToAllOptions()).wait()

    def all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        self.pg.allgather_into_tensor_coalesced([out], [part], AllgatherOptions()).wait()


class ReplicaFp8:
    """State of :func:`fp8_replica_hook`: the Manager and the shared fp8 state."""

    def __init__(self, manager: Any, fp8: Fp8CommState) -> None:
        self.manager, self.fp8 = manager, fp8


def fp8_replica_hook(
    state: ReplicaFp8, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across the quorum's replicas as 8-bit floats (see the module doc).
    Synchronous, as torchft's own hook is: the future returned is already complete."""
    manager = state.manager
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    buffer = bucket.buffer()
    try:
        manager.wait_quorum()
        comm = ManagerComm(manager)
        exchange = BucketExchange(
            state.fp8, bucket, comm.world, contributes=manager.is_participating()
        )
        agreed = exchange.agreed
        manager.allreduce(agreed, reduce_op=dist.ReduceOp.MAX).wait()
        if manager.errored() is None:
            done.set_result(exchange.finish(agreed, comm))
            return done
    except Exception as e:  # a replica died in the exchange: torchft skips the step
        manager.report_error(e)
    buffer.zero_()
    done.set_result(buffer)
    return done


@functools.cache
def _replica_class() -> type:
    """torchft's DDP with this module's hook in place of torchft's (its ``__init__`` registers
    the hook; DDP takes one per module)."""
    from torchft import DistributedDataParallel

    class Fp8ReplicaDDP(DistributedDataParallel):  # type: ignore[misc]
        fp8_state: ReplicaFp8

        def __init__(self, manager: Any, module: torch.nn.Module, fp8: ReplicaFp8) -> None:
            object.__setattr__(self, "fp8_state", fp8)  # read by torchft's __init__, below
            super().__init__(manager, module)

        def register_comm_hook(self, state: Any, hook: Any) -> None:
            super().register_comm_hook(self.fp8_state, fp8_replica_hook)

    return Fp8ReplicaDDP


def replica_fp8_ddp(manager: Any, model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` in torchft's DDP across ``manager``'s replicas, its gradients exchanged by
    :func:`fp8_replica_hook` (``kind``: ``"fp8"``, or ``"fp8-ef"`` with error feedback). The
    state is the module's ``fp8_state`` (the engine hands its ``fp8`` part the scaler)."""
    names = {id(p): model_name(n, model) for n, p in model.named_parameters()}
    fp8 = Fp8CommState(error_feedback=kind == "fp8-ef", names=names)
    ddp: torch.nn.Module = _replica_class()(manager, model, ReplicaFp8(manager, fp8))
    return ddp
