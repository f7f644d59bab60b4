"""A run resumes under another recipe: the names it saved are the model's own.

An adaptive policy promotes ``blocks.0.hot`` (its fp16 output overflows on the first batches)
and per-block backward scales raise ``blocks.0``'s exponent (its gradients underflow under a
small loss scale). The run is saved in one wrapping of the model and resumed in another: plain,
full or selective activation checkpointing, each block compiled in place, the whole model
compiled (``backend="eager"`` keeps it fast). Every resume replays the promotion and the
exponent before its first step and ends bitwise equal to the resume in its own wrapping; on 2
gloo ranks DDP and FSDP2 (with checkpointing) resume each other's checkpoints, replaying the same
decisions. A checkpoint of another
model (a module renamed) is still refused, naming the module. Real engines, real checkpoints;
fp16 autocast runs on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import distamp
from distamp import AutocastPolicy
from distamp.model_names import model_name, named_model_modules
from distamp.parallel.recompute import apply_activation_checkpointing, compile_blocks
from distamp.precision.adaptive import AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules

D, CUT, STEPS = 16, 10, 16
WRAPPINGS = ("plain", "full", "selective", "blocks", "compiled")
PROMOTED = ("blocks.0.hot",)


class Hot(nn.Module):
    """A linear map normalised per row: a large input row overflows fp16 inside it (inf / inf
    is NaN), so the skips are blamed on it; in fp32 the row is fine."""

    def __init__(self) -> None:
        super().__init__()
        fc = nn.Linear(D, D)
        self.weight, self.bias = fc.weight, fc.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) * 16
        return y / (1 + y.abs().amax(-1, keepdim=True))


class Block(nn.Module):
    def __init__(self, hot: str = "hot") -> None:
        super().__init__()
        self.add_module(hot, Hot())
        self.ln = nn.LayerNorm(D)
        self.hot_name = hot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.ln(getattr(self, self.hot_name)(x)))


class Net(nn.Module):
    """Two blocks in an ``nn.ModuleList`` (what checkpointing and ``compile_blocks`` act on)."""

    def __init__(self, hot: str = "hot") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(hot), Block()])
        self.out = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def batch(k: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 6 batches have 4 rows at fp16's edge (``blocks.0.hot`` overflows), the
    others are tiny (``2**-10``: the blocks' gradients underflow under a loss scale of 16)."""
    g = torch.Generator().manual_seed(1000 + k + 7919 * rank)
    x = torch.randn(16, D, generator=g)
    if k < 6:
        x[:4] = (x[:4] * 6e4).clamp(-6e4, 6e4)
    else:
        x = x * 2.0**-10
    return x, torch.randn(16, 1, generator=g)


def wrapped(net: nn.Module, how: str) -> nn.Module:
    """``net`` in one of :data:`WRAPPINGS` (the large-model recipe's helpers, or
    ``torch.compile`` of the whole model)."""
    if how in ("full", "selective"):
        return apply_activation_checkpointing(net, how)
    if how == "blocks":
        return compile_blocks(net, backend="eager")
    if how == "compiled":
        return torch.compile(net, backend="eager")  # type: ignore[return-value]
    assert how == "plain", how
    return net


def make(
    how: str, *, strategy: str = "none", hot: str = "hot"
) -> tuple[distamp.DistAMP, nn.Module, AutocastPolicy]:
    torch.manual_seed(0)
    net = Net(hot)
    if strategy == "fsdp2":  # checkpointed blocks under FSDP2, as torchtitan orders them
        apply_activation_checkpointing(net, "full")
    policy = AutocastPolicy(
        "fp16",
        adaptive=AdaptiveRules(interval=2, skips=2, window=4, max_promoted_fraction=0.5),
        backward_scales=BackwardScaleRules(grow_above=0.01),
    )
    scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    amp = distamp.DistAMP("fp16", strategy=strategy, policy=policy, scaler=scaler)
    amp.setup(wrapped(net, how), lambda p: torch.optim.AdamW(p, lr=1e-2))
    return amp, net, policy


def train(amp: distamp.DistAMP, start: int, stop: int, rank: int = 0) -> None:
    for k in range(start, stop):
        x, y = batch(k, rank)
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)


def outcome(amp: distamp.DistAMP, net: nn.Module, policy: AutocastPolicy) -> dict[str, Any]:
    """What two runs compare (whole parameters, gathered where sharded), then the engine
    closed. Plain lists: they cross the ranks' result queue."""
    assert policy.adaptive is not None and amp.adaptive is not None
    scales = amp.adaptive.scales
    assert scales is not None
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
    out = {
        "promotions": [(c.step, c.module, c.after) for c in policy.adaptive.changes],
        "exponents": [(c.step, c.block, c.after) for c in scales.changes],
        "skipped": amp.scaler.skipped_steps,
        "params": [p.detach().flatten().tolist() for p in params],
    }
    amp.close()
    return out


def saved(how: str, root: Path, *, strategy: str = "none", rank: int = 0) -> Path:
    """A checkpoint after :data:`CUT` steps in wrapping ``how`` (made once per wrapping)."""
    directory = root / f"{strategy}-{how}"
    if not directory.exists():
        amp, _, policy = make(how, strategy=strategy)
        train(amp, 0, CUT, rank)
        assert policy.adaptive is not None and policy.adaptive.promoted == PROMOTED
        amp.save_state(directory)
        amp.close()
    return directory


