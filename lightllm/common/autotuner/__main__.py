"""``python -m lightllm.common.autotuner list | show KERNEL | clear KERNEL``."""

import argparse
import shutil
import sys
from collections import defaultdict
from pathlib import Path
from typing import List, Optional, Tuple

from lightllm.common import envs
from lightllm.common.autotuner import store


def _roots() -> List[Tuple[str, Path]]:
    return [("shipped", store.SHIPPED_ROOT), ("user", envs.get_autotune_config_dir())]


def _where(root: Path, path: Path) -> Tuple[str, str, str]:
    triton_dir, gpu, kernel = path.relative_to(root).parts[:3]
    return triton_dir, gpu, kernel


def cmd_list(_args) -> int:
    rows = defaultdict(lambda: [0, 0])
    for label, root in _roots():
        for path in store.iter_config_files(root):
            data = store.read_config_file(path)
            row = rows[(_where(root, path)[2], label, *_where(root, path)[:2])]
            row[0] += 1
            row[1] += len(data["configs"]) if data else 0
    if not rows:
        print("no autotune configs under " + ", ".join(str(r) for _, r in _roots()))
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
            for rk, cfg in data["configs"].items():
                t = data["timings"].get(rk, {})
                extra = ""
                if t.get("best_ms") and t.get("default_ms"):
                    extra = f"  {t['best_ms']:.4f} ms, {t['default_ms'] / t['best_ms']:.2f}x over default"
                print(f"  run key {rk}: {'default' if cfg is None else cfg}{extra}")
    if not found:
        print(f"no configs for kernel {args.kernel!r}")
        return 1
    return 0


def cmd_clear(args) -> int:
    root = envs.get_autotune_config_dir()
    removed = 0
    for kernel_dir in sorted(root.glob(f"triton_*/*/{args.kernel}")) if root.is_dir() else []:
        if kernel_dir.is_dir():
            files = len(list(kernel_dir.glob("*.json")))
            shutil.rmtree(kernel_dir)
            removed += 1
            print(f"removed {kernel_dir} ({files} config files)")
    if not removed:
        print(f"nothing to clear for kernel {args.kernel!r} under {root} (shipped configs are never touched)")
    return 0


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
    args = parser.parse_args(argv)
    try:
        envs.get_autotune_config_dir()
        if hasattr(args, "kernel"):
            store.ConfigStore(args.kernel)  # validates the name: no globs or paths
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
