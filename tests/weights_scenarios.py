"""The engine with 16-bit weights (``DistAMP(weights=...)``) on the main job's medium GPT, as
the 2-rank tests of tests/test_engine_weights.py run it: an overflow on one rank, and
checkpoints that resume bitwise and load across weight precisions and world sizes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

import distamp
from launch.model import lm_loss
from tests import medium_scenarios as medium


def master_digest(amp: distamp.DistAMP) -> str:
    """SHA-256 of every fp32 master this rank holds (the parameters themselves for fp32
    weights), in parameter order."""
    opt = amp.optimizer
    held = dict(opt.master_tensors()) if isinstance(opt, distamp.MasterWeightOptimizer) else {}
    h = hashlib.sha256()
    for p in amp.model.parameters():
        value = held.get(p, p.detach())
        local = value.to_local() if hasattr(value, "to_local") else value
        h.update(local.float().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine(precision: str, strategy: str, weights: Any) -> distamp.DistAMP:
    amp = distamp.DistAMP(
        precision=precision, strategy=strategy, weights=weights, max_grad_norm=1.0
    )
    amp.setup(medium.gpt(), medium.optimizer)
    return amp


def overflow_on_one_rank(
    rank: int, world: int, precision: str, value: float, where: str
) -> dict[str, Any]:
    """Three DDP steps; at the second, one element of rank 1's gradient becomes ``value``:
    ``where="backward"`` through a tensor hook while backward runs (before DDP's all-reduce),
    ``"after"`` written into ``.grad`` after it (user code between backward and step)."""
    amp = _engine(precision, "ddp", "exact")
    batches = medium.data(rank, world)
    target = amp.model.module.blocks[3].qkv.weight
    stepped, digests, dtypes = [], [], set()
    for k in range(3):
        poison = k == 1 and rank == 1
        handle = None
        if poison and where == "backward":

            def hook(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g.view(-1)[7] = value
                return g

            handle = target.register_hook(hook)
        with amp.autocast():
            loss = lm_loss(amp.model, batches.batch(k))
        amp.backward(loss)
        dtypes.add(str(target.grad.dtype))
        if poison and where == "after":
            with torch.no_grad():
                target.grad.view(-1)[7] = value
        before = master_digest(amp)
        stepped.append(bool(amp.step().stepped))
        digests.append((before, master_digest(amp)))
        if handle is not None:
            handle.remove()
    out = {
        "stepped": stepped,
        "digests": digests,
        "weights": medium.digest(amp.model),
        "grad_dtypes": sorted(dtypes),
        "param_dtype": str(target.dtype),
        "skipped": amp.scaler.skipped_steps,
    }
    amp.close()
    return out


def resume(rank: int, world: int, directory: str, strategy: str, weights: str) -> dict[str, Any]:
    """Two steps, a save, one more step; then a new engine loads the save and takes the same
    third step. Returns both runs' master digests and weights."""
    amp = _engine("bf16", strategy, weights)
    batches = medium.data(rank, world)
    medium.train(amp, batches, 0, 2)
    amp.save_state(directory)
    saved = medium.digest(amp.model) if strategy == "fsdp2" else None
    medium.train(amp, batches, 2, 3)
    straight = (master_digest(amp), medium.digest(amp.model))
    amp.close()
    again = _engine("bf16", strategy, weights)
    assert again.load_state(directory)
    medium.train(again, batches, 2, 3)
    resumed = (master_digest(again), medium.digest(again.model))
    again.close()
    return {"straight": straight, "resumed": resumed, "saved_weights": saved}


def fp32_masters_of(directory: str) -> dict[str, torch.Tensor]:
    """The model entries of the latest checkpoint in ``directory``, read in one process into
    a plain fp32-weight engine (``weights=None``): the masters as an fp32 run sees them."""
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights=None)
    amp.setup(medium.gpt(), medium.optimizer)
    assert amp.load_state(Path(directory))
    out = {n: p.detach().clone() for n, p in amp.model.named_parameters()}
    amp.close()
    return out


def full_masters(rank: int, world: int, directory: str, weights: str, out_file: str) -> None:
    """Two FSDP2 steps with 16-bit weights, a save, and every master gathered whole (written
    by rank 0 to ``out_file``: 86 MB do not travel back through the harness' pipe)."""
    amp = _engine("bf16", "fsdp2", weights)
    medium.train(amp, medium.data(rank, world), 0, 2)
    amp.save_state(directory)
    opt = amp.optimizer
    assert isinstance(opt, distamp.MasterWeightOptimizer)
    held = dict(opt.master_tensors())
    out = {}
    for name, p in amp.model.named_parameters():
        master = held[p]
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import DTensor

            master = DTensor.from_local(
                master, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
        out[name] = master.clone()
    amp.close()
    if rank == 0:
        torch.save(out, out_file)


def masters_after_setup(rank: int, world: int) -> str:
    """Each rank builds the model from its own seed; after setup under DDP the masters are
    rank 0's on every rank (DDP broadcast the 16-bit weights, the engine the masters)."""
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    amp = distamp.DistAMP(precision="bf16", strategy="ddp", weights="exact")
    amp.setup(model, lambda params: torch.optim.AdamW(params))
    digest = master_digest(amp)
    amp.close()
    return digest
