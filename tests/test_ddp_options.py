"""DDP's own options through the engine: ``DistAMP(ddp_kwargs=...)`` reaches the
``DistributedDataParallel`` the engine builds (2 real gloo ranks), is checked when the engine is
constructed, is compared across ranks at setup, and works with gradient accumulation and the
comm hooks; a sparse gradient under a hook that compresses dense buckets is refused at setup."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _dist import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from distamp import DistAMP
from distamp.cluster import SettingsMismatchError
from distamp.parallel.ddp import DDP_KWARGS, DENSE_BUCKET_HOOKS, check_sparse_gradients


class Branchy(nn.Module):
    """A model whose forward never uses ``unused``: DDP needs ``find_unused_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class Lookup(nn.Module):
    """An embedding with sparse gradients, then a dense head."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8, sparse=sparse), nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


def _mlp(width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def _train(amp: DistAMP, rank: int, steps: int, lookup: bool = False) -> list[bool]:
    """``steps`` optimizer steps of this rank's batches, each over ``grad_accum_steps``
    micro-batches; the skip decisions."""
    stepped = []
    for k in range(steps * amp.config.grad_accum_steps):
        gen = torch.Generator().manual_seed(100 * k + rank)
        x = torch.randint(16, (4,), generator=gen) if lookup else torch.randn(4, 8, generator=gen)
        y = torch.randn(4, 1, generator=gen)
        with amp.accumulate(), amp.autocast():
            loss = nn.functional.mse_loss(amp.model(x).float(), y)
        result = amp.backward_and_step(loss)
        if result is not None:
            stepped.append(result.stepped)
    return stepped


def _params(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


# ---------------------------------------------------------------- on 2 gloo ranks
def _unused_parameters(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Branchy()
    amp = DistAMP("bf16", strategy="ddp", device="cpu", timeout=60,
                  ddp_kwargs={"find_unused_parameters": True})  # fmt: skip
    wrapped, _ = amp.setup(model, _sgd)
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.find_unused_parameters
    stepped = _train(amp, rank, 3)
    out = {"stepped": stepped, "params": _params(model), "unused": model.unused.weight.grad}
    amp.close()
    torch.manual_seed(0)
    plain = DistAMP("bf16", strategy="ddp", device="cpu", timeout=60)
    plain.setup(Branchy(), _sgd)
    try:  # refused at the first backward, before any step, naming the option
        _train(plain, rank, 2)
        out["without"] = "trained"
    except ValueError as exc:
        out["without"] = str(exc)
        out["steps_without"] = plain.step_count
    return out


def _bucket_counts(rank: int, cap: float | None) -> tuple[int, int, bool, bool]:
    """Buckets DDP all-reduced in the last backward of 3 (after it rebuilt its buckets), its
    cap, and two flags: the engine's defaults without a cap, the options' values with one."""
    options = {"bucket_cap_mb": cap, "gradient_as_bucket_view": False, "broadcast_buffers": False}
    amp = DistAMP("bf16", strategy="ddp", device="cpu", timeout=60,
                  ddp_kwargs=None if cap is None else options)  # fmt: skip
    wrapped, _ = amp.setup(_mlp(64), _sgd)
    calls: list[int] = []

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    assert isinstance(wrapped, DistributedDataParallel)
    wrapped.register_comm_hook(None, counting)
    for _ in range(3):
        calls.clear()
        _train(amp, rank, 1)
    flags = wrapped.gradient_as_bucket_view, wrapped.broadcast_buffers
    cap_bytes = wrapped.bucket_bytes_cap
    amp.close()
    return len(calls), cap_bytes, *flags


def _static_graph(rank: int, hook: str | None, static: bool) -> tuple[list[bool], Any]:
    options = {"static_graph": static, "bucket_cap_mb": 0.002}  # several buckets
    amp = DistAMP("fp16", strategy="ddp", device="cpu", timeout=60, grad_accum_steps=2,
                  comm_hook=hook, ddp_kwargs=options)  # fmt: skip
    model = _mlp()
    wrapped, _ = amp.setup(model, _sgd)
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.static_graph is static
    stepped = _train(amp, rank, 4)
    amp.close()
    return stepped, _params(model)


def _refusals(rank: int) -> dict[str, str]:
    out = {}
    cases: dict[str, tuple[dict[str, Any], Any]] = {
        "sparse fp16": ({"comm_hook": "fp16"}, Lookup()),
        "parallelised": ({"ddp_kwargs": {"static_graph": True}}, DistributedDataParallel(_mlp())),
        "caps differ": ({"ddp_kwargs": {"bucket_cap_mb": 1 + rank}}, _mlp()),
    }
    for case, (kwargs, model) in cases.items():
        amp = DistAMP("fp16", strategy=kwargs.pop("strategy", "auto"), device="cpu", timeout=60,
                      **kwargs)  # fmt: skip
        try:
            amp.setup(model, _sgd)
            out[case] = "set up"
        except (SettingsMismatchError, ValueError) as exc:
            out[case] = f"{type(exc).__name__}: {exc}"
    return out


def _sparse_fp32(rank: int) -> tuple[list[bool], Any]:
    torch.manual_seed(0)
    model = Lookup()
    amp = DistAMP("fp16", strategy="ddp", device="cpu", timeout=60, comm_hook="fp32")
    amp.setup(model, _sgd)
    stepped = _train(amp, rank, 3, lookup=True)
    amp.close()
    return stepped, _params(model)


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from distamp.cluster import init_distributed, shutdown_distributed

    init_distributed(timeout=60)  # one group for every engine: none of them owns it
    out: dict[str, Any] = {"unused": _unused_parameters(rank)}
    out["buckets"] = {cap: _bucket_counts(rank, cap) for cap in (None, 0.01)}
    out["static"] = {
        (hook, static): _static_graph(rank, hook, static)
        for hook in (None, "fp16")
        for static in (False, True)
    }
    out["refused"] = _refusals(rank)
    out["sparse fp32"] = _sparse_fp32(rank)
    shutdown_distributed()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, timeout=240)


@pytest.mark.timeout(300)
def test_find_unused_parameters_reaches_ddp(ranks: list[dict[str, Any]]) -> None:
    for out in (r["unused"] for r in ranks):
        assert out["stepped"] == [True, True, True] and out["unused"] is None
        assert "'find_unused_parameters': True" in out["without"], out["without"]
        assert "'unused.weight'" in out["without"] and out["steps_without"] == 0
    assert ranks[0]["unused"]["params"] == ranks[1]["unused"]["params"]


@pytest.mark.timeout(300)
def test_bucket_cap_and_flags_reach_ddp(ranks: list[dict[str, Any]]) -> None:
    for out in (r["buckets"] for r in ranks):
        (default, default_cap, *defaults), (small, small_cap, *given) = out[None], out[0.01]
        assert default == 1 and small >= 2, (default, small)  # a 16 KiB weight > a 10 KiB cap
        assert small_cap == int(0.01 * 1024 * 1024) and default_cap > small_cap
        assert defaults == [True, True]  # the engine's bucket view and DDP's buffer sync
        assert given == [False, False]


@pytest.mark.timeout(300)
def test_static_graph_with_accumulation_and_a_comm_hook(ranks: list[dict[str, Any]]) -> None:
    per_rank = [r["static"] for r in ranks]
    for case, (stepped, params) in per_rank[0].items():
        assert per_rank[1][case] == (stepped, params), case  # one decision, one model
        assert stepped == per_rank[0][(None, False)][0], case
    # A static graph syncs its first micro-batch too (DDP records the graph then): the same
    # average, bitwise without a hook; within fp16's compression with it.
    assert per_rank[0][(None, True)][1] == per_rank[0][(None, False)][1]
    for a, b in zip(per_rank[0][("fp16", True)][1], per_rank[0][("fp16", False)][1], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_setup_refusals_on_a_real_group(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        refused = out["refused"]
        assert refused["sparse fp16"].startswith("ValueError: comm_hook='fp16'")
        assert "'emb.weight'" in refused["sparse fp16"] and "sparse=False" in refused["sparse fp16"]
        assert "already parallelised" in refused["parallelised"]
        assert refused["caps differ"].startswith("SettingsMismatchError"), refused
        assert "ddp_kwargs: ranks 0: [('bucket_cap_mb', 1.0)]" in refused["caps differ"], rank


@pytest.mark.timeout(300)
def test_sparse_gradients_train_under_the_fp32_hook(ranks: list[dict[str, Any]]) -> None:
    (stepped, params), other = ranks[0]["sparse fp32"], ranks[1]["sparse fp32"]
    assert other == (stepped, params) and any(stepped)


# ---------------------------------------------------------------- one process
_BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"ddp_kwargs": [("static_graph", True)]}, TypeError, r"ddp_kwargs=.* must be a mapping"),
    ({"ddp_kwargs": {"device_ids": [0]}}, ValueError, r"'device_ids'\]: the engine places"),
    ({"ddp_kwargs": {"process_group": None}}, ValueError, r"'process_group'\]: the engine"),
    ({"ddp_kwargs": {"output_device": 0}}, ValueError, r"'output_device'\]: the engine places"),
    ({"ddp_kwargs": {"module": None}}, ValueError, r"'module'\]: the engine wraps"),
    ({"ddp_kwargs": {"dim": 1}}, ValueError, r"'dim'\]: .*the keys it takes are \('bucket_cap"),
    ({"ddp_kwargs": {"static_graph": 1}}, TypeError, r"static_graph'\]` must be True or False"),
    ({"ddp_kwargs": {"find_unused_parameters": "yes"}}, TypeError, "must be True or False"),
    ({"ddp_kwargs": {"bucket_cap_mb": 0}}, ValueError, r"bucket_cap_mb'\]=0.0 must be"),
    ({"ddp_kwargs": {"bucket_cap_mb": -1}}, ValueError, "number of megabytes"),
    ({"ddp_kwargs": {"bucket_cap_mb": float("nan")}}, ValueError, "must be finite"),
    ({"ddp_kwargs": {"bucket_cap_mb": 2**40}}, ValueError, "number of megabytes"),
    ({"ddp_kwargs": {"bucket_cap_mb": True}}, ValueError, "must be a real number"),
    ({"ddp_kwargs": {"bucket_cap_mb": "25"}}, ValueError, "must be a real number"),
    ({"strategy": "fsdp2", "ddp_kwargs": {"static_graph": True}}, ValueError,
     r"strategy='fsdp2' builds none: use strategy='ddp'"),
    ({"strategy": "none", "ddp_kwargs": {"static_graph": True}}, ValueError, "strategy='none'"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "match"), _BAD)
def test_bad_ddp_kwargs_are_refused_at_construction(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DistAMP("bf16", **kwargs)


def test_ddp_kwargs_with_a_mesh_or_a_torchft_manager_are_refused() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = object.__new__(DeviceMesh)  # the type is what the engine checks before a group
    with pytest.raises(ValueError, match="with mesh= you parallelised the model"):
        DistAMP("bf16", mesh=mesh, ddp_kwargs={"static_graph": True})
    torchft = pytest.importorskip("torchft")
    manager = object.__new__(torchft.Manager)
    with pytest.raises(ValueError, match="with ft_manager it builds torchft's DDP"):
        DistAMP("bf16", ft_manager=manager, ddp_kwargs={"static_graph": True})


def test_accepted_ddp_kwargs_are_a_checked_copy() -> None:
    given = {"bucket_cap_mb": np.float32(1.5), "static_graph": True}
    amp = DistAMP("bf16", strategy="ddp", ddp_kwargs=given)
    given["static_graph"] = False  # later edits reach nothing
    assert amp.config.ddp_kwargs == {"bucket_cap_mb": 1.5, "static_graph": True}
    assert type(amp.config.ddp_kwargs["bucket_cap_mb"]) is float
    assert set(DDP_KWARGS) >= set(amp.config.ddp_kwargs)
    assert DistAMP("bf16", strategy="fsdp2", ddp_kwargs={}).config.ddp_kwargs is None


def test_one_process_trains_with_ddp_kwargs_and_nothing_to_wrap() -> None:
    # "auto" resolves to "none" on one process: DDP's options are moot there, not an error, so
    # the same script runs on one rank and on many.
    amp = DistAMP("bf16", device="cpu", ddp_kwargs={"find_unused_parameters": True})
    amp.setup(Branchy(), _sgd)
    assert amp.strategy == "none" and _train(amp, 0, 2) == [True, True]
    amp.close()


@pytest.mark.parametrize("hook", DENSE_BUCKET_HOOKS)
def test_sparse_gradients_under_a_dense_bucket_hook_are_refused_at_setup(hook: str) -> None:
    amp = DistAMP("fp16", strategy="ddp", device="cpu", comm_hook=hook)
    model = nn.Sequential(nn.Linear(4, 4), nn.EmbeddingBag(16, 4, sparse=True))
    with pytest.raises(ValueError, match=rf"comm_hook='{hook}'.*module '1' \(EmbeddingBag"):
        amp.setup(model, _sgd)
    assert amp.strategy == "ddp"  # refused before wrapping: no group was needed


def test_sparse_check_lets_dense_and_frozen_embeddings_and_the_other_hooks_pass() -> None:
    frozen = Lookup()
    frozen.emb.weight.requires_grad_(False)
    for hook in DENSE_BUCKET_HOOKS:
        check_sparse_gradients(Lookup(sparse=False), hook)
        check_sparse_gradients(frozen, hook)
    for hook in (None, "fp32", "bf16"):
        check_sparse_gradients(Lookup(), hook)
