"""Tuning phases and the nestable warmup scope that activates one of them."""

import enum
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator, List, Optional

from lightllm.common import envs

logger = logging.getLogger(__name__)


class AutotuneLevel(enum.IntEnum):
    """``LIGHTLLM_TRITON_AUTOTUNE_LEVEL``."""

    USE_CACHED = 0  # cached configs only (default)
    ADAPTIVE = 1  # search run keys missing from the cache
    FORCE = 2  # search every run key once per process, cached or not
    OFF = 3  # launcher default always


class AutotuneKernelType(enum.Enum):
    """Which warmup phase a kernel may search in."""

    GENERAL = "general"  # prefill and other kernels, tuned by dummy prefill forwards
    DECODE_ATTENTION = "decode_attention"  # tuned before each decode CUDA graph capture


@dataclass
class AutotuneStats:
    """Process-wide counters; a warmup scope reports the difference between its entry and exit."""

    searches: int = 0
    configs_written: int = 0
    candidates_timed: int = 0
    candidates_rejected: int = 0
    candidates_retimed: int = 0  # the default and the finalists, timed again after every candidate
    search_seconds: float = 0.0
    kernels_compiled_ahead: int = 0  # compile requests of the passes before searches and cached-config warm-ups
    compile_ahead_seconds: float = 0.0  # those passes' wall time (within search_seconds for a search's)

    def copy(self) -> "AutotuneStats":
        return AutotuneStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: "AutotuneStats") -> "AutotuneStats":
        return AutotuneStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


STATS = AutotuneStats()

# Start-up runs warmup on the model thread only, so one process-wide stack is enough.
_phase_stack: List[AutotuneKernelType] = []


class _ScopeClock:
    """Ticks on every scope entry and exit, so a plan made in another scope knows it is stale."""

    __slots__ = ("ticks",)

    def __init__(self):
        self.ticks = 0


SCOPE_CLOCK = _ScopeClock()


def current_warmup_kernel_type() -> Optional[AutotuneKernelType]:
    """The innermost active phase, or None outside any warmup scope."""
    return _phase_stack[-1] if _phase_stack else None


def is_searching_level(level: int) -> bool:
    return level in (AutotuneLevel.ADAPTIVE, AutotuneLevel.FORCE)


def is_tuning(kernel_type: AutotuneKernelType) -> bool:
    """True while ``kernel_type``'s warmup scope is the active one at level 1 (adaptive) or 2 (force): its
    kernels search now, so they may key and time on the inputs they rebuild rather than the caller's."""
    return current_warmup_kernel_type() is kernel_type and is_searching_level(envs.get_triton_autotune_level())


def is_autotune_warmup() -> bool:
    return bool(_phase_stack)


def get_autotune_stats() -> AutotuneStats:
    """A copy of the process-wide counters (the engine prints them in its start-up summary)."""
    return STATS.copy()


@contextmanager
def autotune_warmup(kernel_type: AutotuneKernelType = AutotuneKernelType.GENERAL) -> Iterator[None]:
    """Make ``kernel_type`` the active phase; the outer phase comes back on exit, also on exception."""
    if not isinstance(kernel_type, AutotuneKernelType):
        raise TypeError(f"autotune_warmup expects an AutotuneKernelType, got {kernel_type!r}")
    depth = len(_phase_stack)
    _phase_stack.append(kernel_type)
    SCOPE_CLOCK.ticks += 1
    before = STATS.copy()
    start = time.perf_counter()
    try:
        yield
    finally:
        del _phase_stack[depth:]
        SCOPE_CLOCK.ticks += 1
        done = STATS - before
        level = logging.INFO if done.searches else logging.DEBUG
        logger.log(
            level,
            "autotune warmup [%s] done in %.2fs: %d searches (%d candidates timed, %d re-timed, %d rejected), "
            "%d configs written, %.2fs searching; %d kernels compiled ahead in %.2fs",
            kernel_type.name,
            time.perf_counter() - start,
            done.searches,
            done.candidates_timed,
            done.candidates_retimed,
            done.candidates_rejected,
            done.configs_written,
            done.search_seconds,
            done.kernels_compiled_ahead,
            done.compile_ahead_seconds,
        )
