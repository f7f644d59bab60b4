"""``DistAMP.fit`` (distamp/engine/loop.py): every argument is checked before the first step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_scenarios import square_loss as _loss
from engine_scenarios import tiny_engine as _engine


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"log_interval": 0}, r"fit\(log_interval=0\).*>= 1"),
        ({"steps": -1}, r"fit\(steps=-1\)"),
        ({"steps": 2.5}, r"fit\(steps=2.5\)"),
        ({"tokens_per_batch": "many"}, r"fit\(tokens_per_batch='many'\)"),
        ({"checkpoint_interval": -2}, r"fit\(checkpoint_interval=-2\)"),
        ({"on_log": "print"}, r"fit\(on_log='print'\): expected a function or None"),
        ({"checkpoint_dir": 3}, r"fit\(checkpoint_dir=3\)"),
    ],
)
def test_fit_checks_every_argument_before_the_first_step(bad: dict[str, Any], match: str) -> None:
    amp, _ = _engine()
    kwargs: dict[str, Any] = {"steps": 2, **bad}
    with pytest.raises(ValueError, match=match):  # ArgumentTypeError is a ValueError too
        amp.fit(lambda k: torch.ones(3, 4), _loss, **kwargs)
    assert amp.step_count == 0
