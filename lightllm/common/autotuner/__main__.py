"""``python -m lightllm.common.autotuner list | show KERNEL | clear KERNEL | export DIR [--kernel KERNEL]``."""

import argparse
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import List, Optional, Tuple

from filelock import FileLock, Timeout

from lightllm.common import envs
from lightllm.common.autotuner import store
from lightllm.common.autotuner.keys import key_from_json


def _roots() -> List[Tuple[str, Path]]:
    return [("shipped", store.SHIPPED_ROOT), ("user", envs.get_autotune_config_dir())]


def _timing_text(timing: dict) -> str:
    """What the file's (sanitized) times say; a ratio only when both times are there."""
    best, default = timing.get("best_ms"), timing.get("default_ms")
    if best is None:
        return ""
    if default is None:
        return f"  {best:.4f} ms"
    return f"  {best:.4f} ms, {default / best:.2f}x over default"


def cmd_list(_args) -> int:
    rows = defaultdict(lambda: [0, 0])
    for label, root in _roots():
        for path in store.iter_config_files(root):
            triton_dir, gpu, kernel = path.relative_to(root).parts[:3]
            data = store.read_config_file(path)
            row = rows[(kernel, label, triton_dir, gpu)]
            row[0] += 1
            row[1] += len(data["configs"]) if data else 0
    if not rows:
        existing = [str(root) for _, root in _roots() if root.is_dir()]
        if existing:
            print("no autotune configs under " + ", ".join(existing))
        else:
            user_root = envs.get_autotune_config_dir()
            print(f"no autotune configs: no config folder exists yet (the first search writes under {user_root})")
        return 0
    print(f"{'kernel':40} {'root':8} {'triton':14} {'gpu':24} {'files':>5} {'run keys':>8}")
    for (kernel, label, triton_dir, gpu), (files, keys) in sorted(rows.items()):
        print(f"{kernel:40} {label:8} {triton_dir:14} {gpu:24} {files:5d} {keys:8d}")
    return 0


def cmd_show(args) -> int:
    found = False
    for label, root in _roots():
        for path in store.iter_config_files(root, args.kernel):
            found = True
            print(f"{path}  [{label}]")
            data = store.read_config_file(path)
            if data is None:
                print("  unreadable (see warning above)")
                continue
            print(f"  static key: {data.get('static_key')}")
            timings, cut = store.read_timings(data), store.read_cut_counts(data)
            for rk, cfg in data["configs"].items():
                cut_text = f"  (search cut short by the time budget: {cut[rk]} in a row)" if rk in cut else ""
                print(f"  run key {rk}: {'default' if cfg is None else cfg}{_timing_text(timings[rk])}{cut_text}")
    if not found:
        print(f"no configs for kernel {args.kernel!r}")
        return 1
    return 0


def cmd_clear(args) -> int:
    root = envs.get_autotune_config_dir()
    shipped = store.SHIPPED_ROOT.resolve()
    if root.resolve() == shipped or shipped in root.resolve().parents:
        why = "is the shipped configs folder or inside it; clear never touches shipped configs"
        print(f"error: {envs.AUTOTUNE_CONFIG_DIR}={str(root)!r} {why}", file=sys.stderr)
        return 2
    removed = 0
    real_root = root.resolve()
    for kernel_dir in store.iter_kernel_dirs(root, args.kernel):
        real = kernel_dir.resolve()
        # a link (the kernel folder's or a triton_*/GPU folder's above it) would delete files outside the root
        if kernel_dir.is_symlink() or real_root not in real.parents or real == shipped or shipped in real.parents:
            print(f"skipped {kernel_dir}: reached through a link, not a folder of the config root; remove it yourself")
            continue
        files = len(store.config_files(kernel_dir))
        try:
            shutil.rmtree(kernel_dir)
        except OSError as e:
            print(f"error: could not remove {kernel_dir}: {e}", file=sys.stderr)
            return 1
        removed += 1
        print(f"removed {kernel_dir} ({files} config files)")
    if not removed:
        print(f"nothing to clear for kernel {args.kernel!r} under {root} (shipped configs are never touched)")
    shipped_dirs = list(store.iter_kernel_dirs(store.SHIPPED_ROOT, args.kernel))
    if shipped_dirs:  # their keys stay cached: a level-1 start would search nothing
        files = sum(len(store.config_files(d)) for d in shipped_dirs)
        plural = "s" * (files != 1)
        print(f"{args.kernel} also has {files} shipped config file{plural}, still read; to search their keys again, "
              f"start at level 1 with {envs.AUTOTUNE_IGNORE_SHIPPED}={args.kernel}")  # fmt: skip
    return 0


