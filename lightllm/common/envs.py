"""Every ``LIGHTLLM_*`` environment variable, parsed and validated in one place.

Getters read the environment on each call (cheap, and tests can change it); ``validate_all`` parses every
variable once so that start-up stops with one line naming the bad one.
"""

import functools
import os
import re
from pathlib import Path
from typing import Optional

AUTOTUNE_LEVEL = "LIGHTLLM_TRITON_AUTOTUNE_LEVEL"
AUTOTUNE_CONFIG_DIR = "LIGHTLLM_AUTOTUNE_CONFIG_DIR"
AUTOTUNE_MAX_SECONDS_PER_SEARCH = "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH"
DECODE_ATTN_AUTOTUNE_SEQ_LEN = "LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN"
AUTOTUNE_CHOICE_RULE = "LIGHTLLM_AUTOTUNE_CHOICE_RULE"
AUTOTUNE_CHOICE_RULES = ("minimax_loss", "tuning_len", "never_slower_than_default")  # see autotuner/choice.py
AUTOTUNE_IGNORE_SHIPPED = "LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED"
AUTOTUNE_COMPILE_THREADS = "LIGHTLLM_AUTOTUNE_COMPILE_THREADS"
TINY_MODEL_DIR = "LIGHTLLM_TINY_MODEL_DIR"
# Every variable above; tests clear them all so the caller's environment cannot change a result.
ALL = (
    AUTOTUNE_LEVEL,
    AUTOTUNE_CONFIG_DIR,
    AUTOTUNE_MAX_SECONDS_PER_SEARCH,
    DECODE_ATTN_AUTOTUNE_SEQ_LEN,
    AUTOTUNE_CHOICE_RULE,
    AUTOTUNE_IGNORE_SHIPPED,
    AUTOTUNE_COMPILE_THREADS,
    TINY_MODEL_DIR,
)

_AUTOTUNE_LEVELS = {0: "use cached configs", 1: "adaptive", 2: "force", 3: "off"}


_PLAIN_INT = re.compile(r"-?[0-9]+")


def _parse_int(name: str, default: int, raw: Optional[str] = None, allowed: str = "an integer") -> int:
    raw = os.environ.get(name) if raw is None else raw
    if raw is None or raw.strip() == "":
        return default
    if not _PLAIN_INT.fullmatch(raw.strip()):  # int() would also take "1_6", "+5" and non-ASCII digits
        raise ValueError(f"{name}={raw!r} is not an integer; use {allowed}")
    return int(raw.strip())


def get_triton_autotune_level() -> int:
    """0 use cached configs only (default), 1 adaptive, 2 force re-tune, 3 off (launcher defaults)."""
    return _autotune_level(os.environ.get(AUTOTUNE_LEVEL))


@functools.lru_cache(maxsize=16)
def _autotune_level(raw: Optional[str]) -> int:
    """Parsed once per distinct value: every tuned kernel call reads the level."""
    allowed = ", ".join(f"{k} ({v})" for k, v in _AUTOTUNE_LEVELS.items())
    if raw is not None and raw.strip() not in ("", *map(str, _AUTOTUNE_LEVELS)):  # not int(): "1.0", "٢", " +1"
        raise ValueError(f"{AUTOTUNE_LEVEL}={raw!r} is not allowed; use one of {allowed}")
    return _parse_int(AUTOTUNE_LEVEL, 0, raw)


def get_decode_attn_autotune_seq_len() -> int:
    """KV length of the representative batch that decode-attention kernels tune on (default 32768)."""
    seq_len = _parse_int(DECODE_ATTN_AUTOTUNE_SEQ_LEN, 32768, allowed="a positive integer (a KV length in tokens)")
    if seq_len <= 0:
        raise ValueError(
            f"{DECODE_ATTN_AUTOTUNE_SEQ_LEN}={os.environ[DECODE_ATTN_AUTOTUNE_SEQ_LEN]!r} must be a positive integer"
        )
    return seq_len


