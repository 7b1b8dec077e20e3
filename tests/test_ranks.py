"""The harness's shared runs ([Note: shared runs] in tests/support/ranks.py): a run made again is
read back, each caller gets a copy of its own, and a different run is run."""

import os

import torch

from support.ranks import run_ranks


def a_draw(rank: int, world_size: int, label: str) -> dict:
    """What no two runs return alike: a fresh random tensor (ranks restore their generators
    after each run, so it is seeded from os.urandom)."""
    generator = torch.Generator().manual_seed(
        int.from_bytes(os.urandom(8), "little") & (2**63 - 1))
    return {"rank": rank, "label": label, "env": os.environ.get("ZERO_FX_TEST_LABEL"),
            "draw": torch.rand(4, generator=generator)}


def test_a_shared_run_made_again_is_read_back_as_a_copy_of_its_own():
    first = run_ranks(2, a_draw, "once", shared=True)
    again = run_ranks(2, a_draw, "once", shared=True)
    assert [r["rank"] for r in again] == [0, 1]
    assert all(torch.equal(a["draw"], b["draw"]) for a, b in zip(first, again))
    again[0]["draw"].zero_()  # a test may change what it got
    third = run_ranks(2, a_draw, "once", shared=True)
    assert torch.equal(third[0]["draw"], first[0]["draw"]) and third[0]["draw"].any()


def test_other_arguments_another_environment_or_no_sharing_run_again(monkeypatch):
    first = run_ranks(2, a_draw, "twice", shared=True)
    other_arguments = run_ranks(2, a_draw, "other", shared=True)
    not_shared = run_ranks(2, a_draw, "twice")
    monkeypatch.setenv("ZERO_FX_TEST_LABEL", "changed")
    other_environment = run_ranks(2, a_draw, "twice", shared=True)
    assert other_environment[0]["env"] == "changed"
    for run in (other_arguments, not_shared, other_environment):
        assert not torch.equal(run[0]["draw"], first[0]["draw"])
