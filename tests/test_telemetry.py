"""Per-module telemetry (distamp.observe.telemetry): every rank keeps its own numbers next to the
agreed ones, the writers get scalars and histograms, and bad settings are refused. The run is
tests/telemetry_scenarios.py's (the ``telemetry_run`` fixture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from telemetry_scenarios import HOT, INTERVAL, STEPS

import distamp
from distamp.observe.telemetry import Telemetry, TelemetryRecord, read_telemetry
from distamp.observe.writers import WandbWriter

Run = tuple[Path, list[dict[str, Any]]]


def test_every_rank_keeps_its_own_numbers_next_to_the_agreed_ones(
    telemetry_run: Run,
) -> None:
    out, results = telemetry_run
    records = read_telemetry(out)
    assert sorted(records) == [0, 1]
    steps = [r.step for r in records[0]]
    assert steps == list(range(INTERVAL, STEPS + 1, INTERVAL)) == [r.step for r in records[1]]
    assert results[0]["records"] == results[1]["records"] == len(steps)
    hot = HOT
    first0, first1 = records[0][0], records[1][0]
    # The agreed numbers are the same on both ranks; the ranks' own are not.
    assert first0.headroom == first1.headroom
    assert first0.underflow == first1.underflow
    assert first1.local_headroom[hot] == float("inf")  # rank 1's data overflows in fp16
    assert first0.local_headroom[hot] < 1.0  # rank 0's never does
    assert first0.headroom[hot] == float("inf")  # agreed: the ranks' maximum
    assert (first0.rank, first1.rank, first0.world_size) == (0, 1, 2)


def test_skips_blame_the_module_and_the_promotion_is_an_event(
    telemetry_run: Run,
) -> None:
    out, results = telemetry_run
    records = read_telemetry(out)[0]
    skips = [s for r in records for s in r.skips]
    assert len(skips) == results[0]["skipped"] == results[1]["skipped"] > 0
    blamed = [m for _, m in skips if m is not None]
    assert HOT in blamed
    counted = {m: sum(r.nonfinite.get(m, 0) for r in records) for m in set(blamed)}
    assert counted == {m: blamed.count(m) for m in set(blamed)}
    changes = [c for r in records for c in r.changes]
    assert [(c["module"], c["before"], c["after"]) for c in changes] == [(HOT, "fp16", "fp32")]
    promoted_at = changes[0]["step"]
    assert all(s <= promoted_at for s, _ in skips)  # promoted: no skip after it
    assert all(r.loss_scale > 0 for r in records)


def test_writers_get_scalars_and_histograms(telemetry_run: Run) -> None:
    out, results = telemetry_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert f"amp/telemetry/headroom/{HOT}" in tags["scalars"]
    assert {"amp/telemetry/headroom", "amp/telemetry/underflow"} <= set(tags["histograms"])
    steps = [e.step for e in events.Histograms("amp/telemetry/underflow")]
    assert steps == list(range(INTERVAL, STEPS + 1, INTERVAL))
    # W&B, offline: the run is on disk, ready for `wandb sync`.
    wandb_run = Path(results[0]["wandb"])
    assert wandb_run.name.startswith("offline-run-"), wandb_run
    assert list(wandb_run.glob("*.wandb")), sorted(p.name for p in wandb_run.iterdir())


def test_a_record_reads_back_as_written() -> None:
    record = TelemetryRecord(
        step=8,
        rank=1,
        world_size=2,
        loss_scale=1024.0,
        headroom={"a": float("inf"), "b": 0.25},
        underflow={"a.weight": 0.5},
        skips=((7, "a"), (8, None)),
        nonfinite={"a": 1},
        changes=({"step": 8, "module": "a", "before": "fp16", "after": "fp32", "reason": "x"},),
    )
    line = json.dumps(record.as_dict())
    assert "Infinity" not in line  # strict JSON
    assert TelemetryRecord.from_dict(json.loads(line)) == record
    assert record.as_metrics()["telemetry/headroom/b"] == 0.25
    assert record.histograms()["telemetry/headroom"] == [0.25]  # finite values only


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval": 0}, r"Telemetry\(interval=0\)"),
        ({"interval": 2.5}, r"Telemetry\(interval=2.5\)"),
        ({"interval": True}, r"Telemetry\(interval=True\)"),
        ({"writers": [object()]}, r"object has no write"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        Telemetry(tmp_path, **kwargs)


def test_the_engine_refuses_telemetry_it_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"telemetry=.*must be a distamp\.Telemetry"):
        distamp.DistAMP("fp16", telemetry=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="telemetry with precision='fp32'"):
        distamp.DistAMP("fp32", telemetry=Telemetry(tmp_path))
    with pytest.raises(ValueError, match="mode='cloud'"):
        WandbWriter(tmp_path, mode="cloud")  # type: ignore[arg-type]
