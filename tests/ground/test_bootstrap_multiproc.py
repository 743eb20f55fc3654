"""Bootstrap under torchrun (gloo, CPU): Megatron-Core's groups match hand-computed memberships.

Megatron orders ranks tp-cp-ep-dp-pp: TP neighbours are adjacent ranks, PP stages are world/pp apart.
One launch (module fixture `records`): the world-4 layouts, then ranks 0 and 1 in a fresh world of 2.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mp.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = Path(__file__).parents[1] / "mp" / "bootstrap_groups.py"


def _member(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


# layout -> (dp size, {group name: all groups of that kind}), written out by hand
EXPECTED = {
    "tp2": (1, {"tp": [[0, 1]], "pp": [[0], [1]], "dp": [[0], [1]], "mp": [[0, 1]]}),
    "pp2": (1, {"tp": [[0], [1]], "pp": [[0, 1]], "dp": [[0], [1]], "mp": [[0, 1]]}),
    "ep2": (2, {"tp": [[0], [1]], "dp": [[0, 1]], "ep": [[0, 1]], "expt_dp": [[0], [1]]}),
    "dp2": (2, {"tp": [[0], [1]], "pp": [[0], [1]], "dp": [[0, 1]], "ep": [[0], [1]], "expt_dp": [[0, 1]]}),
    "tp2pp2": (1, {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]],
                   "mp": [[0, 1, 2, 3]]}),
    "tp2dp2": (2, {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                   "mp": [[0, 1], [2, 3]]}),
    "ep2dp2": (4, {"tp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]], "ep": [[0, 1], [2, 3]],
                   "expt_dp": [[0, 2], [1, 3]]}),
    "pp2vpp2": (2, {"pp": [[0, 2], [1, 3]], "dp": [[0, 1], [2, 3]], "tp": [[0], [1], [2], [3]]}),
    "ep4": (4, {"ep": [[0, 1, 2, 3]], "expt_dp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]]}),
}


def _check(records: list[dict], world: int) -> set[str]:
    seen = set()
    for rec in records:
        dp, groups = EXPECTED[rec["layout"]]
        assert rec["dp_size"] == dp, rec
        for name, all_groups in groups.items():
            assert rec["groups"][name] == _member(all_groups, rec["rank"]), (rec["layout"], name, rec)
        assert rec["groups"]["cp"] == [rec["rank"]]
        seen.add(rec["layout"])
    ranks = {(r["layout"], r["rank"]) for r in records}
    assert len(ranks) == len(records) == len(seen) * world
    return seen


@pytest.fixture(scope="module")
def records() -> dict[int, list[dict]]:
    """world size -> its records."""
    got = torchrun(SCRIPT, 4, ["--then", "2"])
    return {w: [r for r in got if r["world"] == w] for w in (2, 4)}


def test_groups_world_2(records):
    records = records[2]
    assert _check(records, 2) == {"tp2", "pp2", "ep2", "dp2"}


def test_groups_world_4(records):
    records = records[4]
    assert _check(records, 4) == {"tp2pp2", "tp2dp2", "ep2dp2", "pp2vpp2", "ep4"}
    coords = {r["rank"]: r["coords"] for r in records if r["layout"] == "tp2pp2"}
    assert [(coords[r]["tp"], coords[r]["pp"]) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
