"""Persistent configs: ``<root>/triton_<version>/<gpu name>/<kernel_name>/<static key>.json``.

Two roots are read: configs shipped inside the package and the writable root
(``LIGHTLLM_AUTOTUNE_CONFIG_DIR``); the writable root wins for a run key both have. Writes go to the
writable root only, merged under a file lock with whatever another process wrote, then renamed into
place so readers never see a half-written file. Temp files are made only under that lock, so one found
there was left by a writer that died (killed with -9, say): the next writer of that file removes it.
A file that cannot be read or has the wrong schema gives one warning and counts as a miss; a malformed entry
is left out with one warning, the file's other entries kept.
"""

import datetime
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from filelock import FileLock, Timeout

from lightllm.common import envs
from lightllm.common.autotuner.keys import key_from_json, key_to_json

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SHIPPED_ROOT = Path(__file__).resolve().parent / "configs"
LOCK_TIMEOUT_S = 60.0
_MAX_NAME_LEN = 160
_warned_paths = set()

Config = Optional[Dict[str, Any]]  # None means "the launcher's own default"


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,+-]+", "_", text).strip("_") or "_"


# A kernel name is one folder name: no separators or glob characters, and never ".", ".." or a hidden name.
_KERNEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=,+-]*")


def check_kernel_name(kernel_name: Any) -> str:
    """``kernel_name`` if it is a valid kernel folder name, else ValueError naming it and what is allowed."""
    if not isinstance(kernel_name, str) or not _KERNEL_NAME.fullmatch(kernel_name) or len(kernel_name) > _MAX_NAME_LEN:
        raise ValueError(
            f"autotune kernel_name {kernel_name!r} is not allowed; use 1 to {_MAX_NAME_LEN} letters, digits and "
            "'_.=,+-', starting with a letter, digit or '_'"
        )
    return kernel_name


@lru_cache(maxsize=None)
def triton_dir_name() -> str:
    try:
        import triton

        return f"triton_{triton.__version__}"
    except ImportError:
        return "triton_none"


@lru_cache(maxsize=None)
def device_dir_name() -> str:
    import torch

    if torch.cuda.is_available():
        return _safe_name(torch.cuda.get_device_name())
    return "cpu"


def static_key_file_name(frozen_static_key: Any) -> str:
    """``k=v,k=v.json`` for dict keys (readable in ``ls``), hashed when too long for a file name."""
    if isinstance(frozen_static_key, tuple) and all(
        isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in frozen_static_key
    ):
        text = ",".join(f"{k}={key_to_json(v).strip(chr(34))}" for k, v in frozen_static_key)
    else:
        text = key_to_json(frozen_static_key)
    name = _safe_name(text)
    if len(name) > _MAX_NAME_LEN:
        digest = hashlib.sha1(key_to_json(frozen_static_key).encode()).hexdigest()[:16]
        name = f"{name[:_MAX_NAME_LEN - 17]}-{digest}"
    return name + ".json"


def _warn_once(path: Path, why: str) -> None:
    if path not in _warned_paths:
        _warned_paths.add(path)
        logger.warning("autotune config %s ignored (%s); treating it as a cache miss", path, why)


def _valid_config(cfg: Any) -> bool:
    if cfg is None:
        return True
    return isinstance(cfg, dict) and all(
        isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str))) for k, v in cfg.items()
    )


