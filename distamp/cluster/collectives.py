"""Collectives that say which step was waiting when a peer rank stops answering."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "is_distributed", "named_collective"]


def is_distributed() -> bool:
    """True when a default process group is initialized (and torch was built with distributed).

    The one test for "are collectives due": ``torch.distributed.is_initialized`` does not exist
    in a torch built without distributed support, so ``is_available`` is asked first. No sync.
    """
    return dist.is_available() and dist.is_initialized()


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer rank stopped participating (hung, crashed, slow)."""


# What the backends say when a peer does not take part: gloo "Timed out waiting 5000ms for recv
# operation", NCCL's watchdog "collective operation timeout", and a peer that died mid-collective.
_PEER_GONE = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset|broken pipe", re.IGNORECASE
)


@contextmanager
def named_collective(what: str, timeout: float) -> Iterator[None]:
    """Turn a backend's timeout inside the body into a :class:`CollectiveTimeoutError` naming
    ``what`` and ``timeout``.

    The backends' own messages name a transport operation ("recv", a sequence number), not the
    training step that was waiting, so "which collective, after how long, and what to do" is
    added here. Other errors pass through unchanged.

    Args:
        what: the collective in the words of the caller (e.g. "save_state: checkpoint barrier").
        timeout: the process group's timeout in seconds, for the message.
    """
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip()
        if isinstance(exc, CollectiveTimeoutError) or not _PEER_GONE.search(text):
            raise
        rank = dist.get_rank() if is_distributed() else 0
        cause = text.splitlines()[0] if text else type(exc).__name__
        raise CollectiveTimeoutError(
            f"{what} did not complete on rank {rank} within the {timeout:g} s timeout: another "
            "rank stopped participating (hung, crashed or far slower); its log names the cause. "
            "Raise the timeout (DistAMP(timeout=...), init_distributed(timeout=...)) only if "
            f"that rank is merely slow (cause: {cause})"
        ) from exc
