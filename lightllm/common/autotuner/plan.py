"""A tuned launch planned once and run many times (FlashInfer's plan/run split)."""

from typing import Any, Tuple

from lightllm.common.autotuner.phase import SCOPE_CLOCK


class Plan:
    """The config :meth:`Autotuner.plan` resolved for one static key and run key; :meth:`run` launches with it.

    Planned without arguments (a kernel's plan made from shapes, before any layer runs), it settles on the
    arguments of its first ``run``, which may search there exactly as a plain call would.

    Made once per step and run by every layer, whose arguments share the plan's keys: ``run`` keys nothing
    again, it costs three comparisons and the launcher call. A plan goes stale when its static key's configs change
    (a search, a dropped config, ``clear_all_caches()``) or a warmup scope is entered or left; its next ``run``
    then resolves again on that run's arguments, exactly as a plain call would. The first ``run`` of a config
    not yet launched in this process is that config's first launch (a config that raises is dropped there).
    """

    __slots__ = ("tuner", "config", "state", "run_key", "searching", "level", "confirmed", "generation", "scope_ticks")

    def __init__(self, tuner: Any):
        self.tuner = tuner
        self.config = None
        self.state = None
        self.run_key = None
        self.searching = False
        self.level = 0
        self.confirmed = False  # the config has launched for run_key in this process
        self.generation = -1
        self.scope_ticks = -1

    def settled(self) -> bool:
        """Whether the next ``run`` launches ``config`` as it is: resolved, launched, and nothing changed since."""
        return self.confirmed and self.generation == self.state.generation and self.scope_ticks == SCOPE_CLOCK.ticks

    def run(self, *args, **kwargs):
        if self.settled():
            return self.tuner.fn(*args, run_config=self.config, **kwargs)
        return self.tuner._run_unsettled(self, args, kwargs)

    __call__ = run

    def __repr__(self) -> str:
        return f"Plan({self.tuner.kernel_name!r}, run_key={self.run_key!r}, config={self.config!r})"


class FixedPlan:
    """A plan of an explicit ``run_config``: every run launches with it; nothing is keyed, resolved or searched."""

    __slots__ = ("tuner", "config")

    def __init__(self, tuner: Any, config: dict):
        self.tuner, self.config = tuner, config

    def settled(self) -> bool:
        return True

    def run(self, *args, **kwargs):
        return self.tuner.fn(*args, run_config=self.config, **kwargs)

    __call__ = run

    def __repr__(self) -> str:
        return f"FixedPlan({self.tuner.kernel_name!r}, config={self.config!r})"


class PlannedInputs:
    """What a kernel plan was made for, per input: a tuple such as ``(shape, dtype)``. A layer whose inputs
    differ is refused with a ValueError naming the planned and the given values (one comparison when they match).
    """

    __slots__ = ("kernel", "names", "planned")

    def __init__(self, kernel: str, **planned: Tuple):
        self.kernel, self.names, self.planned = kernel, tuple(planned), tuple(planned.values())

    def check(self, *given: Tuple) -> None:
        if given != self.planned:
            wrong = [
                f"{name} expected the planned {_show(want)}, got {_show(got)}"
                for name, want, got in zip(self.names, self.planned, given)
                if got != want
            ]
            raise ValueError(f"{self.kernel} plan: " + "; ".join(wrong))


def _show(values: Tuple) -> str:
    return " ".join(str(tuple(v)) if isinstance(v, tuple) else str(v) for v in values)
