"""The torch groups livemig owns (comm/torch_group.py), on real processes and gloo: FSDP2 and
HSDP train on them, and a generation change that swaps every communicator underneath changes
nothing of the training (bit-identical to a run without it). Also the pin issue 32 asks for:
the private torch behaviour the module rests on fails here first on a torch upgrade.

CI budget: ~15 s (a run of 2 processes and one of 4)."""

from __future__ import annotations

import os

import pytest

from tests.helpers.ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "torch_group_worker.py")


def _run(world: int) -> dict[int, dict]:
    return run_ranks(WORKER, world)


@pytest.mark.parametrize("world", [2, 4], ids=["fsdp-2", "hsdp-2x2"])
def test_fsdp2_on_livemig_groups_is_unchanged_by_a_communicator_swap(world):
    got = _run(world)
    assert sorted(got) == list(range(world))
    for r, rec in got.items():
        assert rec["swapped"] == rec["plain"], f"rank {r}: the swap changed the training"
        assert rec["default_is_ours"] and rec["mesh_groups_ours"], rec
        assert rec["before"] == [0] and rec["generations"] == [2], rec  # every group was swapped
    if world == 4:  # (replicate 2, shard 2): rank = 2 * replicate + shard
        for r, rec in got.items():
            rep, sh = divmod(r, 2)
            want = {"replicate": float((sh + 1) + (sh + 3)), "shard": float((2 * rep + 1) + (2 * rep + 2))}
            assert rec["sums"] == want, rec


def test_a_spare_warmed_as_rank_0_on_the_jobs_mesh_trains_as_rank_3_exactly():
    """A spare warms up alone in a standby world of the job's shape as rank 0 (its DTensor
    caches then hold specs on that mesh object), and is claimed as rank 3: with the warm mesh
    rebound, every rank trains bit-identically to a run where nobody warmed up. Without the
    rebind rank 3's cached specs name groups of rank 0 that do not exist in its world."""
    cold = run_ranks(os.path.join(os.path.dirname(__file__), "mesh_warm_worker.py"), 4, "cold")
    warm = run_ranks(os.path.join(os.path.dirname(__file__), "mesh_warm_worker.py"), 4, "warm")
    assert {r: x["digest"] for r, x in warm.items()} == {r: x["digest"] for r, x in cold.items()}
    w3 = warm[3]
    assert w3["rebound"] is True and w3["coordinate"] == [1, 1], w3
    assert w3["groups"] == {"replicate": [1, 3], "shard": [2, 3]}, w3
    print("rank 3's training: cold", round(cold[3]["train_s"], 3), "s, warm", round(warm[3]["train_s"], 3), "s")
