"""8-bit gradient communication for DDP that knows the gradients are loss-scaled.

``comm_hook="fp8"`` (and ``"fp8-ef"``, with error feedback) all-reduce each DDP bucket as 8-bit
floats, a quarter of fp32's bytes, without letting the quantisation hide an overflow or
overflow itself:

1. **Scales, agreed before quantising.** Each gradient of the bucket is cut into chunks of
   ``chunk`` elements (per gradient, so that the result does not depend on how DDP orders the
   bucket: it orders its first step's buckets differently from the later ones'); one MAX
   all-reduce agrees on every chunk's largest magnitude (+inf, -inf and NaN all count as
   +inf, so the same vector says whether any rank's raw bucket holds one). Each chunk's scale
   is the power of two that puts ``world * amax`` at or under the format's maximum, so a sum
   of every rank's quantised values cannot overflow and a chunk of small gradients keeps its
   precision (powers of two scale exactly).
2. **Reduce in fp32, send in 8 bits** (the two-phase exchange of ZeRO++'s quantised gradients):
   an all-to-all hands every rank its shard of every rank's quantised bucket; the rank
   dequantises and sums them in fp32, averages, quantises the average with its chunks' scales
   (an average is never above the agreed amax) and all-gathers it. Each rank sends about
   ``2 (w - 1) / w`` bucket-bytes, as a ring all-reduce of fp32 sends ``2 (w - 1) / w`` times
   four: a quarter, plus the scales.
3. **An overflow stays an overflow.** torch's cast to ``float8_e4m3fn`` saturates (inf and 1000
   both become 448), so the agreed amax of step 1 decides: when any rank's bucket holds an
   inf/NaN (an inf in the agreed vector), every rank's reduced bucket is NaN (its shard sum is
   divided by NaN scales: no pass of its own), the scaler sees it on every rank and the step is
   skipped everywhere (the scaler's own flag stays the step's one agreed decision).
4. **Error feedback** (``"fp8-ef"``): each rank keeps what each gradient lost in the first
   quantisation (``x - q / s``, by parameter name) and adds it to the next step's; it is reset
   after a skipped step and multiplied by ``new / old`` when the loss scale changed (it is in
   the scale's units), as :func:`~distamp.parallel.comm_hooks.powersgd_hook` does, and is kept
   in :meth:`Fp8CommState.state_dict`.

The arithmetic (amax, scales, quantising, the shards' sum) is
:mod:`distamp.kernels.fp8_wire`'s: one fused Triton kernel per step on CUDA, eager torch ops on
the CPU, bitwise equal. A bucket is DDP's: ``DistAMP(ddp_kwargs={"bucket_cap_mb": ...})`` sets
its size (fewer, larger buckets: fewer exchanges, each with its fixed host cost).

Under FSDP2 the same exchange replaces the gradient reduce-scatter (:class:`Fp8ReduceScatter`,
through FSDP2's public ``set_custom_reduce_scatter``): scales agreed, then the all-to-all and
the fp32 sum of phase 2, whose result is the rank's shard (no all-gather: FSDP2 keeps
gradients sharded).

Bytes: :attr:`Fp8CommState.sent` counts what this rank sends (payload and scales apart) by the
ring/pairwise algorithms' standard volumes (an all-reduce of ``B`` bytes sends
``2 (w - 1) / w * B``, an all-to-all ``(w - 1) / w * B``, an all-gather of a ``B``-byte part
``(w - 1) * B``), computed from the sizes handed to the collectives: no host sync.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations
# against the real `dist.GradBucket` / `torch.futures.Future[torch.Tensor]` objects.
from typing import Any

import torch
import torch.distributed as dist

from distamp.agreement.scale_reads import current_loss_scale, last_step_skipped
from distamp.agreement.traffic import WireBytes
from distamp.kernels import fp8_wire
from distamp.torch_compat import foreach_copy_

__all__ = [
    "FORMATS",
    "BucketExchange",
    "Fp8CommState",
    "Fp8ReduceScatter",
    "GroupComm",
    "GroupState",
    "fp8_hook",
]

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The 8-bit formats the hook can send (``Fp8CommState(format=...)``)."""

