"""Train with the Hugging Face ``Trainer`` (and its subclasses) through distamp.

``DistAMPTrainer`` is a ``transformers.Trainer``; :func:`with_distamp` makes the same change to
any ``Trainer`` subclass (TRL's ``GRPOTrainer``, ``DPOTrainer``, ``SFTTrainer``, a trainer of your
own; RL post-training in fp16: docs/guides/rl.md)::

    from distamp.integrations.transformers import DistAMPTrainer, with_distamp

    trainer = DistAMPTrainer(model=model, args=TrainingArguments(..., fp16=True), ...)
    SFTTrainer = with_distamp(trl.SFTTrainer)   # same arguments as the class it wraps

Why: the stock ``Trainer`` builds a plain ``accelerate.Accelerator`` inside
``create_accelerator_and_postprocess``. With ``fp16=True`` on CPU that trains in fp32 without a
word (Accelerate enables fp16 only off the CPU); elsewhere it uses torch's ``GradScaler``, whose
skip decision is local to each rank (and which a fused optimizer's skip hides from the Trainer,
so the scheduler steps anyway). The only change made here is that the Trainer's accelerator is a
:class:`~distamp.integrations.accelerate.DistAMPAccelerator`, built from exactly the arguments the
Trainer computed. Everything else follows from the Trainer's own code paths:

- ``fp16=True``: fp16 autocast and a :class:`~distamp.DistributedGradScaler`, on CPU and CUDA;
  ``bf16=True``: a check-only scaler (nothing scaled, a NaN step skipped on every rank);
- ``max_grad_norm`` goes through the scaler's one-pass ``clip_grad_norm_`` (unscale, overflow
  check, norm and clip, one collective), and fused optimizers (the Trainer's default AdamW) work;
- the Trainer's ``optimizer_step_was_skipped`` is the rank-agreed flag, so the scheduler does not
  step on a skipped step; training logs gain ``loss_scale`` and ``skipped_steps``, and
  :meth:`overflow_report` says where the last overflow was;
- the scaler is the accelerator's ``scaler``, which the Trainer saves in each checkpoint
  (``scaler.pt``) and restores on resume;
- a policy's adaptive rules and backward scales run as in :class:`~distamp.DistAMP` (the
  accelerator's :class:`~distamp.precision.adaptive_run.AdaptiveRun`): each change appears in
  the training logs (``distamp/precision_bits/<module>``, ``distamp/grad_exponent/<block>``),
  is saved in each checkpoint folder (``distamp_adaptive.pt``) and replayed on resume;
- ``weights=`` (a :class:`~distamp.WeightPrecision`): 16-bit parameters and gradients, their
  exact masters in the optimizer the Trainer builds and in each checkpoint's optimizer state
  (see :mod:`~distamp.integrations.accelerate_weights`).

What cannot be caught: gradients edited in a callback's ``on_pre_optimizer_step``. The Trainer
calls it after clipping (or after computing the norm, which it does even without clipping), and
that pass is where the ranks agree on the skip; a later edit on one rank is not seen by the
others. Edit gradients in ``training_step`` (after ``super().training_step``) instead.

Seams used, checked on the releases in :data:`SUPPORTED` (older ones are refused at import,
newer ones warn):
``Trainer._build_accelerator_args`` (the accelerator's arguments), the ``accelerator`` and
``gather_function`` attributes set by ``create_accelerator_and_postprocess``, ``log``, ``train``
and the callbacks' ``on_save`` / ``on_train_begin``.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, TypeVar

from typing_extensions import override

from distamp.versions import WINDOWS, check_version

SUPPORTED = WINDOWS["transformers"]
"""The transformers releases this adapter was verified with (see :mod:`distamp.versions`)."""

TRANSFORMERS_VERSION = check_version("transformers")

from transformers import Trainer, TrainerCallback  # noqa: E402  (only after the version check)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint  # noqa: E402

from distamp.engine.guards import SpikeGuard  # noqa: E402
from distamp.integrations.accelerate import DistAMPAccelerator  # noqa: E402
from distamp.integrations.accelerate_weights import check_weight_precision  # noqa: E402
from distamp.observe.diagnostics import OverflowReport  # noqa: E402
from distamp.optim import WeightPrecision  # noqa: E402
from distamp.precision.adaptive_run import change_metrics  # noqa: E402
from distamp.precision.policy import parse_precision  # noqa: E402
from distamp.precision.requirements import check_policy_precision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = ["SUPPORTED", "TRANSFORMERS_VERSION", "DistAMPTrainer", "with_distamp"]

T = TypeVar("T", bound=type)


class DistAMPTrainerMixin:
    """What :func:`with_distamp` puts in front of a ``Trainer`` class (see the module doc).

    Adds six keyword arguments to the Trainer's own, with the meaning they have in
    :class:`~distamp.integrations.accelerate.DistAMPAccelerator`:

    Args:
        scaler: the :class:`~distamp.DistributedGradScaler` to use; ``None``: one for fp16, a
            check-only one for bf16.
        policy: an :class:`~distamp.AutocastPolicy` (fp32 modules and ops inside autocast;
            its adaptive rules and backward scales run as in :class:`~distamp.DistAMP`), for
            the precision ``fp16=``/``bf16=`` give (another is refused when the Trainer is built).
        trust_ddp_sync: skip the skip-flag collective when DDP's all-reduce spans the job. Off by
            default: then one small collective a step also covers gradients changed on one rank
            after the all-reduce (in ``training_step``, say).
        spike_guard: a :class:`~distamp.SpikeGuard`: a step whose loss (or, with
            ``max_grad_norm``, gradient norm) spikes is skipped on every rank: the optimizer does
            not step and, as ``optimizer_step_was_skipped`` is then true, neither does the
            Trainer's scheduler. The Trainer still counts the step in ``global_step``, runs its
            callbacks and zeroes the gradients. Training logs gain ``spike_skips``.
        max_consecutive_skips: this many skipped steps in a row (overflow and spike alike)
            raise :class:`~distamp.ConsecutiveSkipsError` out of ``train()`` on every rank;
            ``None``: no limit. Default 100, as in :class:`~distamp.DistAMP`.
        weights: a :class:`~distamp.WeightPrecision` of the dtype ``fp16=``/``bf16=`` give
            (another, or neither, is refused when the Trainer is built): the model's parameters
            and gradients are 16-bit, the optimizer (any AdamW, Adam or SGD the Trainer builds,
            fused included) steps their exact fp32 masters; each checkpoint's ``optimizer.pt``
            holds the masters and ``resume_from_checkpoint`` resumes bit for bit. The model the
            Trainer saves (``model.safetensors``) holds the 16-bit weights. ``None``
            (default): fp32 weights.
    """

    accelerator: DistAMPAccelerator
    gather_function: Any

    def __init__(
        self,
        *args: Any,
        scaler: DistributedGradScaler | None = None,
        policy: Any = None,
        trust_ddp_sync: bool = False,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
        weights: WeightPrecision | None = None,
        **kwargs: Any,
    ) -> None:
        check_weight_precision(weights, None, given="")  # its type, before anything is built
        if scaler is not None and not isinstance(scaler, DistributedGradScaler):
            raise TypeError(
                f"scaler={scaler!r}: pass a distamp.DistributedGradScaler (or None to get one); "
                "another scaler would let ranks disagree on skips"
            )
        if not isinstance(trust_ddp_sync, bool):
            raise ValueError(f"trust_ddp_sync={trust_ddp_sync!r} must be a bool")
        # Set before Trainer.__init__, which builds the accelerator.
        self._distamp_options = dict(
            scaler=scaler,
            policy=policy,
            trust_ddp_sync=trust_ddp_sync,
            spike_guard=spike_guard,
            max_consecutive_skips=max_consecutive_skips,
            weights=weights,
        )
        self._distamp_accelerator_args: dict[str, Any] | None = None
        self._distamp_resume: str | None = None
        super().__init__(*args, **kwargs)
        self.add_callback(_AdaptiveCheckpoints(self))  # type: ignore[attr-defined]

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's accelerator arguments, kept to build distamp's accelerator with."""
        args: dict[str, Any] = super()._build_accelerator_args(**kwargs)  # type: ignore[misc]
        self._distamp_accelerator_args = dict(args)
        return args

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own set-up, then its accelerator rebuilt as a ``DistAMPAccelerator``
        from the same arguments (Accelerate's state is shared, so the Trainer's checks made on
        the first one hold for the second)."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        args = self._distamp_accelerator_args
        if args is None:
            raise AssertionError("Trainer.create_accelerator_and_postprocess built no arguments")
        mode = args.get("mixed_precision") or "no"  # from TrainingArguments' fp16= / bf16=
        given = f"TrainingArguments(...) (mixed_precision={mode!r}: fp16=/bf16=)"
        check_policy_precision(self._distamp_options["policy"], parse_precision(mode), given=given)
        check_weight_precision(self._distamp_options["weights"], mode, given=given)
        self.accelerator = DistAMPAccelerator(**args, **self._distamp_options)
        gather = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(gather).parameters:
            use = self.args.eval_use_gather_object  # type: ignore[attr-defined]
            gather = functools.partial(gather, use_gather_object=use)
        self.gather_function = gather

    # ------------------------------------------------------------------ reporting
    @property
    def resume_checkpoint(self) -> str | None:
        """The checkpoint folder the running ``train()`` resumed from, or ``None``."""
        return self._distamp_resume

    @property
    def scaler(self) -> DistributedGradScaler | None:
        """The accelerator's scaler (``None`` for fp32 or DeepSpeed)."""
        scaler = self.accelerator.scaler
        return scaler if isinstance(scaler, DistributedGradScaler) else None

    def overflow_report(self) -> OverflowReport | None:
        """Where the last skipped step's inf/NaN came from (see the scaler's
        ``overflow_report``); ``None`` when nothing was skipped or without a scaler."""
        scaler = self.scaler
        return None if scaler is None else scaler.overflow_report()

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``; training logs (those with ``loss``) gain ``loss_scale`` and
        ``skipped_steps``, and the adaptive changes made since the previous log. Two host syncs
        per log, none per step."""
        scaler = self.scaler
        if scaler is not None and "loss" in logs:
            logs = {**logs, "loss_scale": scaler.get_scale(), "skipped_steps": scaler.skipped_steps}
        if "loss" in logs and self.accelerator.guards.spike_guard is not None:
            logs = {**logs, "spike_skips": self.accelerator.amp_metrics.spike_skips}
        adaptive = self.accelerator.adaptive
        if adaptive is not None and "loss" in logs:
            logs.update(change_metrics(adaptive.take_changes("trainer")))
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kw: Any) -> Any:
        """The Trainer's ``train``; distamp's files of the checkpoint resumed from are checked
        first, on every rank, before the Trainer loads the model or moves its step (a damaged
        one is refused with nothing changed), and the checkpoint is kept, so that the adaptive
        run's state saved in it is replayed once the model is prepared.

        Raises:
            ValueError: ``scaler.pt`` or ``distamp_adaptive.pt`` of the checkpoint is unreadable
                or refused (names the file; raised on every rank).
        """
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
        self._distamp_resume = path if isinstance(path, str) else None
        if self._distamp_resume is not None:  # before the Trainer loads the model or its step
            self.accelerator.check_checkpoint(self._distamp_resume)
        return super().train(resume_from_checkpoint, *args, **kw)  # type: ignore[misc]


class _AdaptiveCheckpoints(TrainerCallback):  # type: ignore[misc]
    """Saves the adaptive run's state in each checkpoint folder and replays it on resume (the
    Trainer calls ``on_train_begin`` after preparing the model and loading the checkpoint's
    optimizer, scheduler and scaler)."""

    def __init__(self, trainer: DistAMPTrainerMixin) -> None:
        self.trainer = trainer

    @override
    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        folder = self.trainer.resume_checkpoint
        if folder is not None:
            self.trainer.accelerator.load_adaptive(folder)

    @override
    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.trainer.accelerator.save_adaptive(folder)  # on every rank: it ends in a barrier


def with_distamp(trainer_class: T) -> T:
    """A subclass of ``trainer_class`` (a ``transformers.Trainer`` subclass) that trains through
    distamp (see the module doc); everything the class does is kept.

    A TRL trainer (``GRPOTrainer``, ``DPOTrainer``, ``SFTTrainer``, a subclass of one) is
    checked against TRL's window in :mod:`distamp.versions` (see docs/guides/rl.md).

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` subclass.
        ImportError: a TRL trainer from a TRL release older than the window's floor.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(
            f"with_distamp({trainer_class!r}): pass a transformers.Trainer subclass "
            "(the class, not an instance)"
        )
    if issubclass(trainer_class, DistAMPTrainerMixin):
        return trainer_class
    if any(base.__module__.partition(".")[0] == "trl" for base in trainer_class.__mro__):
        check_version("trl")  # TRL's trainers: its window (refused below the floor)
    name = f"DistAMP{trainer_class.__name__}"
    bases = (DistAMPTrainerMixin, trainer_class)
    made = type(name, bases, {"__module__": trainer_class.__module__})
    made.__doc__ = f"{trainer_class.__name__} training through distamp (see with_distamp)."
    return made  # type: ignore[return-value]


class DistAMPTrainer(DistAMPTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains through distamp (see the module doc).

    Same arguments as ``Trainer``, plus ``scaler``, ``policy``, ``trust_ddp_sync``,
    ``spike_guard``, ``max_consecutive_skips`` and ``weights`` (see :class:`DistAMPTrainerMixin`).
    """
