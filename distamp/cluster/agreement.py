"""Settings that must be identical on every rank, compared once at setup.

Two ranks built with different settings (fp16 on one, bf16 on the other; another initial scale;
clipping on one rank only) either diverge silently or wait in mismatched collectives until a
timeout that blames the wrong thing. :func:`agree_settings` turns that into an error on every
rank, at setup, naming the field and each rank's value.

Cost: one all-reduce of a fixed-size int64 tensor (1 KiB, whatever the settings and the world
size), once; nothing per step. Each field's text is hashed to 62 bits; the all-reduce takes the
MAX of the hashes and of their negations, so equal hashes on every rank mean max == -max(-h).
Only when a field differs do the ranks gather the texts of the differing fields (the error path:
every rank knows the same fields differ, so every rank joins that gather).

:func:`agree_failures` does the same for an outcome: a step that can fail on one rank alone (a
directory it cannot create, a file it cannot read) ends with one all-reduce of a few ints, so that
every rank learns at once that some rank failed, and why, instead of a peer waiting in its next
collective until the timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from distamp.cluster.collectives import is_distributed

__all__ = ["SettingsMismatchError", "agree_failures", "agree_settings"]

_SLOTS = 64  # fields compared; fixed so that ranks running another distamp still line up


class SettingsMismatchError(ValueError):
    """Settings that must be identical across ranks differ (raised on every rank)."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def agree_settings(
    settings: Mapping[str, Any], *, what: str, group: dist.ProcessGroup | None = None
) -> None:
    """Check that ``settings`` are identical on every rank of ``group``. Collective.

    Args:
        settings: field name -> value; values are compared by their ``repr`` (give plain values:
            numbers, strings, tuples, dtypes), so it must not hold addresses or rank numbers.
        what: who asks, for the message (e.g. ``"DistAMP"``).
        group: the ranks that must agree (``None``: the default group).

    Raises:
        SettingsMismatchError: on every rank, naming each differing field and the value of each
            rank (grouped by value).
    """
    if not is_distributed() or dist.get_world_size(group) == 1:
        return
    texts = {str(k): repr(v) for k, v in settings.items()}
    keys = sorted(texts)
    if len(keys) >= _SLOTS:
        raise AssertionError(f"agree_settings: {len(keys)} fields, at most {_SLOTS - 1}")
    hashes = [_hash(f"{k}={texts[k]}") for k in keys]
    hashes += [0] * (_SLOTS - 1 - len(hashes)) + [_hash("\0".join(keys))]  # the field names
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    packed = torch.tensor(hashes + [-h for h in hashes], dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    high, low = packed[:_SLOTS].tolist(), (-packed[_SLOTS:]).tolist()  # host sync, setup only
    if high == low:
        return
    other_fields = high[-1] != low[-1]  # another distamp version, or a policy on some ranks
    differing = keys if other_fields else [k for i, k in enumerate(keys) if high[i] != low[i]]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, {k: texts[k] for k in differing}, group=group)
    if other_fields:  # every rank must report the same fields: the union of all of them
        differing = sorted({k for theirs in everyone for k in theirs})
    lines = []
    for key in differing:
        by_value: dict[str, list[int]] = {}
        for rank, theirs in enumerate(everyone):
            by_value.setdefault(theirs.get(key, "<absent>"), []).append(rank)
        if len(by_value) > 1:
            shown = "; ".join(f"ranks {_ranks(r)}: {_short(v)}" for v, r in by_value.items())
            lines.append(f"{key}: {shown}")
    raise SettingsMismatchError(
        f"{what}: settings that must be identical on every rank differ (checked at setup, before "
        f"any rank trained): {' | '.join(lines) or ', '.join(differing)}. Build every rank with "
        "the same settings (same command line and config on every rank)."
    )


def agree_failures(
    error: str | None, *, flags: tuple[bool, ...] = (), group: dist.ProcessGroup | None = None
) -> tuple[list[str], tuple[bool, ...]]:
    """Tell every rank of ``group`` which ranks failed and why. Collective.

    Cost: one all-reduce of ``1 + len(flags)`` int64 when no rank failed; the reasons are
    gathered only when one did (every rank then knows to join that gather). One host sync.

    Args:
        error: this rank's reason for failing, or ``None``.
        flags: this rank's answers to yes/no questions the caller asks every rank (e.g. "found
            a checkpoint"); their OR over the ranks is returned.
        group: the ranks that must agree (``None``: the default group).

    Returns:
        The reasons of the failed ranks, each prefixed with its ranks (identical reasons of
        several ranks once), empty when none failed; and each flag ORed over the ranks.
    """
    if not is_distributed() or dist.get_world_size(group) == 1:
        return ([] if error is None else [error]), tuple(bool(f) for f in flags)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    votes = torch.tensor([error is not None, *flags], dtype=torch.int64, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    failed, *ored = (bool(v) for v in votes.tolist())  # the host sync
    if not failed:
        return [], tuple(ored)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, error, group=group)
    by_reason: dict[str, list[int]] = {}
    for rank, reason in enumerate(everyone):
        if reason is not None:
            by_reason.setdefault(str(reason), []).append(rank)
    reasons = [f"rank{'s' * (len(r) > 1)} {_ranks(r)}: {why}" for why, r in by_reason.items()]
    return reasons, tuple(ored)


def _short(text: str) -> str:
    return text if len(text) <= 120 else f"{text[:100]}... ({len(text)} characters)"


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)})" if len(ranks) > 8 else "")