# all_gather_single is the name since torch 2.13 (all_gather_into_tensor, deprecated there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupState:
    """What every counted hook's state holds: the group it averages over and the bytes sent.

    Args:
        process_group: the replicas' group; ``None`` is the default group.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.sent = WireBytes()  # what this rank sent, payload and scales apart

    @property
    def group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("comm hook called without an initialized process group")
        return group


class Fp8CommState(GroupState):
    """State of :func:`fp8_hook`.

    Args:
        scaler: the loss scaler (error feedback reads its scale and skip flag as tensors).
        process_group: the replicas' group; ``None`` is the default group.
        format: ``"e4m3"`` (default: 3 mantissa bits; measured lower error) or ``"e5m2"``.
        chunk: elements per scale (default 256: a 4-byte scale per 256 bytes of payload).
        error_feedback: carry each gradient's quantisation residual to the next step.
        names: ``id(parameter) -> name`` of the model's parameters (the residuals' keys in
            :meth:`state_dict`); :func:`~distamp.parallel.comm_hooks.register_comm_hook`
            passes the DDP module's.
    """

    def __init__(
        self,
        scaler: Any = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        format: str = "e4m3",
        chunk: int = 256,
        error_feedback: bool = False,
        names: dict[int, str] | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"format={format!r}: use one of {sorted(FORMATS)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk={chunk!r} must be a whole number of elements >= 1")
        super().__init__(process_group)
        self.scaler = scaler
        self.dtype = FORMATS[format]
        self.fmax = float(torch.finfo(self.dtype).max)
        self.chunk, self.error_feedback = chunk, bool(error_feedback)
        self.names = dict(names or {})
        self._loose: dict[str, torch.Tensor] = {}  # name -> what it lost (FSDP2, or loaded)
        self._scale_at: dict[str, torch.Tensor] = {}
        # DDP: one flat residual per bucket (in the bucket's chunk layout), so that a step reads
        # and writes it with a few kernels whatever the number of gradients
        self._layouts: dict[tuple[int, ...], _BucketLayout] = {}
        self._flat: dict[tuple[str, ...], tuple[_BucketLayout, torch.Tensor]] = {}
        self._flat_scale_at: dict[tuple[str, ...], torch.Tensor] = {}

    def name_of(self, param: torch.Tensor) -> str:
        """The parameter's name (its ``id`` when the state was given no names)."""
        return self.names.get(id(param), str(id(param)))

    @property
    def residuals(self) -> dict[str, torch.Tensor]:
        """What each parameter (DDP) or module (FSDP2) lost in the last quantisation, by name
        (a snapshot of views: the buckets keep theirs flat)."""
        out = dict(self._loose)
        for layout, err in self._flat.values():
            out.update(layout.split(err))
        return out

    def keep(self, name: str, lost: torch.Tensor) -> None:
        """Keep ``lost`` as ``name``'s residual for the next step (FSDP2's modules)."""
        self._loose[name] = lost

    def layout_of(self, bucket: dist.GradBucket, world: int) -> "_BucketLayout":
        """The bucket's chunk layout, built once per set of parameters and world size."""
        params = bucket.parameters()
        key = (world, *map(id, params))
        layout = self._layouts.get(key)
        if layout is None:
            names = tuple(self.name_of(p) for p in params)
            numels = [g.numel() for g in bucket.gradients()]
            layout = self._layouts[key] = _BucketLayout(names, numels, self.chunk, world)
        return layout

    def bucket_residual(self, layout: "_BucketLayout", like: torch.Tensor) -> torch.Tensor | None:
        """The bucket's residual for this step in its chunk layout (as :meth:`residual`, once
        per bucket). A bucket of new composition (DDP rebuilds its buckets after the first
        step; a resumed run starts from names) or of a new world size (a torchft quorum that
        grew or shrank: other padding) is assembled from the names' residuals once."""
        if not self.error_feedback:
            return None
        key = layout.names
        kept = self._flat.get(key)
        if kept is None or kept[0] is not layout:  # new names, or a new world (torchft)
            self._absorb(set(key))
            err = torch.zeros_like(like)
            for name, part in zip(key, layout.views(err), strict=True):
                repaired = self.residual(name, part)
                assert repaired is not None
                part.copy_(repaired)
                self._loose.pop(name, None)
                self._scale_at.pop(name, None)
            scale = current_loss_scale(self.scaler)
            if scale is not None:
                self._flat_scale_at[key] = scale.detach().clone()
            return err
        return self._repair(kept[1], self._flat_scale_at, key)

    def keep_bucket(self, layout: "_BucketLayout", lost: torch.Tensor) -> None:
        """Keep what the bucket's values lost (its chunk layout) for the next step."""
        self._flat[layout.names] = (layout, lost)

    def _absorb(self, names: set[str]) -> None:
        """Split the flat residuals of buckets that share a parameter with ``names`` back into
        names (a bucket of the old composition is gone)."""
        for key in [k for k in self._flat if names.intersection(k)]:
            layout, err = self._flat.pop(key)
            scale = self._flat_scale_at.pop(key, None)
            for name, part in layout.split(err).items():
                self._loose[name] = part
                if scale is not None:
                    self._scale_at[name] = scale

    def residual(self, index: str, like: torch.Tensor) -> torch.Tensor | None:
        """Parameter ``index``'s residual for this step, repaired on device (no host sync):
        zero after a skipped step or when the shape changed, rescaled by ``new / old`` when
        the loss scale changed."""
        if not self.error_feedback:
            return None
        err = self._loose.get(index)
        if err is None or err.shape != like.shape:
            err = torch.zeros_like(like)
        return self._repair(err.to(like.device), self._scale_at, index)

    def _repair(
        self, err: torch.Tensor, scale_at: dict[Any, torch.Tensor], key: Any
    ) -> torch.Tensor:
        """``err`` for this step, on device: zero after a skipped step, times ``new / old`` when
        the loss scale changed since ``scale_at[key]`` (then updated)."""
        skipped = last_step_skipped(self.scaler, err.device)
        scale = current_loss_scale(self.scaler)
        if scale is not None and key in scale_at:
            err = err * (scale.to(err.device) / scale_at[key].to(err.device))
        if scale is not None:
            scale_at[key] = scale.detach().clone()
        return torch.where(skipped, torch.zeros_like(err), err)

    def state_dict(self) -> dict[str, Any]:
        """The residuals and the scale each was written at (for an exact resume)."""
        scale_at = dict(self._scale_at)
        for key, scale in self._flat_scale_at.items():
            scale_at.update(dict.fromkeys(key, scale))
        return {
            "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
            "scale_at": {k: v.detach().cpu() for k, v in scale_at.items()},
        }

    def check_state_dict(self, state: Any) -> None:
        """Check that ``state`` is a :meth:`state_dict` (``ValueError`` naming the entry);
        changes nothing, so a checkpoint can be refused before any of it is applied."""
        if not isinstance(state, dict) or set(state) != {"residuals", "scale_at"}:
            raise ValueError(f"fp8 comm state: expected residuals and scale_at, got {state!r:.200}")
        for key in ("residuals", "scale_at"):
            if not isinstance(state[key], dict):
                raise ValueError(f"fp8 comm state {key}: a dict, got {state[key]!r:.200}")
            for k, v in state[key].items():
                if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                    raise ValueError(f"fp8 comm state {key}[{k!r}]: a parameter name and a tensor")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self._loose = {k: v.clone() for k, v in state["residuals"].items()}
        self._scale_at = {k: v.clone() for k, v in state["scale_at"].items()}
        self._flat, self._flat_scale_at = {}, {}