def read_config_file(path: Path, strict: bool = False) -> Optional[dict]:
    """The parsed file, or None (with one warning) when it is unreadable, corrupt or of the wrong schema. An entry
    whose run key or config is malformed is left out, with one warning per file that names it: the others are kept,
    and the next save of the file writes them back without it. ``strict``: such a file is None too (a file that is
    not a cache, which a write must not shorten)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8, an int of > 4300 digits
        _warn_once(path, f"{type(e).__name__}: {e}")
        return None
    if not isinstance(data, dict) or data.get("version") != SCHEMA_VERSION:
        _warn_once(path, f"expected a JSON object with version {SCHEMA_VERSION}")
        return None
    configs = data.get("configs")
    if not isinstance(configs, dict):
        _warn_once(path, "'configs' must be an object mapping run keys to configs")
        return None
    bad = {}
    for rk, cfg in configs.items():
        if not _valid_config(cfg):
            bad[rk] = "not an object of JSON scalars or null"
            continue
        try:
            key = key_from_json(rk)
        except (ValueError, TypeError, RecursionError) as e:
            bad[rk] = f"bad run key: {e}"
            continue
        if not _finite_numbers(key):  # nearest-key distances are floats: 1e400 as an int would overflow them
            bad[rk] = "bad run key: a number that is not a finite float"
    if bad:
        named = "; ".join(f"{_shorten(rk)}: {_shorten(why)}" for rk, why in list(bad.items())[:3])
        named += f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        if strict:
            _warn_once(path, f"{len(bad)} malformed entries: {named}")
            return None
        if path not in _warned_paths:
            _warned_paths.add(path)
            logger.warning("autotune config %s: %d of its %d entries ignored (%s); their run keys are cache misses",
                           path, len(bad), len(configs), named)  # fmt: skip
        data["configs"] = {rk: cfg for rk, cfg in configs.items() if rk not in bad}
    if not isinstance(data.get("timings"), dict):
        data["timings"] = {}  # optional: hand-written and shipped files may carry configs alone
    return data


def _finite_numbers(key: Any) -> bool:
    """Whether every number in a frozen run key is a finite float, or an int that converts to one."""
    if isinstance(key, tuple):
        return all(_finite_numbers(part) for part in key)
    return isinstance(key, bool) or not isinstance(key, (int, float)) or _finite_float(key) is not None


def _finite_float(value: Any) -> Optional[float]:
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        return None
    return number if math.isfinite(number) else None


def _shorten(text: str, limit: int = 80) -> str:
    """A run key or reason as a warning quotes it: a 5000-digit key must not flood the log."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def without_run_keys(data: dict, run_keys: Set[Any]) -> Tuple[dict, dict]:
    """A config file's configs and timings less the entries of ``run_keys`` (frozen), however the file spells them
    ("4.0" is run key 4): what a merge keeps before it writes those keys anew, so the new entries win."""
    configs = {rk: c for rk, c in data.get("configs", {}).items() if key_from_json(rk) not in run_keys}
    timings = {rk: t for rk, t in data.get("timings", {}).items() if rk in configs}
    return configs, timings


