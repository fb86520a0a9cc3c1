"""Server start-up time: from launching ``python -m lightllm.server.api_server`` to its first healthy ``/health``.

Starts the server ``--starts`` times per ``--tp`` (the built-in tiny model unless ``--model``), each stopped before
the next, and prints the seconds of each start and their median; writes JSON. ``--compare`` serves another checkout
too (its ``lightllm`` on ``PYTHONPATH``), in turns with this one, so two trees are compared on one machine under the
same load:

    python benchmarks/server_start.py --compare /tmp/old_checkout --out benchmarks/results/server_start_cpu.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_seconds(repo: str, args: list, home: str) -> float:
    """Seconds from launch to the first 200 of ``/health``; the server is stopped (with its children) after."""
    from lightllm.common import proc
    from lightllm.common.net import free_port, wait_healthy

    port = free_port()
    # ``repo`` first; what PYTHONPATH held stays after it (a machine whose dependencies are installed there)
    path = os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {**os.environ, "PYTHONPATH": path, "LIGHTLLM_TINY_MODEL_DIR": os.path.join(home, "tiny"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": os.path.join(home, "autotune"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    t = time.perf_counter()
    server = proc.start([sys.executable, "-m", "lightllm.server.api_server", "--port", str(port), *args], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=home)  # fmt: skip
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", proc.HANG_TIMEOUT_S, hint="run it by hand to see why")
        return time.perf_counter() - t
    finally:
        proc.stop(server)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=3, help="starts per tensor-parallel size")
    p.add_argument("--warm-starts", type=int, default=1, help="starts before, not counted (build the tiny model, fill "
                   "the file cache)")  # fmt: skip
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", help="a model folder (default: the built-in tiny model)")
    p.add_argument("--compare", help="another checkout to start in turns with this one")
    p.add_argument("--out", default="benchmarks/results/server_start.json")
    args = p.parse_args(argv)
    if args.starts < 1 or args.warm_starts < 0 or any(tp < 1 for tp in args.tp):
        p.error(f"--starts and --tp expected positive integers and --warm-starts a count, got {args.starts}, "
                f"{args.tp} and {args.warm_starts}")  # fmt: skip
    model = ["--model_dir", args.model] if args.model else []
    repos = [REPO] + ([os.path.abspath(args.compare)] if args.compare else [])
    rows = []
    with tempfile.TemporaryDirectory() as home:
        for _ in range(args.warm_starts):
            for repo in repos:
                start_seconds(repo, model, home)
        for tp in args.tp:
            seconds = {repo: [] for repo in repos}
            for _ in range(args.starts):
                for repo in repos:
                    seconds[repo].append(start_seconds(repo, ["--tp", str(tp)] + model, home))
            rows += [{"repo": repo, "tp": tp, "seconds": s, "median_s": statistics.median(s)} for repo, s in
                     seconds.items()]  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpus": len(os.sched_getaffinity(0)), "args": vars(args), "rows": rows}, f, indent=1)
    print("| checkout | tp | starts s | median s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['repo']} | {r['tp']} | {' / '.join(f'{s:.2f}' for s in r['seconds'])} | {r['median_s']:.2f} |")


if __name__ == "__main__":
    main()
