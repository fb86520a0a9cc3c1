import json
import os
import sys

import pytest

from lightllm.common import proc
from lightllm.common.net import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
CANDIDATES_MS = [0.5, 0.3, 0.9, 0.4, 0.6, 0.05]  # dist_worker's candidates, in order
ALL = set(CANDIDATES_MS)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_agree_on_configs(tmp_path, world):
    # no search may run out of budget on a busy machine
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "PORT": str(free_port()),
        "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH": "1e9",
    }
    worker = os.path.join(HERE, "dist_worker.py")
    cmds = [
        [sys.executable, worker, str(r), str(world), str(tmp_path / f"{r}.json"), str(tmp_path)] for r in range(world)
    ]
    for code, out in proc.run_all(cmds, env=env):  # a rank that fails stops the others at once
        assert code == 0, out
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]

    # Split search: disjoint slices covering every candidate (dealt round-robin), one agreed winner, found on
    # the slice of the rank that timed it (candidate 5: rank 5 % world), so the winner crossed ranks.
    # Then every rank re-timed the three leading candidates, the highest index first, and the default last.
    assert all(r["split"]["timed"][-4:] == [{"ms": 0.05}, {"ms": 0.4}, {"ms": 0.3}, None] for r in res)
    first_pass = [r["split"]["timed"][:-4] for r in res]
    slices = [{c["ms"] for c in timed if c} for timed in first_pass]
    assert set().union(*slices) == ALL and sum(len(s) for s in slices) == len(ALL)
    assert all(timed[0] is None for timed in first_pass)  # each rank measured the default first
    assert [r["split"]["used"] for r in res] == [{"ms": 0.05}] * world
    assert 0.05 in slices[5 % world] and [len(s) for s in slices] == [len(range(r, 6, world)) for r in range(world)]

    # Any rank missing the key makes every rank search.
    assert all(len(r["one_missing"]["timed"]) > 1 for r in res)
    assert [r["one_missing"]["used"] for r in res] == [{"ms": 0.05}] * world

    # All cached, configs differ: everyone takes rank 0's, nobody searches.
    assert [r["adopt"]["used"] for r in res] == [{"ms": 0.3}] * world
    assert all(r["adopt"]["timed"] == [] for r in res)

    # The start-up check: identical configs everywhere until the keys differed, then rank 0 names the keys.
    assert [r["agree_before_differ"] for r in res] == [True] * world
    assert [r["agree_after_differ"] for r in res] == [False] * world
    assert any(f"ranks hold different configs for {world} keys" in w and "dist_differ" in w for w in res[0]["warnings"])
    assert all(k.split()[0] in ("dist_split", "dist_one_missing", "dist_adopt", "dist_differ")
               for r in res for k in r["configs_in_use"])  # fmt: skip

    # Different keys: each rank tunes the full list, with a warning.
    assert all({c["ms"] for c in r["differ"]["timed"] if c} == ALL for r in res)
    assert all(any("ranks disagree on keys" in w for w in r["warnings"]) for r in res)

    # Rank 0 within the budget, the others' clocks past it: all re-timed rank 0's finalists (its slice alone was
    # timed: candidates 0, world, 2 world, ...), adopted one winner, and the next kernel's agreement still paired up.
    slice0 = [CANDIDATES_MS[i] for i in range(0, len(CANDIDATES_MS), world)]
    finalists = [{"ms": ms} for ms in sorted(slice0)[:3]]
    retimed = sorted(finalists, key=lambda c: CANDIDATES_MS.index(c["ms"]), reverse=True) + [None]
    assert all(r["straddle"]["timed"][-len(retimed) :] == retimed for r in res)
    assert all(len(r["straddle"]["timed"]) == len(retimed) + 1 for r in res[1:])  # the default, then the re-timing
    assert [r["straddle"]["used"] for r in res] == [{"ms": min(slice0)}] * world
    assert [r["straddle"]["after"] for r in res] == [{"ms": 0.05}] * world

    # Two plans of one kernel, the second key's configs differ: one agreement gather per plan on every rank, rank
    # 0's config for the second everywhere, nothing searched.
    assert [r["two_plans"]["gathers"] for r in res] == [2] * world
    assert [r["two_plans"]["used"] for r in res] == [[{"ms": 0.3}] * 6] * world
    assert all(r["two_plans"]["timed"] == [] for r in res)
    assert [r["two_run_keys"]["gathers"] for r in res] == [2] * world  # one static key, its second run key differing
    assert [r["two_run_keys"]["used"] for r in res] == [[{"ms": 0.3}] * 6] * world
    assert [r["drop_one_rank"]["gathers"] for r in res] == [2] * world  # no rank gathers alone after its drop
    assert all(r["drop_one_rank"]["timed"] == [] for r in res)

    # Only rank 0 wrote agreed configs; ranks whose keys differed wrote their own.
    files = res[0]["files"]
    assert any("dist_split" in f for f in files["0"]) and any("dist_one_missing" in f for f in files["0"])
    for r in range(1, world):
        assert not any("dist_split" in f or "dist_one_missing" in f for f in files[str(r)])
        assert any("dist_differ" in f for f in files[str(r)])
    assert not any("dist_general" in f for r in range(world) for f in files[str(r)])