class ConfigStore:
    """Reads and writes the config files of one kernel."""

    def __init__(self, kernel_name: str):
        self.kernel_name = check_kernel_name(kernel_name)

    def kernel_dir(self, root: Path) -> Path:
        return Path(root) / triton_dir_name() / device_dir_name() / self.kernel_name

    def path(self, root: Path, frozen_static_key: Any) -> Path:
        return self.kernel_dir(root) / static_key_file_name(frozen_static_key)

    def load(self, frozen_static_key: Any) -> Dict[Any, Config]:
        """Run key (frozen) -> config, shipped configs overlaid by the writable root's."""
        return {run_key: config for run_key, (config, _) in self.load_entries(frozen_static_key).items()}

    def load_entries(self, frozen_static_key: Any) -> Dict[Any, Tuple[Config, Path]]:
        """As :meth:`load`, with the file each config comes from."""
        entries: Dict[Any, Tuple[Config, Path]] = {}
        for layer in self.load_layers(frozen_static_key):
            entries.update(layer)
        return entries

    def load_layers(self, frozen_static_key: Any) -> List[Dict[Any, Tuple[Config, Path]]]:
        """Run key (frozen) -> (config, file) of each root, the shipped configs first (none where
        ``LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED`` names this kernel), then the writable root's."""
        layers = []
        ignored = envs.get_autotune_ignore_shipped()
        for root in (SHIPPED_ROOT, envs.get_autotune_config_dir()):
            if root is SHIPPED_ROOT and ({"all", self.kernel_name} & ignored):
                layers.append({})
                continue
            path = self.path(root, frozen_static_key)
            data = read_config_file(path)
            configs = {} if data is None else data["configs"]
            layers.append({key_from_json(rk): (cfg, path) for rk, cfg in configs.items()})
        return layers

    def cut_counts(self, frozen_static_key: Any) -> Dict[Any, int]:
        """Run key (frozen) -> searches in a row the budget cut short, from the writable root's file."""
        data = read_config_file(self.path(envs.get_autotune_config_dir(), frozen_static_key))
        return {} if data is None else {key_from_json(rk): n for rk, n in read_cut_counts(data).items()}

    def save(self, static_key: Any, frozen_static_key: Any, entries: Dict[Any, Tuple[Config, dict]]) -> Optional[Path]:
        """Merge ``{run_key: (config, timing)}`` into the writable root's file; None if it could not be written."""
        path = self.path(envs.get_autotune_config_dir(), frozen_static_key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
                configs, timings = without_run_keys(read_config_file(path) or {}, set(entries))
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                for run_key, (config, timing) in entries.items():
                    rk = key_to_json(run_key)
                    configs[rk] = config
                    timings[rk] = {**timing, "tuned_at": now}
                payload = {
                    "version": SCHEMA_VERSION,
                    "kernel": self.kernel_name,
                    "static_key": static_key,
                    "configs": dict(sorted(configs.items())),
                    "timings": dict(sorted(timings.items())),
                }
                remove_stale_temp_files(path)
                atomic_write_json(path, payload)
            _sweep_stale_temp_files(path)
        except (OSError, Timeout, TypeError, ValueError) as e:
            logger.warning("autotune: could not write %s (%s); the config is used for this run only", path, e)
            return None
        return path


def _temp_file_pattern(path: Path) -> "re.Pattern":
    # mkstemp's random part has no dots, so the temp files of another config file never match
    return re.compile(rf"\.{re.escape(path.name)}\.[A-Za-z0-9_]+\.tmp")


def remove_stale_temp_files(path: Path) -> None:
    """Call with ``path``'s lock held: its writers make temp files only under that lock, so any left is stale."""
    pattern = _temp_file_pattern(path)
    for entry in os.scandir(path.parent):
        if pattern.fullmatch(entry.name):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass


_TEMP_FILE = re.compile(r"\.(?P<name>.+\.json)\.[A-Za-z0-9_]+\.tmp")


def _sweep_stale_temp_files(written: Path) -> None:
    """The other config files' stale temp files in ``written``'s folder (a writer killed while writing a static
    key that is never written again). Each file's lock is only tried: a held lock means its writer is alive."""
    for entry in os.scandir(written.parent):
        match = _TEMP_FILE.fullmatch(entry.name)
        if match is None or match["name"] == written.name:
            continue
        path = written.parent / match["name"]
        try:
            with FileLock(str(path) + ".lock", timeout=0):
                remove_stale_temp_files(path)
        except (Timeout, OSError):
            continue


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (else set and put back at once; the
    moment between narrows what another thread creates, never widens it)."""
    try:
        with open("/proc/self/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def atomic_write_json(path: Path, payload: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # mkstemp makes the file 0600: give it the mode open(path, "w") would, so that the other users of a
            # shared config root can read it (and their writes merge its entries, not replace a file they can't read)
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            json.dump(payload, f, indent=1, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _timing_ms(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    ms = _finite_float(value)
    return ms if ms is not None and ms > 0 else None


def read_timings(data: dict) -> Dict[str, Dict[str, float]]:
    """Per run key of ``data`` (from :func:`read_config_file`), the times a reader may use: ``best_ms`` and
    ``default_ms`` where they are finite positive numbers; anything else in a hand-edited file is dropped."""
    out = {}
    for run_key in data["configs"]:
        timing = data["timings"].get(run_key)
        if isinstance(timing, dict):
            times = {name: _timing_ms(timing.get(name)) for name in ("best_ms", "default_ms")}
            out[run_key] = {name: ms for name, ms in times.items() if ms is not None}
        else:
            out[run_key] = {}
    return out


def read_cut_counts(data: dict) -> Dict[str, int]:
    """Per run key of ``data`` whose search the time budget cut short: how many searches in a row were cut
    (``"cut": n`` in its timing; a hand-edited value that is not a positive int is no cut)."""
    out = {}
    for run_key in data["configs"]:
        timing = data["timings"].get(run_key)
        cut = timing.get("cut") if isinstance(timing, dict) else None
        if type(cut) is int and cut > 0:
            out[run_key] = cut
    return out


def iter_kernel_dirs(root: Path, kernel_name: Optional[str] = None) -> Iterator[Path]:
    """Every kernel folder ``<root>/triton_*/<gpu>/<kernel>`` (of one kernel, if named), as the store finds them."""
    name = "*" if kernel_name is None else check_kernel_name(kernel_name)
    root = Path(root)
    if not root.is_dir():
        return
    for path in sorted(root.glob(f"triton_*/*/{name}")):
        if path.is_dir() and _KERNEL_NAME.fullmatch(path.name):  # a folder the store could have written
            yield path


def config_files(kernel_dir: Path) -> List[Path]:
    """The config files of one kernel folder: its regular ``*.json`` files."""
    return [path for path in sorted(Path(kernel_dir).glob("*.json")) if path.is_file()]


def iter_config_files(root: Path, kernel_name: Optional[str] = None) -> Iterator[Path]:
    """Every config file under ``root`` (all Triton versions and GPUs), optionally of one kernel."""
    for kernel_dir in iter_kernel_dirs(root, kernel_name):
        yield from config_files(kernel_dir)
