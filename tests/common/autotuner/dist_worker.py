"""One rank of the rank-agreement test (see test_dist.py); writes what it saw as JSON."""

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightllm.common.autotuner import (
    AutotuneKernelType,
    autotune,
    autotune_warmup,
    check_rank_agreement,
    configs_in_use,
    set_bench_func,
    store,
)
from lightllm.common.autotuner import dist as adist
from lightllm.common.autotuner import tuner
from lightllm.common.autotuner.keys import freeze
from lightllm.common.proc import HANG_TIMEOUT_S

DECODE = AutotuneKernelType.DECODE_ATTENTION
CANDIDATES = [{"ms": v} for v in (0.5, 0.3, 0.9, 0.4, 0.6, 0.05)]


def make_kernel(name, kernel_type=DECODE):
    timed = []

    @autotune(name, lambda: CANDIDATES, lambda x: x.shape[1], lambda x: x.shape[0], kernel_type=kernel_type)
    def k(x, run_config=None):
        k.last = run_config
        return x + 1

    k.timed = timed
    return k


def main():
    rank, world, out_path, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ["LIGHTLLM_AUTOTUNE_CONFIG_DIR"] = os.path.join(root, f"rank{rank}")
    os.environ["LIGHTLLM_TRITON_AUTOTUNE_LEVEL"] = "1"
    warnings = []
    logging.getLogger("lightllm").addHandler(_Collect(warnings))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=HANG_TIMEOUT_S),  # ranks start slowly on a busy machine
    )
    current = []

    def bench(run):
        run()
        current[0].timed.append(current[0].last)
        return 1.0 if current[0].last is None else current[0].last["ms"]

    set_bench_func(bench)
    x = torch.ones(8, 4)
    result = {}

    # A kernel outside the active phase never enters a collective: only rank 0 calls it here.
    general = make_kernel("dist_general", AutotuneKernelType.GENERAL)
    with autotune_warmup(DECODE):
        if rank == 0:
            general(x)

        split = make_kernel("dist_split")
        current[:] = [split]
        split(x)
        result["split"] = {"timed": split.timed, "used": split.last}

        # One rank has the key cached, the others not: all of them search.
        one = make_kernel("dist_one_missing")
        if rank == 0:
            store.ConfigStore(one.kernel_name).save(4, freeze(4), {8: ({"ms": 0.9}, {})})
        dist.barrier()
        current[:] = [one]
        one(x)
        result["one_missing"] = {"timed": one.timed, "used": one.last}

        # Every rank has a config, but not the same: all adopt rank 0's without searching.
        adopt = make_kernel("dist_adopt")
        mine = CANDIDATES[1 + rank % (len(CANDIDATES) - 1)]  # rank 0: 0.3; every rank a valid candidate
        store.ConfigStore(adopt.kernel_name).save(4, freeze(4), {8: (mine, {})})
        current[:] = [adopt]
        adopt(x)
        result["adopt"] = {"timed": adopt.timed, "used": adopt.last}
        result["agree_before_differ"] = check_rank_agreement()

        # Keys differ between ranks: each searches the whole list alone, with a warning.
        differ = make_kernel("dist_differ")
        current[:] = [differ]
        differ(torch.ones(8 + rank, 4))
        result["differ"] = {"timed": differ.timed, "used": differ.last}
        result["agree_after_differ"] = check_rank_agreement()
        result["configs_in_use"] = configs_in_use()

        # Clocks on either side of the budget when the first pass ends: rank 0's real clock within it, the others'
        # past it from their first look (they time no candidate). All must follow rank 0 and re-time, whose gather
        # would otherwise meet the next kernel's agreement gather.
        os.environ["LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH"] = "3600"  # no busy machine's first pass takes that
        if rank > 0:
            ticks = iter(range(0, 10**12, 10**6))  # past the budget at the first look
            tuner.search_clock = lambda: float(next(ticks))
        straddle = make_kernel("dist_budget_straddle")
        current[:] = [straddle]
        straddle(x)
        tuner.search_clock = time.perf_counter
        after = make_kernel("dist_after_straddle")
        current[:] = [after]
        after(x)
        result["straddle"] = {"timed": straddle.timed, "used": straddle.last, "after": after.last}

        # Two plans of one GENERAL kernel run in turn (small_m_linear's, one per weight, every layer), ranks' caches
        # alike for the first key and not for the second: the ranks that take rank 0's config for the second must
        # not resolve the first plan again, alone, with a gather the others never enter.
        with autotune_warmup(AutotuneKernelType.GENERAL):
            plans = make_kernel("dist_two_plans", AutotuneKernelType.GENERAL)
            store.ConfigStore(plans.kernel_name).save(4, freeze(4), {8: ({"ms": 0.3}, {})})
            store.ConfigStore(plans.kernel_name).save(6, freeze(6), {8: (mine, {})})
            gathers, gather = [], adist.all_gather_object
            adist.all_gather_object = lambda obj: (gathers.append(obj), gather(obj))[1]
            used = run_plans(plans, [x, torch.ones(8, 6)])
            result["two_plans"] = {"gathers": len(gathers), "used": used, "timed": plans.timed}
            # The same with one static key and two run keys (add_norm's token rows and final_add_norm's output rows).
            rows = make_kernel("dist_two_run_keys", AutotuneKernelType.GENERAL)
            store.ConfigStore(rows.kernel_name).save(4, freeze(4), {8: ({"ms": 0.3}, {}), 2: (mine, {})})
            gathers.clear()
            used = run_plans(rows, [x, torch.ones(2, 4)])
            result["two_run_keys"] = {"gathers": len(gathers), "used": used, "timed": rows.timed}
            # Rank 0's config for run key 8, taken by the others, can't launch on run key 2's rows, where they warm
            # it first: they alone drop it, also for the decided key 8, which they then run without a new gather.
            dropped = make_kernel("dist_drop_one_rank", AutotuneKernelType.GENERAL)
            fn = dropped.fn

            def refusing(x, run_config=None):
                if run_config == {"ms": 0.3} and x.shape[0] == 2:
                    raise RuntimeError("out of resources")
                return fn(x, run_config=run_config)

            dropped.fn = refusing
            store.ConfigStore(dropped.kernel_name).save(4, freeze(4), {8: (mine, {}), 2: ({"ms": 0.9}, {})})
            gathers.clear()
            for _layer in range(2):
                dropped(x)
                dropped(torch.ones(2, 4))
            adist.all_gather_object = gather
            result["drop_one_rank"] = {"gathers": len(gathers), "timed": dropped.timed}

    dist.barrier()  # every rank has written its files
    files = {}
    for r in range(world):
        files[r] = [str(p.relative_to(root)) for p in store.iter_config_files(os.path.join(root, f"rank{r}"))]
    result["files"] = files
    result["warnings"] = warnings
    dist.barrier()
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


def run_plans(kernel, inputs, layers=3):
    """One plan per input, run in turn by each of ``layers`` layers as a forward runs them; the configs launched."""
    plans, used = [kernel.plan() for _ in inputs], []
    for _layer in range(layers):
        for plan, x in zip(plans, inputs):
            plan.run(x)
            used.append(kernel.last)
    return used


class _Collect(logging.Handler):
    def __init__(self, sink):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record):
        self.sink.append(record.getMessage())


if __name__ == "__main__":
    main()
