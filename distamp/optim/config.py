"""What a run keeps of its weights and optimizer state, and in which precision: one checked
setting (:class:`WeightPrecision`) for the engine, the plug-ins and a loop of your own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["MASTERS", "STATES", "WEIGHT_DTYPES", "WeightPrecision", "bytes_per_parameter"]

MasterKind = Literal["exact", "sharded", "stochastic", "kahan"]
MASTERS: tuple[str, ...] = ("exact", "sharded", "stochastic", "kahan")
STATES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class WeightPrecision:
    """16-bit weights and gradients, with a master that keeps every update.

    Mixed precision halves more than activations: the weights and gradients themselves can be
    16-bit, as long as the updates too small for a 16-bit weight are kept somewhere (the
    recipe of Micikevicius et al., 2018). The default keeps them exactly, so a run trains as
    the fp32-master run does, at 14 bytes per parameter with AdamW instead of 16.

    Args:
        dtype: the weights' and gradients' dtype, ``"bf16"`` or ``"fp16"`` (fp16 needs a
            loss-scaling scaler: ``DistAMP(precision="fp16")`` or a ``DistributedGradScaler``).
        master: where the fp32 truth lives.
            ``"exact"`` (default): bf16 weights carry a 16-bit remainder that restores the fp32
            master bit for bit (2 bytes); fp16 weights, not a truncation of fp32, keep a full
            fp32 copy (4 bytes).
            ``"sharded"``: a full fp32 copy and the optimizer states, each rank holding those of
            its share of the parameters (ZeRO-1; ``4 + 12/N`` bytes per parameter with AdamW
            over N ranks); the updated 16-bit weights are gathered after each step. Under
            FSDP2 every master is sharded with its parameters anyway.
            ``"stochastic"``: no master: each update is rounded stochastically to bf16.
            ``"kahan"``: no master: a bf16 compensation buffer carries what the rounding lost.
        states: the optimizer's moment buffers, ``"fp32"`` (default) or ``"bf16"``.
        chunk_elements: parameters are stepped in groups of about this many elements, so that
            the step's fp32 temporaries stay small beside the model.

    Raises:
        ValueError: an unknown value (echoed), or ``"stochastic"``/``"kahan"`` with fp16 (its
            5-bit exponent needs the loss scale's headroom, not lossy updates: use a master).
    """

    dtype: str = "bf16"
    master: MasterKind = "exact"
    states: str = "fp32"
    chunk_elements: int = 1 << 22

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"WeightPrecision(dtype={self.dtype!r}): the weights are 'bf16' or 'fp16'"
            )
        if self.master not in MASTERS:
            raise ValueError(
                f"WeightPrecision(master={self.master!r}): one of {', '.join(map(repr, MASTERS))}"
            )
        if self.states not in STATES:
            raise ValueError(f"WeightPrecision(states={self.states!r}): 'fp32' or 'bf16'")
        if self.torch_dtype == torch.float16 and self.master in ("stochastic", "kahan"):
            raise ValueError(
                f"WeightPrecision('fp16', master={self.master!r}): fp16 weights keep an fp32 "
                "master; use master='exact' or 'sharded' (or dtype='bf16')"
            )
        if isinstance(self.chunk_elements, bool) or not isinstance(self.chunk_elements, int):
            raise TypeError(f"WeightPrecision(chunk_elements={self.chunk_elements!r}): an int")
        if self.chunk_elements < 1:
            raise ValueError(f"WeightPrecision(chunk_elements={self.chunk_elements}): >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return WEIGHT_DTYPES[self.dtype]

    @property
    def state_dtype(self) -> torch.dtype:
        """The optimizer states' dtype."""
        return STATES[self.states]

    @property
    def needs_scaler(self) -> bool:
        """fp16 weights train only under loss scaling."""
        return self.torch_dtype == torch.float16

    def short(self) -> str:
        """A one-line description for logs and the report ("bf16 weights, exact master, fp32
        states")."""
        return f"{self.dtype} weights, {self.master} master, {self.states} states"

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "master": self.master, "states": self.states}


def bytes_per_parameter(
    precision: WeightPrecision | None, *, moments: int = 2, world_size: int = 1
) -> float:
    """The persistent bytes per parameter a mode holds per rank (weight, gradient, master,
    ``moments`` optimizer buffers: 2 for Adam, 1 for SGD with momentum), as designed; the
    benchmarks count the real figure by storage. ``None``: fp32 weights (torch's AMP loop)."""
    if precision is None:
        return 4 + 4 + 4.0 * moments
    weight = grad = 2.0
    state = 4.0 if precision.states == "fp32" else 2.0
    if precision.master == "sharded":
        return weight + grad + (4 + state * moments) / world_size
    master = {"exact": 2.0 if precision.dtype == "bf16" else 4.0, "stochastic": 0.0, "kahan": 2.0}
    return weight + grad + master[precision.master] + state * moments
