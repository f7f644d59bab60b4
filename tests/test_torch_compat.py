"""The torch-internal names distamp uses (distamp.torch_compat), each exercised on the torch this
suite runs on: the pinned release here, the floor and the newest of the window in CI's
compatibility stage (``nox -s torch``). A release that renames one fails here, naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distamp import DistributedGradScaler
from distamp.torch_compat import (
    GRAD_SCALER_MEMBERS,
    OptState,
    TorchDispatchMode,
    amp_unscale_,
    amp_update_scale_,
    dtensor_local,
    foreach_mul_,
    foreach_norm,
    fsdp1_replica_group,
    group_by_device_and_dtype,
    is_pipeline_stage,
    missing_internals,
    scaled_mm,
    takes_grad_scale,
)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A real one-process gloo group (pipeline stages and device meshes need one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_this_torch_has_every_internal_name() -> None:
    assert missing_internals() == [], f"torch {torch.__version__} moved these names"


def test_distributed_grad_scaler_sees_torchs_members() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=8.0)
    for name in GRAD_SCALER_MEMBERS:
        assert hasattr(scaler, name), name
    assert {s.name for s in OptState} >= {"READY", "UNSCALED", "STEPPED"}


def test_grouping_by_device_and_dtype_keeps_the_input_indices() -> None:
    tensors = [torch.ones(2), torch.ones(3, dtype=torch.bfloat16), torch.zeros(4), torch.ones(1)]
    groups = group_by_device_and_dtype(tensors)
    assert set(groups) == {
        (torch.device("cpu"), torch.float32),
        (torch.device("cpu"), torch.bfloat16),
    }
    members, indices = groups[(torch.device("cpu"), torch.float32)]
    assert indices == [0, 2, 3]
    assert all(m is tensors[i] for m, i in zip(members, indices, strict=True))


def test_unscale_multiplies_and_flags_non_finite_values() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found = torch.zeros(1)
    amp_unscale_(grads, found, torch.tensor(0.5))
    assert found.item() == 0.0
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    amp_unscale_([torch.tensor([float("inf")])], found, torch.tensor(0.5))
    assert found.item() == 1.0


def test_the_scale_update_grows_after_the_interval_and_backs_off_on_inf() -> None:
    scale, tracker = torch.tensor([16.0]), torch.zeros(1, dtype=torch.int32)
    for _ in range(2):
        amp_update_scale_(scale, tracker, torch.zeros(1), 2.0, 0.5, 2)
    assert scale.item() == 32.0 and tracker.item() == 0
    amp_update_scale_(scale, tracker, torch.ones(1), 2.0, 0.5, 2)
    assert scale.item() == 16.0 and tracker.item() == 0


def test_foreach_norm_and_mul_match_the_plain_ops() -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([-6.0])]
    assert [n.item() for n in foreach_norm(tensors, 2)] == [5.0, 6.0]
    assert [n.item() for n in foreach_norm(tensors, float("inf"))] == [4.0, 6.0]
    foreach_mul_(tensors, 0.5)
    assert tensors[0].tolist() == [1.5, 2.0] and tensors[1].tolist() == [-3.0]
    assert callable(scaled_mm)


def test_fused_optimizers_are_recognised() -> None:
    params = [nn.Parameter(torch.ones(2))]
    assert takes_grad_scale(torch.optim.AdamW(params, fused=True))
    assert not takes_grad_scale(torch.optim.AdamW(params, foreach=True))
    assert not takes_grad_scale(torch.optim.SGD(params, lr=0.1))


def test_the_dispatch_mode_sees_the_ops() -> None:
    seen: list[str] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.ones(2) + torch.ones(2)
    assert "aten.add" in seen


def test_fsdp1_replica_group_is_none_outside_hybrid_sharding() -> None:
    assert fsdp1_replica_group(nn.Linear(2, 2)) is None


@pytest.mark.timeout(60)
def test_a_dtensor_parameters_local_object_and_a_plain_tensor(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = nn.Parameter(distribute_tensor(torch.arange(4.0), mesh, [Replicate()]))
    local = dtensor_local(weight)
    assert local is not None and torch.equal(local, weight.to_local())
    assert dtensor_local(local) is None  # already plain


@pytest.mark.timeout(60)
def test_pipeline_stages_are_recognised(one_rank: None) -> None:
    from torch.distributed.pipelining import PipelineStage

    stage = PipelineStage(nn.Linear(4, 4), stage_index=0, num_stages=1, device=torch.device("cpu"))
    assert is_pipeline_stage(stage) and not is_pipeline_stage(stage.submod)