def resumed(how: str, checkpoint: Path, *, strategy: str = "none", rank: int = 0) -> dict[str, Any]:
    """The run resumed from ``checkpoint`` in wrapping ``how``, to :data:`STEPS`."""
    amp, net, policy = make(how, strategy=strategy)
    assert amp.load_state(checkpoint)
    assert policy.adaptive is not None and policy.adaptive.promoted == PROMOTED
    assert amp.adaptive is not None and amp.adaptive.grad_exponents["blocks.0"] > 0
    train(amp, CUT, STEPS, rank)
    return outcome(amp, net, policy)


# ---------------------------------------------------------------------------- names


def test_names_are_the_models_own_under_every_wrapping() -> None:
    torch.manual_seed(0)
    plain = [(n, type(m)) for n, m in named_model_modules(Net())]
    for how in WRAPPINGS[1:]:
        model = wrapped(Net(), how)
        assert [(n, type(m)) for n, m in named_model_modules(model)] == plain, how
    model = wrapped(apply_activation_checkpointing(Net(), "full"), "compiled")
    assert [(n, type(m)) for n, m in named_model_modules(model)] == plain
    raw = "_orig_mod.blocks.0._checkpoint_wrapped_module.hot.weight"
    assert model_name(raw) == "blocks.0.hot.weight"


def test_a_submodule_named_module_keeps_its_name() -> None:
    """``module`` is DDP's wrapper part only where the model is a DDP: a user's submodule of
    that name stays."""
    model = nn.Sequential()
    model.add_module("module", nn.Linear(2, 2))
    assert [n for n, _ in named_model_modules(model)] == ["", "module"]
    assert model_name("module.weight", model) == "module.weight"
    assert model_name("module.weight") == "module.weight"


# ---------------------------------------------------------------------------- one process

_PAIRS = [
    ("plain", "full"),
    ("full", "plain"),
    ("plain", "compiled"),
    ("compiled", "plain"),
    ("plain", "selective"),
    ("selective", "blocks"),
    ("blocks", "full"),
    ("full", "compiled"),
]
_OWN: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("across-wrappers")


@pytest.mark.parametrize(("save", "resume"), _PAIRS, ids=[f"{a}-to-{b}" for a, b in _PAIRS])
def test_resume_in_another_wrapping_is_bitwise_its_own(
    save: str, resume: str, checkpoints: Path
) -> None:
    if resume not in _OWN:
        _OWN[resume] = resumed(resume, saved(resume, checkpoints))
    own = _OWN[resume]
    assert [m for _, m, _ in own["promotions"]] == list(PROMOTED)
    assert [b for _, b, _ in own["exponents"]] == ["blocks.0", "blocks.1"]
    assert resumed(resume, saved(save, checkpoints)) == own


def test_a_checkpoint_of_another_model_is_refused_naming_the_module(tmp_path: Path) -> None:
    """The promoted module renamed (``blocks.0.heat``): not a wrapper's part, another model."""
    directory = saved("plain", tmp_path)
    amp, _, policy = make("full", hot="heat")
    with pytest.raises(Exception, match=r"blocks\.0\.hot"):
        amp.load_state(directory)
    assert policy.adaptive is not None and policy.adaptive.promoted == ()
    amp.close()


def test_the_adaptive_state_names_a_module_the_model_lacks(tmp_path: Path) -> None:
    """The same refusal from the adaptive state alone (weights aside)."""
    amp, _, policy = make("plain")
    train(amp, 0, 4)
    assert policy.adaptive is not None
    state = policy.adaptive.state_dict()
    amp.close()
    other, _, other_policy = make("compiled", hot="heat")
    assert other_policy.adaptive is not None
    with pytest.raises(ValueError, match=r"'blocks\.0\.hot' is not a module of this model"):
        other_policy.adaptive.validate_state_dict(state)
    other.close()


# ---------------------------------------------------------------------------- two ranks


def _ddp_and_fsdp2(rank: int, world: int, root: str) -> dict[str, Any]:
    """Saved under DDP (plain) and under FSDP2 (checkpointed blocks); each resumed under both."""
    del world
    base = Path(root)
    ddp, fsdp2 = (saved("plain", base, strategy=s, rank=rank) for s in ("ddp", "fsdp2"))
    return {
        "ddp-to-fsdp2": resumed("plain", ddp, strategy="fsdp2", rank=rank),
        "fsdp2-to-fsdp2": resumed("plain", fsdp2, strategy="fsdp2", rank=rank),
        "fsdp2-to-ddp": resumed("plain", fsdp2, strategy="ddp", rank=rank),
        "ddp-to-ddp": resumed("plain", ddp, strategy="ddp", rank=rank),
    }


def test_ddp_and_fsdp2_resume_each_others_checkpoints(tmp_path: Path) -> None:
    """Each checkpoint resumed under the other strategy replays the same promotion and
    exponents and skips the same steps as resumed under its own; the parameters differ only by
    the strategies' own rounding (DDP all-reduces, FSDP2 reduce-scatters: never bitwise alike),
    and both ranks end bitwise equal."""
    results = run_ranks(_ddp_and_fsdp2, 2, str(tmp_path), timeout=240)
    for r in results:
        for other, own in (("ddp-to-fsdp2", "ddp-to-ddp"), ("fsdp2-to-ddp", "fsdp2-to-fsdp2")):
            for key in ("promotions", "exponents", "skipped"):
                assert r[other][key] == r[own][key], (other, key)
            for a, b in zip(r[other]["params"], r[own]["params"], strict=True):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-2, atol=1e-3)
    assert results[0] == results[1]
