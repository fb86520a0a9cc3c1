"""A kernel's candidate space: the configs its ``configs_gen_func`` gives for one static key.

A search times these; a config read from a file must be one of them (or null, the launcher default) to be
used, so a stale or hand-edited entry (a missing or unknown key, a value or type the kernel never offers)
is caught once, at load, and never reaches a launch.
"""

from typing import Any, Iterable, List, Optional

from lightllm.common.autotuner.keys import key_to_json


class CandidateSpace:
    def __init__(self, kernel_name: str, configs: Iterable[Any]):
        self.kernel_name = kernel_name
        self.candidates: List[dict] = []
        self._texts = set()
        for config in configs:
            if not isinstance(config, dict):
                raise TypeError(f"autotune kernel {kernel_name!r}: configs_gen_func yielded {config!r}, not dict")
            text = key_to_json(config)
            if text not in self._texts:
                self._texts.add(text)
                self.candidates.append(config)

    def why_not(self, config: Any) -> Optional[str]:
        """None when ``config`` is None or a candidate, else why it is not one (names the keys or values)."""
        if config is None or key_to_json(config) in self._texts:
            return None
        if not isinstance(config, dict):
            return f"expected an object, got {config!r}"
        if not self.candidates:
            return "the kernel offers no candidates"
        known = set().union(*self.candidates)
        required = set.intersection(*(set(c) for c in self.candidates))
        problems = []
        missing, unknown = sorted(required - set(config)), sorted(set(config) - known)
        if missing:
            problems.append(f"missing keys {missing}")
        if unknown:
            problems.append(f"unknown keys {unknown}")
        for key in sorted(set(config) & known):
            offered = {key_to_json(c[key]): c[key] for c in self.candidates if key in c}
            if key_to_json(config[key]) not in offered:
                values = sorted(offered.values(), key=_order)
                problems.append(f"{key}={config[key]!r} is not one of {values}")
        if not problems:
            problems.append(f"not one of the {len(self.candidates)} candidate combinations")
        return ", ".join(problems)


def _order(value: Any) -> tuple:
    number = isinstance(value, (int, float))
    return (0, value, "") if number else (1, 0, key_to_json(value))
