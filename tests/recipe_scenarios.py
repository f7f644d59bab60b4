"""The large-model recipe, as the recipe tier trains it: a precision policy together with
activation checkpointing (AC), activation offloading and ``torch.compile`` per block, alone and
under DDP and FSDP2.

The model is the main job's GPT (``launch/model.py``) with the attention written out as most
model zoos' "eager" attention is (``softmax(q @ k^T) @ v``): a softmax is one of the policy's fp32
ops, so a recomputed forward that missed the policy would compute it in the low dtype. Each run
returns everything a bitwise comparison needs: the parameters' digest, the per-step skips and
loss scales, the adaptive decisions and the backward-scale changes, with the module names as the
user wrote the model (a checkpoint wrapper's and compile's prefixes taken out).

AC modes (what torchtitan, Megatron, the HF Trainer and Lightning run):

- ``full``: every block in torch's ``checkpoint_wrapper``, non-reentrant;
- ``reentrant``: the same, reentrant;
- ``selective``: every block checkpointed with ``create_selective_checkpoint_contexts`` and a
  policy function that saves every other matmul (torchtitan's "selective op" mode);
- ``sequential``: ``checkpoint_sequential`` over the blocks in two segments;
- ``offload``: no recomputation, the saved activations offloaded (``save_on_cpu``).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from medium_scenarios import make_spiky
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from launch.model import GPT, SIZES, Block, GPTConfig, ShardedText, lm_loss, load_text

AC_MODES = ("none", "full", "reentrant", "selective", "sequential", "offload")
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


class EagerAttentionBlock(Block):
    """The main job's block with the attention written out: a softmax the policy keeps fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = F.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SequentialGPT(GPT):
    """The GPT whose blocks run through ``checkpoint_sequential`` (two segments)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        x = checkpoint_sequential(list(self.blocks), 2, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def gpt(size: str = "small", *, sequential: bool = False) -> GPT:
    """The main job's GPT of ``size`` with eager attention (same seed on every rank)."""
    cfg: GPTConfig = SIZES[size]
    torch.manual_seed(0)
    model = SequentialGPT(cfg) if sequential else GPT(cfg)
    for block in model.blocks:
        block.__class__ = EagerAttentionBlock
    return model


_SAVED_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _save_every_other_matmul() -> Callable[..., Any]:
    """torchtitan's selective-op policy: save every other matmul's output, recompute the rest."""
    seen = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _SAVED_MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            seen[key] += 1
            if seen[key] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: GPT, mode: str) -> None:
    """Wrap ``model``'s blocks for AC ``mode`` (``none``, ``offload`` and ``sequential``
    change nothing here: see :func:`forward_context` and :func:`gpt`)."""
    if mode in ("full", "reentrant"):
        impl = CheckpointImpl.REENTRANT if mode == "reentrant" else CheckpointImpl.NO_REENTRANT
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    elif mode == "selective":
        for i, block in enumerate(model.blocks):
            context = functools.partial(
                create_selective_checkpoint_contexts, _save_every_other_matmul()
            )
            model.blocks[i] = checkpoint_wrapper(block, context_fn=context)


def forward_context(mode: str) -> AbstractContextManager[Any]:
    """Around forward and backward: activation offloading for ``offload``, else nothing."""
    return torch.autograd.graph.save_on_cpu() if mode == "offload" else nullcontext()


def compile_blocks(model: GPT, backend: Any = "aot_eager") -> None:
    """torchtitan's per-block compile: each block (AC-wrapped or not) compiled on its own, in
    place (``Module.compile``: no wrapper module, so FSDP2 shards the block itself)."""
    for block in model.blocks:
        block.compile(backend=backend)


