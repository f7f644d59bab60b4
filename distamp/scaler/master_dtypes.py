"""Refusing 16-bit parameters that an optimizer would step without a master.

A parameter the optimizer steps is the master copy of a weight. Stored in fp16 or bf16, every
update smaller than half a 16-bit step of the weight is lost, and an fp16 gradient is divided
by the loss scale in fp16. Nothing in the forward or backward says so: the run goes on, a
little worse every step. Such parameters are seldom meant; most often they were cast after
setup: a framework's in-place ``model.to(torch.float16)`` before generating (TRL's
continuous-batching rollouts), a user's ``model.half()`` between steps.

torch's scaler catches part of it: its ``unscale_`` refuses fp16 gradients, which non-fused
optimizers go through; a fused optimizer (the Hugging Face Trainer's default AdamW) never calls
it, and bf16 parameters pass both. Here one rule holds for every optimizer a scaler checks
(fused or not, through ``unscale_``, ``step`` and the one-pass clip), before any gradient is
unscaled or any weight written. A 16-bit parameter is refused when

- it was fp32 when its module was registered with the scaler (at setup: the engine and every
  plug-in register the model they prepare): it was cast since, whatever the precision;
- or it is fp16 (its gradient is fp16, which loss scaling cannot unscale exactly);
- or it is bf16 in a registered model while the loss is scaled (fp16 training): the setup checks
  (:func:`~distamp.precision.requirements.check_parameter_dtypes`) refuse that too. bf16
  parameters that were bf16 at setup under bf16 training are a choice some make, and are kept.

The cost is nil on the usual path: autograd gives a dense gradient the dtype of its parameter,
so the (device, dtype) groups the scaler builds anyway say whether a 16-bit parameter can be
there; only a 16-bit gradient group (a real 16-bit parameter, or the 16-bit gradients of fp32
parameters that FSDP1's ``keep_low_precision_grads`` keeps) has its parameters' dtypes read, on
the host, without a device sync.

An optimizer that keeps the masters itself (distamp's
:class:`~distamp.optim.master.MasterWeightOptimizer`) says so with the class attribute named by
:data:`KEEPS_MASTERS` set to ``True``; its 16-bit parameters are stepped as designed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["KEEPS_MASTERS", "LOW_DTYPES", "MasterRule", "keeps_masters"]

LOW_DTYPES = frozenset({torch.float16, torch.bfloat16})
"""The parameter dtypes that need a master kept elsewhere."""

KEEPS_MASTERS = "keeps_16bit_masters"
"""The optimizer attribute that, when ``True``, says the optimizer keeps the exact (or the
chosen compensated) master of each 16-bit parameter it steps."""


def keeps_masters(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps the masters of its 16-bit parameters itself."""
    return getattr(optimizer, KEEPS_MASTERS, False) is True


@dataclass
class MasterRule:
    """The rule of the module doc for one scaler.

    Args:
        names: parameter names by ``id`` (the registered modules'; shared, not copied).
        registered: each registered parameter's dtype at registration, by ``id`` (shared).
        scaling: the scaler scales the loss (fp16 training; not a check-only scaler).
    """

    names: Mapping[int, str] = field(default_factory=dict)
    registered: Mapping[int, torch.dtype] = field(default_factory=dict)
    scaling: bool = True

    def refused(self, param: torch.Tensor) -> bool:
        """Whether ``param`` must not be stepped without a master (see module doc)."""
        dtype = param.dtype
        if dtype not in LOW_DTYPES:
            return False
        was = self.registered.get(id(param))
        if was is not None and was not in LOW_DTYPES:
            return True  # cast since setup
        # bf16 under loss scaling: refused for a registered model (setup refuses it too); a
        # parameter no model registered steps as under torch's scaler, which allows it
        return dtype == torch.float16 or (self.scaling and was is not None)

    def check(
        self, params: Sequence[torch.Tensor], owner: str, every: Sequence[torch.Tensor]
    ) -> None:
        """Raise when any of ``params`` is refused.

        Args:
            params: the parameters of one gradient group (one device and dtype), or all of an
                optimizer's.
            owner: the optimizer's class name, for the message.
            every: all the optimizer's parameters in order: an unnamed parameter is shown by
                its position there.

        Raises:
            ValueError: names the refused parameters (three, then a count) and the fix.
        """
        low = [p for p in params if self.refused(p)]
        if not low:
            return
        shown = [f"{self._name(p, every)} ({_short(p)})" for p in low[:3]]
        more = f" and {len(low) - 3} more" if len(low) > 3 else ""
        raise ValueError(
            f"{owner} would step {len(low)} 16-bit parameter(s) with no master: "
            f"{', '.join(shown)}{more}. The parameters an optimizer steps are the weights' "
            "masters: stored in 16 bits, the updates smaller than half a 16-bit step are lost. "
            "Most often they were cast after setup (a framework's in-place "
            "model.to(torch.float16), such as TRL's use_transformers_continuous_batching=True, "
            "or a model.half()). Keep the weights fp32 (autocast casts them per op), or train "
            "16-bit weights with an exact master: DistAMP(weights=distamp.WeightPrecision("
            "'fp16')) (or 'bf16'; DistAMPAccelerator, DistAMPTrainer / with_distamp and the "
            "Lightning plug-ins take weights= too), or distamp.master_weights(model, optimizer) "
            "in a loop of your own (docs/guides/memory.md). Nothing was unscaled or stepped."
        )

    def _name(self, param: torch.Tensor, every: Sequence[torch.Tensor]) -> str:
        name = self.names.get(id(param))
        if name is not None:
            return name
        index = next((i for i, q in enumerate(every) if q is param), -1)
        return f"the optimizer's parameter {index} {tuple(param.shape)}"


def _short(param: torch.Tensor) -> str:
    return "bf16" if param.dtype == torch.bfloat16 else "fp16"