def _merged(dest: Path, src: dict) -> Optional[dict]:
    """``src``'s payload over the file at ``dest`` (its other run keys kept; src's win, whatever their spelling:
    "4.0" and 4 are one key); None when ``dest`` exists and cannot be read whole (it is not to be overwritten: a
    shipped folder's file is not a cache, and a malformed entry there is for a person to fix, not to drop)."""
    old = store.read_config_file(dest, strict=True)
    if old is None:
        if dest.exists():
            return None
        old = {"configs": {}, "timings": {}}
    configs, timings = store.without_run_keys(old, {key_from_json(rk) for rk in src["configs"]})
    out = {k: v for k, v in src.items() if k not in ("configs", "timings")}
    out["configs"] = dict(sorted({**configs, **src["configs"]}.items()))
    out["timings"] = dict(sorted({**timings, **src["timings"]}.items()))
    return out


def _merge_into(dest: Path, src: dict) -> bool:
    """Merge ``src`` into the file at ``dest`` (``_merged``) under the lock the store's writers take, so that two
    exports into one folder, or an export into a folder that is a server's config root, merge rather than drop each
    other's keys (and no writer takes this one's temp file for a stale one). False when ``dest`` cannot be read."""
    with FileLock(str(dest) + ".lock", timeout=store.LOCK_TIMEOUT_S):
        payload = _merged(dest, src)
        if payload is None:
            return False
        store.remove_stale_temp_files(dest)
        store.atomic_write_json(dest, payload)
    return True


def _export_dir_problem(text: str) -> Optional[str]:
    """Why ``export`` cannot write into the folder ``text``, or None: an empty name (an unset shell variable) is not
    the current folder, and a file, or a path under one, is no folder."""
    if not text.strip():
        return "is empty"
    path = Path(text)
    if path.exists() and not path.is_dir():
        return "is a file"
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        return f"is under a file ({above})"
    return None


def cmd_export(args) -> int:
    """Copy the writable root's configs into ``DIR`` in the shipped layout, merged with files already there."""
    root, dest_root = envs.get_autotune_config_dir(), Path(args.dir)
    problem = _export_dir_problem(args.dir)
    if problem is not None:
        print(f"error: export DIR {args.dir!r} {problem}; expected a folder to create or export into", file=sys.stderr)
        return 2
    if dest_root.resolve() == root.resolve():
        print(f"error: export DIR {str(dest_root)!r} is the writable root itself ({envs.AUTOTUNE_CONFIG_DIR})",
              file=sys.stderr)  # fmt: skip
        return 2
    files = keys = refused = 0
    for path in store.iter_config_files(root, args.kernel):
        data = store.read_config_file(path)
        if data is None:
            print(f"skipped {path}: unreadable (see warning above)")
            continue
        dest = dest_root / path.relative_to(root)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            written = _merge_into(dest, data)
        except Timeout:
            print(f"error: {dest} stayed locked for {store.LOCK_TIMEOUT_S:g} s (another export, or a server whose "
                  "config root this is, writing it); not exported into: export again", file=sys.stderr)  # fmt: skip
            refused += 1
            continue
        except OSError as e:
            print(f"error: could not write {dest}: {e}", file=sys.stderr)
            return 1
        if not written:
            print(f"error: {dest} exists and cannot be read (see warning above); left as it is, not exported into: "
                  "fix or remove it, then export again", file=sys.stderr)  # fmt: skip
            refused += 1
            continue
        files, keys = files + 1, keys + len(data["configs"])
    if not files and not refused:
        print(f"nothing to export: no configs{'' if args.kernel is None else f' of kernel {args.kernel!r}'} under "
              f"{root}")  # fmt: skip
        return 1
    print(f"exported {files} config files ({keys} run keys) from {root} to {dest_root}")
    return 1 if refused else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightllm.common.autotuner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="kernels with configs, per root, Triton version and GPU").set_defaults(func=cmd_list)
    show = sub.add_parser("show", help="every config of one kernel")
    show.add_argument("kernel")
    show.set_defaults(func=cmd_show)
    clear = sub.add_parser("clear", help="delete one kernel's configs from the writable root, so it re-tunes")
    clear.add_argument("kernel")
    clear.set_defaults(func=cmd_clear)
    export = sub.add_parser("export", help="copy the writable root's configs into DIR in the shipped layout (e.g. "
                            "lightllm/common/autotuner/configs to ship them)")  # fmt: skip
    export.add_argument("dir")
    export.add_argument("--kernel", default=None, help="only this kernel's configs")
    export.set_defaults(func=cmd_export)
    args = parser.parse_args(argv)
    try:
        envs.get_autotune_config_dir()
        if getattr(args, "kernel", None) is not None:
            store.check_kernel_name(args.kernel)  # one folder name: no ".", "..", separators or globs
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