def user_name(name: str) -> str:
    """A module or parameter name as the user wrote the model (wrappers' prefixes out)."""
    name = name.removeprefix("module.")  # DDP's
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def digest(model: nn.Module) -> str:
    """SHA-256 of every parameter (user names, sorted; an FSDP2 shard is gathered)."""
    h = hashlib.sha256()
    params = sorted((user_name(n), p) for n, p in model.named_parameters())
    for name, p in params:
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(whole.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def batches(size: str, rank: int, world: int, batch_size: int = 2) -> ShardedText:
    cfg = SIZES[size]
    return ShardedText(
        load_text(), context=cfg.context, batch_size=batch_size, rank=rank, world_size=world,
        seed=0,
    )  # fmt: skip


def poison_grad(param: torch.Tensor, steps: set[int], counter: list[int], value: float) -> None:
    """One element of ``param``'s gradient becomes ``value`` during backward at ``steps``
    (counted by ``counter[0]``, which the loop advances): an overflow as it arrives."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if counter[0] in steps:
            grad = grad.clone()
            grad.view(-1)[0] = value
        return grad

    param.register_hook(hook)


def run(
    *,
    precision: str,
    ac: str,
    strategy: str = "none",
    size: str = "small",
    compile_backend: str | None = None,
    adaptive: Any = False,
    backward_scales: bool = False,
    steps: int = 6,
    poison: tuple[int, set[int], float] | None = None,
    poison_after: tuple[int, set[int], float] | None = None,
    spike: float | None = None,
    rank: int = 0,
    world: int = 1,
    policy_kwargs: dict[str, Any] | None = None,
    weights: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of the recipe; returns what a bitwise comparison needs.

    Args:
        poison: ``(rank, steps, value)``: on that rank, one element of ``blocks.1.fc.weight``'s
            gradient becomes ``value`` during backward at those steps.
        poison_after: the same, written into the gradient after backward (after DDP's
            all-reduce or FSDP's reduce-scatter), before the step.
        weights: ``DistAMP(weights=...)``: 16-bit weights with this master kind.
        spike: ``blocks.1.fc`` multiplies its input by this inside (an fp16 forward overflow
            there until the adaptive rules promote it, while it is checkpointed).
    """
    from distamp import AutocastPolicy, DistAMP

    model = gpt(size, sequential=ac == "sequential")
    if spike is not None:
        make_spiky(model, 1, spike)
    apply_ac(model, ac)
    if compile_backend is not None:
        compile_blocks(model, compile_backend)
    counter = [0]
    if poison is not None and poison[0] == rank:
        poison_grad(model.get_parameter(_param_name(model, "blocks.1.fc.weight")), poison[1],
                    counter, poison[2])  # fmt: skip
    policy = AutocastPolicy(
        precision, adaptive=adaptive, backward_scales=backward_scales, **(policy_kwargs or {})
    )
    amp = DistAMP(
        precision=precision, policy=policy, strategy=strategy, device="cpu", weights=weights
    )
    amp.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    data = batches(size, rank, world)
    stepped, scales = [], []
    for k in range(steps):
        counter[0] = k
        with forward_context(ac):
            with amp.autocast():
                loss = lm_loss(amp.model, data.batch(k))
            amp.backward(loss)
        if poison_after is not None and poison_after[0] == rank and k in poison_after[1]:
            grad = amp.model.get_parameter(_param_name(amp.model, "blocks.1.fc.weight")).grad
            assert grad is not None
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = poison_after[2]
        result = amp.step()
        stepped.append(bool(result.stepped))
        scales.append(float(result.loss_scale))
    adaptive_changes = [] if policy.adaptive is None else policy.adaptive.changes
    scale_changes = [] if policy.backward_scales is None else policy.backward_scales.changes
    return {
        "digest": digest(amp.model),
        "stepped": stepped,
        "scales": scales,
        "adaptive": [user_name(str(c)) for c in adaptive_changes],
        "backward_scales": [user_name(str(c)) for c in scale_changes],
    }


def _param_name(model: nn.Module, wanted: str) -> str:
    """The qualified name of the parameter the user calls ``wanted`` (wrappers' prefixes)."""
    for name, _ in model.named_parameters():
        if user_name(name) == wanted:
            return name
    raise KeyError(wanted)


def checkpoint_as_frameworks_do(model: nn.Module) -> None:
    """What Lightning's ``activation_checkpointing_policy`` (FSDP, ModelParallel) and
    Accelerate's FSDP plugin ``activation_checkpointing`` call: torch's
    ``apply_activation_checkpointing`` with a class check (non-reentrant wrappers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def plugin_run(kind: str, checkpointed: bool, steps: int = 4) -> dict[str, Any]:
    """The small eager-attention GPT through a framework plug-in with a bf16 policy, its blocks
    checkpointed as the framework's own switch does or not; one process (world 1)."""
    from distamp import AutocastPolicy

    model = gpt("small")
    if checkpointed:
        checkpoint_as_frameworks_do(model)
    data = batches("small", 0, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    policy = AutocastPolicy("bf16")
    losses = []
    if kind == "fabric":
        from lightning.fabric import Fabric

        from distamp.integrations.lightning import DistAMPPrecision

        plugin = DistAMPPrecision("bf16-mixed", device="cpu", policy=policy)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        wrapped, opt = fabric.setup(model, opt)
        backward = fabric.backward
    else:
        from distamp.integrations.accelerate import DistAMPAccelerator

        acc = DistAMPAccelerator(mixed_precision="bf16", cpu=True, policy=policy)
        wrapped, opt = acc.prepare(model, opt)
        backward = acc.backward
    for k in range(steps):
        loss = lm_loss(wrapped, data.batch(k))
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    wrappers = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())
    return {"digest": digest(model), "losses": losses, "wrappers": wrappers}
