"""DistributedGradScaler(process_group=torchft.Manager): fault-tolerant replica groups.

Real torchft: a Lighthouse in this process, each replica group a separate Python process
(tests/scripts/ft_replica.py: one rank, gloo, torchft's DDP and optimizer wrapper, fp16
autocast), killed and restarted for real. Every process runs under a hard timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import distamp
from tests._dist import ROOT, free_port, launcher_free_env, run_ranks

SCRIPT = ROOT / "tests" / "scripts" / "ft_replica.py"
FSDP2_SCRIPT = ROOT / "tests" / "scripts" / "ft_fsdp2_replica.py"
TIMEOUT = 240.0  # per process; start-up alone (imports) takes seconds on a loaded machine


def test_process_group_of_unsupported_type_raises_type_error() -> None:
    for bad in ("world", 2, [0, 1], object()):
        with pytest.raises(TypeError, match=r"ProcessGroup.*DeviceMesh.*torchft\.Manager"):
            distamp.DistributedGradScaler("cpu", process_group=bad)
    distamp.DistributedGradScaler("cpu", process_group=None)  # still accepted


@pytest.fixture
def manager() -> Any:
    """A real torchft Manager of a one-rank replica group, with its own Lighthouse, in this
    process (no quorum is asked for: enough for what setup() and the argument checks do)."""
    from datetime import timedelta

    import torch.distributed as dist

    coordination = pytest.importorskip("torchft.coordination", reason="torchft not installed")
    from torchft import Manager, ProcessGroupGloo

    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=10)
    mgr = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda sd: None,
        state_dict=lambda: {}, min_replica_size=1, replica_id="replica_0",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse.address(), timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout,
    )  # fmt: skip
    try:
        yield mgr
    finally:
        mgr.shutdown(wait=False)
        lighthouse.shutdown()


def test_engine_ft_manager_of_wrong_type_raises_type_error() -> None:
    for bad in ("manager", 1, object(), torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=r"ft_manager=.*torchft\.Manager"):
            distamp.DistAMP("fp16", ft_manager=bad)
    distamp.DistAMP("fp16", ft_manager=None)  # still accepted


def test_engine_ft_manager_refuses_what_it_cannot_combine_with(manager: Any) -> None:
    for strategy in ("fsdp", "fsdp2", "hsdp"):
        with pytest.raises(ValueError, match=f"ft_manager with strategy='{strategy}'"):
            distamp.DistAMP("fp16", strategy=strategy, ft_manager=manager)
    with pytest.raises(ValueError, match="ft_manager with comm_hook='fp16'"):
        distamp.DistAMP("fp16", comm_hook="fp16", ft_manager=manager)
    with pytest.raises(ValueError, match="ft_manager with trust_ddp_sync=True"):
        distamp.DistAMP("fp16", trust_ddp_sync=True, ft_manager=manager)
    with pytest.raises(ValueError, match="process_group=ft_manager"):
        distamp.DistAMP("fp16", scaler=distamp.DistributedGradScaler("cpu"), ft_manager=manager)


def test_engine_wraps_in_torchft_ddp_once_and_agrees_through_the_manager(manager: Any) -> None:
    from torchft import DistributedDataParallel, Optimizer

    model = torch.nn.Linear(4, 2)
    amp = distamp.DistAMP("fp16", ft_manager=manager, device="cpu")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, opt = amp.setup(model, Optimizer(manager, inner))
    assert type(wrapped) is DistributedDataParallel and amp.strategy == "ddp"
    assert opt is inner  # the engine votes and starts quorums: torchft's wrapper is unwrapped
    assert amp.scaler.ft_manager is manager


def test_engine_takes_a_model_already_wrapped_with_torchft_ddp(manager: Any) -> None:
    from torchft import DistributedDataParallel

    mine = DistributedDataParallel(manager, torch.nn.Linear(4, 2))
    scaler = distamp.DistributedGradScaler("cpu", process_group=manager)
    amp2 = distamp.DistAMP("fp16", ft_manager=manager, scaler=scaler, device="cpu")
    wrapped2, _ = amp2.setup(mine, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert wrapped2 is mine and amp2.strategy == "none" and amp2.scaler is scaler


def _setup_refusals(rank: int, world_size: int) -> list[str]:
    """One rank of a 2-rank replica group (gloo): what setup() refuses with a Manager."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    # A Manager of its own per rank: setup() refuses before it asks the Manager anything.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=10)
    mgr = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda sd: None,
        state_dict=lambda: {}, min_replica_size=1, replica_id=f"replica_{rank}",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse.address(), timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout,
    )  # fmt: skip
    messages = []
    for model in (torch.nn.Linear(4, 2), DistributedDataParallel(torch.nn.Linear(4, 2))):
        amp = distamp.DistAMP("fp16", device="cpu", ft_manager=mgr)
        try:
            amp.setup(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
        except ValueError as exc:
            messages.append(str(exc))
    mgr.shutdown(wait=False)
    lighthouse.shutdown()
    return messages


def test_engine_ft_manager_refuses_a_bare_or_torch_ddp_model_in_a_group_of_two_ranks() -> None:
    pytest.importorskip("torchft", reason="torchft not installed")
    for messages in run_ranks(_setup_refusals, 2, timeout=120):
        assert len(messages) == 2
        assert "ft_manager with 2 ranks in the replica group" in messages[0]
        assert "ft_manager with a torch DistributedDataParallel model" in messages[1]


class _Replicas:
    """Replica processes sharing one in-process Lighthouse; killed at the end whatever happens."""

    def __init__(self, tmp: Path, min_replicas: int = 1) -> None:
        coordination = pytest.importorskip("torchft.coordination", reason="torchft not installed")
        self.tmp = tmp
        # join_timeout: how long a quorum waits for a live (heartbeating) replica that has not
        # asked to join yet: a restarted replica must find the paused survivor in its quorum.
        self.lighthouse = coordination.LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=10000,
            heartbeat_timeout_ms=2000,
        )
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, replica: int, name: str, *args: str, steps: int = 10, script: Path = SCRIPT
    ) -> Path:
        out = self.tmp / f"{name}.json"
        env = launcher_free_env()
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, str(script), str(replica), self.lighthouse.address(), str(out)]
        err = open(self.tmp / f"{name}.err", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [*cmd, "--steps", str(steps), *args], cwd=ROOT, env=env, text=True,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return out

    def ready(self, name: str) -> str:
        return str(self.tmp / f"{name}.ready")

    def wait(self, proc_index: int, expect_rc: int = 0) -> None:
        proc = self.procs[proc_index]
        try:
            rc = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.close()
            raise TimeoutError(f"replica process {proc_index} hung: {self._errors()}") from None
        assert rc == expect_rc, f"replica process {proc_index} exited {rc}: {self._errors()}"

    def _errors(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted(self.tmp.glob("*.err")))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.lighthouse.shutdown()


@pytest.fixture
def replicas(tmp_path: Path) -> Any:
    group = _Replicas(tmp_path)
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def both_replicas(tmp_path: Path) -> Any:
    """Replicas whose every quorum holds both groups: for tests where nobody dies, so that a
    loaded machine cannot start one group alone and make the other heal at its first step."""
    group = _Replicas(tmp_path, min_replicas=2)
    try:
        yield group
    finally:
        group.close()


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _by_step(log: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Entries of committed steps keyed by the step they committed (a healed replica logs the
    step it read before healing: its committed entries follow the survivor's numbering)."""
    return {e["step"]: e for e in log if e["committed"]}


def test_two_replicas_agree_on_skips_scale_and_parameters(both_replicas: _Replicas) -> None:
    both = [both_replicas.ready("r0"), both_replicas.ready("r1")]
    out0 = both_replicas.start(0, "r0", "--ready", both[0], "--wait-for", *both)
    out1 = both_replicas.start(
        1, "r1", "--ready", both[1], "--wait-for", *both, "--inf-at", "4", "7"
    )
    both_replicas.wait(0)
    both_replicas.wait(1)
    a, b = _load(out0), _load(out1)
    assert [e["skipped"] for e in a["log"]] == [e["skipped"] for e in b["log"]]
    assert [e["step"] for e in a["log"] if e["skipped"]] == [4, 7]  # the inf on replica 1 only
    assert [e["scale"] for e in a["log"]] == [e["scale"] for e in b["log"]]
    assert a["log"][-1]["skipped_steps"] == b["log"][-1]["skipped_steps"] == 2
    assert all(e["committed"] for e in a["log"] + b["log"])
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(torch.tensor(p), torch.tensor(q))  # bitwise


def test_restarted_replica_heals_with_the_survivors_scale(replicas: _Replicas) -> None:
    first = [replicas.ready("r0"), replicas.ready("r1")]
    back = replicas.ready("r1b")
    steps = 16
    out0 = replicas.start(0, "r0", "--ready", first[0], "--wait-for", *first, "--inf-at", "12",
                          "--pause-at", "9", "--pause-until", back, steps=steps)  # fmt: skip
    replicas.start(1, "r1", "--ready", first[1], "--wait-for", *first, "--inf-at", "4",
                   "--exit-at", "7", steps=steps)  # fmt: skip
    replicas.wait(1, expect_rc=3)  # died at step 7
    t0 = time.monotonic()
    out1 = replicas.start(1, "r1b", "--ready", back, steps=steps)
    replicas.wait(0)
    replicas.wait(2)
    restart_to_end = time.monotonic() - t0
    a, b = _load(out0), _load(out1)
    survivor = _by_step(a["log"])
    assert sorted(survivor) == list(range(steps))
    healed = b["log"]
    # The restarted replica never ran steps 0-8: its first iteration healed (weights, optimizer
    # and the scaler's state) from the survivor, then both committed the same steps.
    assert len(healed) < steps - 5
    assert healed[0]["skipped_steps"] == 1  # the survivor's skip at step 4, received by healing
    for e, s in zip(healed, [survivor[k] for k in range(steps - len(healed), steps)], strict=True):
        assert (e["skipped"], e["scale"], e["skipped_steps"]) == (
            s["skipped"],
            s["scale"],
            s["skipped_steps"],
        )
    assert survivor[12]["skipped"] and healed[-1]["skipped_steps"] == 2  # 4 (before) and 12
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(torch.tensor(p), torch.tensor(q))
    assert restart_to_end < TIMEOUT


def test_replica_dying_between_unscale_and_commit_hangs_nobody(replicas: _Replicas) -> None:
    both = [replicas.ready("r0"), replicas.ready("r1")]
    out0 = replicas.start(0, "r0", "--ready", both[0], "--wait-for", *both)
    replicas.start(1, "r1", "--ready", both[1], "--wait-for", *both, "--inf-at", "5",
                   "--exit-at", "5", "--exit-after-unscale")  # fmt: skip
    replicas.wait(1, expect_rc=3)
    replicas.wait(0)  # the survivor finished: no hang
    log = _load(out0)["log"]
    assert sorted(_by_step(log)) == list(range(10))
    previous = None
    for e in log:
        if not e["committed"]:  # the attempt whose peer died: a no-op, scale and counters kept
            assert e["skipped"]
            assert previous is not None
            assert (e["scale"], e["skipped_steps"]) == (
                previous["scale"],
                previous["skipped_steps"],
            )
        previous = e
    # The attempt whose peer died was not committed, then retried; it did not count toward
    # growth (scales: 3 clean committed steps per doubling, growth_interval=3).
    assert [e["step"] for e in log if not e["committed"]] == [5]
    assert [e["scale"] for e in log if e["committed"]][2::3] == [2048.0, 4096.0, 8192.0]
    # The inf lived only on the replica that died before agreeing: nothing was skipped for it.
    assert log[-1]["skipped_steps"] == 0


def test_engine_with_a_manager_agrees_across_replicas(both_replicas: _Replicas) -> None:
    both = [both_replicas.ready("r0"), both_replicas.ready("r1")]
    out0 = both_replicas.start(0, "r0", "--engine", "--ready", both[0], "--wait-for", *both)
    out1 = both_replicas.start(1, "r1", "--engine", "--ready", both[1], "--wait-for", *both,
                          "--inf-at", "4", "7")  # fmt: skip
    both_replicas.wait(0)
    both_replicas.wait(1)
    a, b = _load(out0), _load(out1)
    assert a["wrapper"] == b["wrapper"] == "torchft.ddp.DistributedDataParallel"
    assert [e["skipped"] for e in a["log"]] == [e["skipped"] for e in b["log"]]
    assert [e["step"] for e in a["log"] if e["skipped"]] == [4, 7]  # the inf on replica 1 only
    assert [e["scale"] for e in a["log"]] == [e["scale"] for e in b["log"]]
    assert a["log"][-1]["skipped_steps"] == b["log"][-1]["skipped_steps"] == 2
    assert all(e["committed"] for e in a["log"] + b["log"])
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(torch.tensor(p), torch.tensor(q))  # bitwise


def test_engine_restarted_replica_heals_and_matches_the_survivor(replicas: _Replicas) -> None:
    first = [replicas.ready("r0"), replicas.ready("r1")]
    back = replicas.ready("r1b")
    steps = 14
    out0 = replicas.start(0, "r0", "--engine", "--ready", first[0], "--wait-for", *first,
                          "--inf-at", "11", "--pause-at", "9", "--pause-until", back,
                          steps=steps)  # fmt: skip
    replicas.start(1, "r1", "--engine", "--ready", first[1], "--wait-for", *first,
                   "--inf-at", "4", "--exit-at", "7", steps=steps)  # fmt: skip
    replicas.wait(1, expect_rc=3)  # died at step 7, its quorum already requested
    replicas.start(1, "r1b", "--engine", "--join-first", "--ready", back, steps=steps)
    replicas.wait(0)
    replicas.wait(2)
    a, b = _load(out0), _load(out1 := replicas.tmp / "r1b.json")
    survivor, healed = _by_step(a["log"]), b["log"]
    assert sorted(survivor) == list(range(steps))
    # The restarted replica never ran steps 0-6 (its first quorum is the survivor's step 7, 8 or
    # 9, by how fast it started): its first iteration healed (weights, optimizer and the
    # scaler's state) from the survivor, then both committed the same steps alike.
    assert all(e["committed"] for e in healed) and len(healed) <= steps - 7, out1
    assert healed[0]["skipped_steps"] == 1  # the survivor's skip at step 4, received by healing
    tail = [survivor[k] for k in range(steps - len(healed), steps)]
    for e, s in zip(healed, tail, strict=True):
        assert (e["skipped"], e["scale"], e["skipped_steps"]) == (
            s["skipped"],
            s["scale"],
            s["skipped_steps"],
        )
    assert survivor[11]["skipped"] and healed[-1]["skipped_steps"] == 2  # steps 4 and 11
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(torch.tensor(p), torch.tensor(q))


@pytest.mark.slow
def test_fsdp2_inside_replica_groups_agrees_across_replicas(both_replicas: _Replicas) -> None:
    """2 replica groups x 2 ranks, FSDP2 inside each group (4 processes): an inf in one rank's
    gradient shard of one replica group -> every rank of both groups skips the same steps."""
    ranks = [(g, r) for g in (0, 1) for r in (0, 1)]
    ready = [both_replicas.ready(f"g{g}r{r}") for g, r in ranks]
    ports = [free_port(), free_port()]
    outs = []
    for g, r in ranks:
        inf = ["--inf-at", "3", "6"] if (g, r) == (1, 1) else []
        outs.append(both_replicas.start(g, f"g{g}r{r}", "--rank", str(r), "--port", str(ports[g]),
                                        "--ready", ready[2 * g + r], "--wait-for", *ready, *inf,
                                        steps=8, script=FSDP2_SCRIPT))  # fmt: skip
    for i in range(4):
        both_replicas.wait(i)
    logs = [_load(o) for o in outs]
    first = logs[0]["log"]
    assert [e["step"] for e in first] == list(range(8))
    assert all(e["committed"] for e in first)
    assert [e["step"] for e in first if e["skipped"]] == [3, 6]  # the inf on one rank of g1
    for other in logs[1:]:
        assert [(e["skipped"], e["scale"]) for e in other["log"]] == [
            (e["skipped"], e["scale"]) for e in first
        ]
        assert other["log"][-1]["skipped_steps"] == 2
        assert all(e["committed"] for e in other["log"])
        for p, q in zip(logs[0]["params"], other["params"], strict=True):
            assert torch.equal(torch.tensor(p), torch.tensor(q))  # bitwise, across replicas


@pytest.mark.parametrize("hook", ["fp8", "fp8-ef"])
def test_engine_fp8_across_replicas_skips_together(both_replicas: _Replicas, hook: str) -> None:
    """``comm_hook="fp8"`` across torchft replicas: one element of -inf in replica 1's raw
    gradient during backward (inside its bucket: the cast to fp8 would saturate it) and an inf
    written into its gradient after the exchange make both replicas skip exactly those steps;
    the error-feedback residuals are zero after the first; the replicas end bitwise equal; the
    bytes are counted."""
    both = [both_replicas.ready("r0"), both_replicas.ready("r1")]
    common = ["--engine", "--comm-hook", hook, "--width", "256"]  # chunk padding: a small part
    out0 = both_replicas.start(0, "r0", *common, "--ready", both[0], "--wait-for", *both)
    out1 = both_replicas.start(1, "r1", *common, "--ready", both[1], "--wait-for", *both,
                               "--neg-inf-element-at", "3", "--inf-at", "6")  # fmt: skip
    both_replicas.wait(0)
    both_replicas.wait(1)
    a, b = _load(out0), _load(out1)
    assert a["wrapper"].endswith("Fp8ReplicaDDP"), a["wrapper"]
    for r in (a, b):
        assert [e["step"] for e in r["log"] if e["skipped"]] == [3, 6]
        assert all(e["committed"] for e in r["log"])
    assert [e["scale"] for e in a["log"]] == [e["scale"] for e in b["log"]]
    assert b["residuals_reset"] == ([True] if hook == "fp8-ef" else [])
    for p, q in zip(a["params"], b["params"], strict=True):
        assert torch.equal(torch.tensor(p), torch.tensor(q))  # bitwise
    n = sum(len(p) for p in a["params"])
    fp32 = 2 * (2 - 1) * 4 * n / 2  # torchft's own all-reduce of the fp32 gradients
    assert 0.25 <= (a["grad_bytes"] + a["grad_scale_bytes"]) / fp32 <= 0.3, a["grad_bytes"]


@pytest.mark.slow
def test_engine_fp8_across_replicas_trains_the_main_job(tmp_path: Path) -> None:
    """The main job's GPT, 300 steps on 2 replica groups (each its own shard of the text),
    torchft's own all-reduce against ``comm_hook="fp8-ef"``: the held-out loss within 1%, the
    replicas bitwise equal. (fp8 without error feedback: ``benchmarks/grad_compression.py``.)"""
    losses = {}
    for hook in (None, "fp8-ef"):
        group = _Replicas(tmp_path / str(hook), min_replicas=2)
        (tmp_path / str(hook)).mkdir()
        try:
            both = [group.ready("r0"), group.ready("r1")]
            extra = ["--engine", "--gpt", *(["--comm-hook", hook] if hook else [])]
            outs = [group.start(r, f"r{r}", *extra, "--ready", both[r], "--wait-for", *both,
                                steps=300) for r in (0, 1)]  # fmt: skip
            group.wait(0)
            group.wait(1)
        finally:
            group.close()
        a, b = (_load(o) for o in outs)
        assert a["params"] == b["params"]  # bitwise, across the replicas
        assert a["held_out"] == b["held_out"]
        assert not any(e["skipped"] for e in a["log"]) and all(e["committed"] for e in a["log"])
        losses[hook] = a["held_out"]
    assert abs(losses["fp8-ef"] - losses[None]) / losses[None] < 0.01, losses


def test_the_managers_process_group_is_where_distamp_reads_it(manager: Any) -> None:
    """``comm_hook="fp8"`` across replicas sends shards over the Manager's own process group,
    which torchft offers no accessor for: this torchft must keep it where distamp reads it."""
    from distamp.torch_compat import torchft_manager_group

    group = torchft_manager_group(manager)
    assert group is not None and hasattr(group, "allgather_into_tensor_coalesced")
    assert torchft_manager_group(object()) is None