def get_autotune_max_seconds_per_search() -> float:
    """Wall-clock budget of one search; when spent the search ends with the best config so far."""
    raw = os.environ.get(AUTOTUNE_MAX_SECONDS_PER_SEARCH)
    if raw is None or raw.strip() == "":
        return 30.0
    try:
        if "_" in raw or not raw.isascii():  # float() would take "1_0" and non-ASCII digits
            raise ValueError(raw)
        seconds = float(raw)
    except ValueError:
        raise ValueError(
            f"{AUTOTUNE_MAX_SECONDS_PER_SEARCH}={raw!r} is not a number; use a positive, finite number of seconds"
        ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{AUTOTUNE_MAX_SECONDS_PER_SEARCH}={raw!r} must be a positive, finite number of seconds")
    return seconds


def get_autotune_choice_rule(default: str = "minimax_loss") -> str:
    """How a search timed on several inputs picks its winner, for every kernel when set; else ``default`` (the
    kernel's declared rule). One of ``AUTOTUNE_CHOICE_RULES``."""
    raw = os.environ.get(AUTOTUNE_CHOICE_RULE)
    if raw is None or raw.strip() == "":
        return default
    rule = raw.strip()
    if rule not in AUTOTUNE_CHOICE_RULES:
        raise ValueError(
            f"{AUTOTUNE_CHOICE_RULE}={raw!r} is not allowed; use one of {', '.join(AUTOTUNE_CHOICE_RULES)}"
        )
    return rule


def get_autotune_ignore_shipped() -> frozenset:
    """Tuned kernels whose in-package configs are not read, by name (comma-separated; ``all``: every kernel). At
    level 1 their keys then search as on a GPU with nothing shipped: how shipped configs are re-tuned after a kernel
    changes (``python -m lightllm.tools.tune_shipped --retune``)."""
    return _ignore_shipped(os.environ.get(AUTOTUNE_IGNORE_SHIPPED))


@functools.lru_cache(maxsize=16)
def _ignore_shipped(raw: Optional[str]) -> frozenset:
    names = frozenset(n.strip() for n in (raw or "").split(",") if n.strip())
    if any(not re.fullmatch(r"[a-z0-9_]+", n) for n in names) or ("all" in names and len(names) > 1):
        raise ValueError(
            f"{AUTOTUNE_IGNORE_SHIPPED}={raw!r} is not allowed; use tuned kernel names (lower case, digits and _) "
            "separated by commas, or all"
        )
    return names


def _check_ignored_kernels_ship_configs() -> None:
    """At start-up: a name that ships no configs ignores nothing, so it is a typo (the kernel meant keeps its shipped
    configs and a level-1 re-tune searches nothing)."""
    names = get_autotune_ignore_shipped() - {"all"}
    if not names:
        return
    from lightllm.common.autotuner import store  # it imports this module

    known = {path.name for path in store.iter_kernel_dirs(store.SHIPPED_ROOT)}
    if names - known:
        raise ValueError(
            f"{AUTOTUNE_IGNORE_SHIPPED}={os.environ.get(AUTOTUNE_IGNORE_SHIPPED)!r} is not allowed: "
            f"no configs ship for {', '.join(sorted(names - known))}; use all or kernels that have some "
            f"({', '.join(sorted(known)) or 'none ship here'})"
        )


def get_autotune_compile_threads() -> Optional[int]:
    """Threads that compile a search's candidates (and the cached configs a start-up warms) before any runs
    (autotuner/precompile.py); 1 compiles each as it first launches. None when unset: the tuner then shares the
    CPUs this process may use among the tensor-parallel ranks, at most 8 a rank (``precompile.default_threads``)."""
    raw = os.environ.get(AUTOTUNE_COMPILE_THREADS)
    allowed = "a positive integer (1: compile each config as it first launches)"
    count = _parse_int(AUTOTUNE_COMPILE_THREADS, 0, raw, allowed)
    if raw is not None and raw.strip() and count < 1:
        raise ValueError(f"{AUTOTUNE_COMPILE_THREADS}={raw!r} is not allowed; use {allowed}")
    return count or None


def get_autotune_config_dir() -> Path:
    """Writable root of tuned configs (default ``~/.cache/lightllm/autotune``)."""
    return _folder(AUTOTUNE_CONFIG_DIR, "~/.cache/lightllm/autotune")


def get_tiny_model_dir() -> Path:
    """Where the built-in tiny model is generated on first use (default ``~/.cache/lightllm/tiny-qwen3-d64``)."""
    return _folder(TINY_MODEL_DIR, "~/.cache/lightllm/tiny-qwen3-d64")


def _folder(name: str, default: str) -> Path:
    """The folder a path variable names, ``~`` expanded; ``ValueError`` when it cannot be a folder (a file, under
    a file, an unknown user's home)."""
    raw = os.environ.get(name)
    text = default if raw is None or raw.strip() == "" else raw.strip()  # " /data/x" is /data/x, not a folder " "
    shown = f"{name}={raw!r}" if raw is not None and raw.strip() else f"{name} (unset: {default})"
    try:
        path = Path(text).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{shown} exists and is not a directory")
        above = next(p for p in path.parents if p.exists())  # "." or "/" at the latest
    except (OSError, RuntimeError) as e:  # "~nouser/x": no such user; a parent that cannot be read
        raise ValueError(f"{shown} must be a folder that can be created and written: {e}") from None
    if not above.is_dir():
        raise ValueError(f"{shown} must be a folder that can be created and written: {above} is a file")
    return path


def validate_all() -> None:
    """Parse every variable; raises ``ValueError`` naming the first bad one."""
    get_triton_autotune_level()
    get_decode_attn_autotune_seq_len()
    get_autotune_max_seconds_per_search()
    get_autotune_choice_rule()
    _check_ignored_kernels_ship_configs()
    get_autotune_compile_threads()
    get_autotune_config_dir()
    get_tiny_model_dir()
