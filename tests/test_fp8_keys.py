"""The float8 weight-scale keys agree across real gloo ranks through a hashed table, also when
keys collide in it (the table then doubles until none does): every rank ends with every key of
the group, in one shared order, whatever each rank held."""

from __future__ import annotations

from typing import Any

from tests._dist import run_ranks


def _agree(rank: int, world: int, held: list[list[int]], size: int | None) -> list[int]:
    import torch

    from distamp.agreement.topology import agreement_group
    from distamp.precision.fp8_parallel import agree_keys

    return agree_keys(held[rank], agreement_group(None), torch.device("cpu"), size=size)


def _check(held: list[list[int]], size: int | None) -> None:
    out: list[Any] = run_ranks(_agree, len(held), held, size, timeout=120)
    assert out[0] == out[1]  # one order on every rank
    assert sorted(out[0]) == sorted({k for keys in held for k in keys})


def test_keys_of_every_rank_agree_in_one_order() -> None:
    _check([[5, 1 << 40, 3], [3, 99]], None)


def test_colliding_keys_double_the_table_until_none_collide() -> None:
    # size 8: 1, 9 and 17 share slot 1 across the ranks; 2 and 10 collide on rank 0 alone;
    # rank 1 holds nothing of rank 0's.
    _check([[1, 2, 10, 1 << 61], [9, 17, (1 << 61) + 8]], 8)
    _check([[4], []], 8)