class _BucketLayout:
    """Where a DDP bucket's gradients sit once each is padded to whole chunks and the bucket to
    whole shards of chunks (chunks per gradient: the result must not depend on how DDP orders a
    bucket). Its gradients are consecutive views of the bucket's flat buffer, in order."""

    def __init__(self, names: tuple[str, ...], numels: list[int], chunk: int, world: int):
        self.names, self.numels = names, numels
        self.sizes = [-(-max(n, 1) // chunk) * chunk for n in numels]
        self.per_rank = -(-sum(self.sizes) // (world * chunk)) * chunk
        self.total = self.per_rank * world
        self._tail = self.total - sum(self.sizes)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each gradient's part of ``flat`` (a tensor of this layout), in bucket order."""
        parts = flat.split([*self.sizes, self._tail])
        return [p[:n] for p, n in zip(parts, self.numels, strict=False)]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.views(flat), strict=True))


# The numbers (amax, scales, the casts, the sum) are distamp.kernels.fp8_wire's: fused Triton
# kernels on CUDA, eager torch ops elsewhere, bitwise equal.
_chunk_amax = fp8_wire.chunk_amax
_overflows = fp8_wire.overflows


class GroupComm:
    """The exchange's collectives over a ``torch.distributed`` group (DDP's and FSDP2's path).
    Another transport (a torchft Manager's group) provides the same members.

    Attributes:
        world: ranks in the exchange (the sum of ``world`` quantised values must not overflow).
        rank: this rank's index: which shard of every bucket it sums.
        divisor: what the sum is divided by for the average.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = self.divisor = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def all_to_all(self, recv: torch.Tensor, send: torch.Tensor) -> None:
        dist.all_to_all_single(recv, send, group=self.group)

    def all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        _all_gather(out, part, group=self.group)


def _sum_shards(
    state: Fp8CommState,
    chunks: torch.Tensor,
    amax: torch.Tensor,
    nonfinite: torch.Tensor,
    comm: Any,
    requantise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The exchange both paths share: quantise ``chunks`` (rows of ``chunk`` elements, the
    ranks' shards one after another) with the agreed scales, all-to-all, and sum this rank's
    shard of every rank's in fp32. Returns that sum (``[k, chunk]``; with ``requantise`` the
    average quantised again with the scales of the format's maximum, as bytes to all-gather)
    and, with error feedback, what this rank's values lost (flat, zero when a bucket was
    non-finite)."""
    world, rank = comm.world, comm.rank
    target = state.fmax / world  # the sum of w values stays in range
    q, lost = fp8_wire.quantise(
        chunks, amax, target, state.dtype, nonfinite, residual=state.error_feedback
    )
    send = q.reshape(-1)
    recv = torch.empty_like(send)
    state.sent.add("all_to_all", send.numel(), world)
    comm.all_to_all(recv, send)
    k = chunks.shape[0] // world  # chunks per shard
    # one scale per chunk for every rank: sum, then divide (by a power of two: exact); NaN
    # when any rank's bucket was non-finite, so that the result says so everywhere
    again = (state.fmax, comm.divisor) if requantise else None
    mine, dtype = amax[rank * k : (rank + 1) * k], state.dtype
    return fp8_wire.sum_shards(recv, mine, target, dtype, nonfinite, world, requantise=again), lost


class BucketExchange:
    """One DDP bucket's exchange, in the two halves the transports share: :attr:`agreed` (the
    vector to MAX-reduce: every chunk's amax, inf where the raw bucket holds an inf/NaN) and
    :meth:`finish` (the shards' sum, the average all-gathered, written into the bucket).

    Args:
        state: the hook's state (format, chunk, residuals, bytes).
        bucket: DDP's bucket.
        world: ranks in the exchange.
        contributes: ``False`` for a rank whose values must count as zeros (a torchft replica
            healing this step: it takes part in the collectives with nothing to add).
    """

    def __init__(
        self, state: Fp8CommState, bucket: dist.GradBucket, world: int, contributes: bool = True
    ) -> None:
        self.state, self.buffer = state, bucket.buffer()
        self.layout = layout = state.layout_of(bucket, world)
        x = torch.zeros(layout.total, dtype=torch.float32, device=self.buffer.device)
        self.grads = list(self.buffer.split(layout.numels))  # consecutive, in bucket order
        if contributes:
            foreach_copy_(layout.views(x), self.grads)
            residual = state.bucket_residual(layout, x)
            if residual is not None:
                x += residual
        self.chunks = x.view(-1, state.chunk)
        self.agreed = _chunk_amax(self.chunks)  # an inf/NaN anywhere in the bucket: an inf
        self.contributes = contributes
        state.sent.add("all_reduce", self.agreed.numel() * 4, world, scales=True)
        state.sent.steps += int(bucket.is_last())

    def finish(self, reduced: torch.Tensor, comm: Any) -> torch.Tensor:
        """Given the MAX-reduced :attr:`agreed`: sum this rank's shard of every rank's
        quantised bucket, all-gather the quantised average, write it into the bucket."""
        state, layout, amax_all = self.state, self.layout, reduced
        nonfinite = _overflows(reduced, state.fmax / comm.world)
        q2, lost = _sum_shards(state, self.chunks, amax_all, nonfinite, comm, requantise=True)
        if lost is not None and self.contributes:  # what this rank's values lost
            state.keep_bucket(layout, lost)
        gathered = torch.empty(layout.total, dtype=torch.uint8, device=self.buffer.device)
        state.sent.add("all_gather", q2.numel(), comm.world)
        comm.all_gather(gathered, q2.reshape(-1))
        out = fp8_wire.dequantise(gathered, amax_all, state.fmax, state.dtype)
        foreach_copy_(self.grads, layout.views(out))
        return self.buffer


def fp8_hook(state: Fp8CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce (average) the bucket as 8-bit floats (see the module doc). Three collectives:
    the chunks' amax, non-finite ones included (MAX), the quantised shards (all-to-all), the
    quantised averages (all-gather). No host sync."""
    comm = GroupComm(state.group)
    exchange = BucketExchange(state, bucket, comm.world)
    # all three collectives from this call, in DDP's bucket order (see comm_hooks' module doc):
    # never from a future's callback, whose timing differs between ranks
    dist.all_reduce(exchange.agreed, op=dist.ReduceOp.MAX, group=comm.group)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[exchange.buffer.device] if exchange.buffer.is_cuda else None
    )
    done.set_result(exchange.finish(exchange.agreed, comm))
    return done


class Fp8ReduceScatter:
    """FSDP2's gradient reduce-scatter in 8-bit floats: pass it to ``set_custom_reduce_scatter``
    of each ``fully_shard`` module (:func:`~distamp.parallel.comm_hooks.register_comm_hook`
    does). It keeps FSDP2's interface (``allocate`` and the call) without subclassing FSDP2's
    private base class.

    Args:
        state: the shared :class:`Fp8CommState` (format, chunk, error feedback, bytes).
        name: the module's name: its residual's key in the state.
    """

    def __init__(self, state: Fp8CommState, name: str) -> None:
        self.state, self.name = state, name

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"fp8 reduce-scatter: FSDP2 asked for {op!r}; it sums or averages (set no "
                "gradient divide factor of your own with comm_hook='fp8')"
            )
        state, c = self.state, self.state.chunk
        world = dist.get_world_size(group)
        shard = output_tensor.numel()
        per_rank = -(-max(shard, 1) // c) * c
        x = torch.zeros(world, per_rank, dtype=torch.float32, device=input_tensor.device)
        x[:, :shard] = input_tensor.detach().float().view(world, shard)
        residual = state.residual(self.name, x.reshape(-1))
        if residual is not None:
            x += residual.view(world, per_rank)
        chunks = x.view(-1, c)
        amax = _chunk_amax(chunks)
        state.sent.add("all_reduce", amax.numel() * 4, world, scales=True)
        state.sent.steps += int(self.name == "<root>")  # the root module reduces last
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        nonfinite = _overflows(amax, state.fmax / world)  # any rank's inf/NaN arrives as inf
        summed, lost = _sum_shards(state, chunks, amax, nonfinite, GroupComm(group))
        if lost is not None:
            state.keep(self.name, lost.clone())
        total = summed.reshape(-1)[:shard]
        if op == dist.ReduceOp.AVG:
            total = total / world
        output_tensor.copy_(total.view_as(output_tensor).to(output_tensor.dtype))
