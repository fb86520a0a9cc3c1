"""Greedy generation through ``Engine`` over a ``--tp 2`` runner (rank 0 here, rank 1 a spawned worker), run as a
subprocess by ``test_mtp_tensor_parallel.py`` so a failing rank can't take pytest down with it.

``python -m tests.engine.mtp_tp_probe SPEC``: SPEC is JSON ``{"runs": [{"args": EngineArgs kwargs, "sampling":
SamplingParams kwargs (optional; request ``i`` seeded ``seed + i``)}, ...], "prompts": [[ids]], "max_new_tokens":
n}``; the last stdout line is JSON, per run ``{"tokens": {i: ids}, "drafts": d, "accepted": a, "proposed": [[[draft
tokens] per request] per step], "cached": prompt tokens read from the prefix cache}``.
"""

import json
import sys
from typing import Optional

from lightllm.engine.args import EngineArgs
from lightllm.engine.engine import Engine
from lightllm.engine.sampler import SamplingParams
from lightllm.server.tp import start_tp
from tests.engine.test_mtp_engine import SpecCounts
from tests.engine.test_scheduler import run_all


class DraftLog:
    """Passes a runner's MTP steps through (``engine.runner.MTPSteps``), keeping every step's draft tokens."""

    def __init__(self, mtp):
        self._mtp, self.proposed = mtp, []

    @property
    def step(self) -> int:
        return self._mtp.step

    def draft(self, slots, last_tokens, choose):
        drafts = self._mtp.draft(slots, last_tokens, choose)
        self.proposed.append(drafts.tolist())  # [B, N] on the device
        return drafts

    def verify(self, slots, last_tokens, drafts):
        return self._mtp.verify(slots, last_tokens, drafts)

    def accept(self, slots, accepted):
        return self._mtp.accept(slots, accepted)


def generate(runner, spec: dict, sampling: Optional[dict] = None) -> dict:
    """``spec["prompts"]`` through an engine over ``runner`` (its ``mtp`` steps logged, when it has them): greedy,
    or with ``sampling`` (SamplingParams kwargs, request ``i`` seeded ``seed + i``)."""
    sampling = dict(sampling or {})
    seed = sampling.pop("seed", None)
    params = {i: SamplingParams(max_new_tokens=spec["max_new_tokens"], ignore_eos=True, **sampling,
                                seed=None if seed is None else seed + i)
              for i in range(len(spec["prompts"]))}  # fmt: skip
    counts, log, cached = SpecCounts(), None, []
    add_request = runner.add_request

    def admit(prefix=()):  # what each admission read from the prefix cache
        cached.append(len(prefix))
        return add_request(prefix)

    runner.add_request = admit
    engine = Engine(runner, eos_ids=[], observer=counts)
    if engine.spec is not None:
        log = engine.spec.mtp = DraftLog(engine.spec.mtp)
    tokens, _ = run_all(engine, spec["prompts"], params=params)
    return {"tokens": tokens, "drafts": counts.drafts, "accepted": counts.accepted,
            "proposed": log.proposed if log else [], "cached": sum(cached)}  # fmt: skip


def main(spec: dict) -> list:
    results = []
    for run in spec["runs"]:
        runner = start_tp(EngineArgs(**run["args"]), 2)
        try:
            results.append(generate(runner, spec, run.get("sampling")))
        finally:
            runner.stop()
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
