"""Serving load: output tokens/s with decode-attention tuning on vs off, per concurrency and prompt length.

Starts the real server (``--model qwen3``: a Qwen3-shaped random-weight model, 8B widths, fewer layers;
``--model qwen3.5``: Qwen3.5-27B widths, ``--layers`` layers 3:1 linear to full attention, bf16 weights, fp32
linear-attention state, with an MTP head that ``--mtp-step`` turns on) per workload, sized
for the largest concurrency, in turn with decode-attention tuning on (tuned at the first start from an
empty config dir) and off (the same prefill configs, decode attention at its default), ``--repeats`` times
each. Against each, at every concurrency, it first sends ``--warmup`` requests (left out of every statistic),
then a fixed schedule of ``--requests`` requests (seeded prompts and arrival times, the same for every server
and run) to /generate_stream with logprobs. It checks every request completed with finite logprobs, and
reports median output tokens/s on vs off with the spread between starts, p50/p99 time to first token and
inter-token latency as the client sees them, where a first token's time went (the client's wait for the headers, the
server's own part, the hop of each step's tokens from the engine process), and each start-up (seconds, and the
runner's summary: graphs, kernels tuned, seconds per phase). Beside each case it prints decode attention's share
of a step as the tuner timed it (tuned and default), which bounds what tuning can change there; ``--control`` adds
an A/A pair (a second "off" server) whose difference, reported per point for every number, is the method's own
noise. Every start records the config files it wrote under its config dir: an "off" start must write none (a
failure is printed loudly and kept in the JSON, the run goes on); the tuning start's list is the expected set.
With MTP on, each point also reports the draft acceptance (the server's spec-decode counters over the window).
``--compare overlap`` makes "on" and "off" differ in overlapped decode instead: every server runs the configs the
first "on" start tuned, and "off" (and "off_b") start with ``--disable_overlap_schedule``. ``--compare none`` starts
them alike (level 0, one config dir, nothing tuned): "on" vs "off" is then an A/A pair, the method's noise with two
servers instead of ``--control``'s three.
With ``--rounds K`` (a multiple of the server count) the servers of a repeat run side by side (each with a KV pool
of its own, a quarter over what the largest concurrency fills; started together, after the tuning start came up
alone) and each point is K rounds, every server getting
``--requests`` requests per round in a rotating order, on a fresh schedule per round: a drift of the machine over
minutes then reaches every server alike instead of whichever one ran during it. Every point and round has its own
schedule (seeded), so no load meets its prompts in a server's prefix cache.

    python benchmarks/serve_load.py --tp 1 --out benchmarks/results/serve_load_tp1_h200.json
    python benchmarks/serve_load.py --tiny --requests 24 --concurrency 2 4 --control   # the method on a CPU
    # an A/A check with the servers side by side: 3 rounds of 256 requests per server and point
    python benchmarks/serve_load.py --workloads short --repeats 1 --rounds 3 --requests 256 --control
    # the MTP service matrix (FA3 decode where fa3_fwd_interface imports, else Triton); tp 2 on two GPUs
    python benchmarks/serve_load.py --model qwen3.5 --mtp-step 3 --tp 1 --control \
        --out benchmarks/results/serve_load_qwen35_mtp3_tp1_h200.json
    python benchmarks/serve_load.py --model qwen3.5 --mtp-step 3 --tp 2 --control \
        --out benchmarks/results/serve_load_qwen35_mtp3_tp2_h200.json
    python benchmarks/serve_load.py --tiny --model qwen3.5 --mtp-step 2 --concurrency 2   # the same on a CPU
    # overlapped decode on vs off, side by side, with an A/A pair
    python benchmarks/serve_load.py --compare overlap --workloads short --repeats 1 --rounds 6 --control --pin-cores
    # an A/A pair alone, many starts: two identical servers side by side (--merge several such calls)
    python benchmarks/serve_load.py --compare none --workloads short --concurrency 64 --repeats 8 --rounds 2 \
        --requests 192 --rate 60 --pin-cores
    # more server starts than one call holds: the same command per call, then its files as one run
    python benchmarks/serve_load.py --merge call1.json call2.json call3.json --out merged.json
"""

import argparse
import asyncio
import hashlib
import importlib
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling modules, however it is loaded
from bench_io import read_saved_runs  # noqa: E402
from load_client import auto_client_procs, load, percentile  # noqa: E402

from lightllm.common import proc as procs  # noqa: E402
from lightllm.common.net import free_port, wait_healthy  # noqa: E402

WORKLOADS = {"short": (128, 256), "long": (8192, 128)}  # prompt tokens, output tokens
MODELS = ("qwen3", "qwen3.5")
MTP_HEADS = ("agree", "random")  # make_tiny_qwen3_5's heads: drafts ~always / ~never accepted


def hybrid_layer_types(layers):
    """Qwen3.5's 3:1 pattern: every fourth layer full attention, the others linear attention."""
    if layers <= 0 or layers % 4:
        raise ValueError(f"--layers expected a positive multiple of 4 for --model qwen3.5 (3 linear-attention "
                         f"layers per full-attention layer), got {layers}")  # fmt: skip
    return tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))


def build_model(out_dir, model, layers, tiny, mtp_head):
    """The random-weight model folder: tiny (a CPU check) or at Qwen3-8B / Qwen3.5-27B widths with ``layers``."""
    from lightllm.tools.make_tiny_model import QWEN3_8B_SHAPE, make_tiny_qwen3, make_tiny_qwen3_5

    if model == "qwen3":
        if tiny:
            return str(make_tiny_qwen3(out_dir))
        return str(make_tiny_qwen3(out_dir, num_hidden_layers=layers, **QWEN3_8B_SHAPE))
    if tiny:
        return str(make_tiny_qwen3_5(out_dir, mtp=mtp_head))
    from decode_step import QWEN3_5_27B_SHAPE  # benchmarks/ is the script's folder

    return str(make_tiny_qwen3_5(out_dir, layer_types=hybrid_layer_types(layers), mtp=mtp_head, **QWEN3_5_27B_SHAPE))


def resolve_decode_backend(requested, model):
    """The decode backend every server gets: default triton for qwen3 (as before) and auto for qwen3.5; auto is fa3
    when ``fa3_fwd_interface`` imports, else triton (resolved here so the JSON names what ran)."""
    requested = requested or ("auto" if model == "qwen3.5" else "triton")
    if requested != "auto":
        return requested
    try:
        importlib.import_module("fa3_fwd_interface")
    except ImportError:
        return "triton"
    return "fa3"


def server_flags(decode_backend, model, mtp_step):
    """The flags every server of a run gets beside the sizing ones."""
    flags = ["--llm_decode_att_backend", decode_backend]
    if model == "qwen3.5":
        flags += ["--linear_att_ssm_data_type", "float32"]
    if mtp_step:
        flags += ["--mtp_mode", "eagle_with_att", "--mtp_step", str(mtp_step)]
    return flags


def config_snapshot(config_dir):
    """``{relative path: content digest}`` of every autotune config file under ``config_dir``."""
    from lightllm.common.autotuner import store

    root = Path(config_dir)
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in store.iter_config_files(root)}  # fmt: skip


def written_configs(before, config_dir):
    """The config files (relative paths, sorted) that are new or changed since the snapshot ``before``."""
    return sorted(rel for rel, digest in config_snapshot(config_dir).items() if before.get(rel) != digest)


def config_check(mode, written):
    """None when a start wrote what its mode allows (tuning off: no config file), else what went wrong."""
    if mode != "on" and written:
        return f"tuning off ({mode}) wrote {len(written)} config files: {', '.join(written)}"
    return None


def start_server(model_dir, tp, level, config_dir, max_batch, max_len, log_path, flags=(), cores=None):
    """Spawn one server sized for the largest concurrency, its stderr (the start-up summary) into ``log_path``;
    ``(proc, base url)``, not yet answering (``wait_healthy``). ``cores``: the CPU cores it and every process it
    starts may run on (inherited by its children)."""
    port = free_port()
    env = {**os.environ, "LIGHTLLM_TRITON_AUTOTUNE_LEVEL": str(level), "LIGHTLLM_AUTOTUNE_CONFIG_DIR": config_dir}
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--model_dir", model_dir, "--port", str(port),
           "--tp", str(tp), "--running_max_req_size", str(max_batch), "--graph_max_batch_size", str(max_batch),
           "--max_req_total_len", str(max_len), "--graph_max_len_in_batch", str(max_len),
           "--batch_max_tokens", "16384", *flags]  # fmt: skip
    with open(log_path, "w") as log:
        proc = procs.start(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, **pin_kwargs(cores))
    return proc, f"http://127.0.0.1:{port}"


def decode_attention_kernels() -> set:
    """Names of the DECODE_ATTENTION kernels (their modules imported, so they are declared)."""
    import lightllm.kernels.attention.decode.fa3  # noqa: F401
    import lightllm.kernels.attention.decode.flash_decode  # noqa: F401
    import lightllm.kernels.attention.decode.mtp_diverse  # noqa: F401
    import lightllm.kernels.linear_attention.gated_delta_decode  # noqa: F401
    import lightllm.kernels.linear_attention.gated_delta_verify  # noqa: F401
    from lightllm.common.autotuner import AutotuneKernelType, tuner

    return tuner.kernel_names(AutotuneKernelType.DECODE_ATTENTION)


def copy_without_decode_attention(src, dst):
    """The tuned configs of ``src`` into ``dst``, leaving out every decode-attention kernel's directory."""
    from lightllm.common.autotuner import store

    skip = decode_attention_kernels()
    for path in store.iter_config_files(src):
        if path.parent.name not in skip:
            target = os.path.join(dst, os.path.relpath(path, src))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)


def rank_agreement(log_path):
    """Rank 0's check that every rank holds the same configs (agree, ranks, keys, digest); None at tp 1."""
    with open(log_path, errors="replace") as f:
        text = f.read()
    m = re.search(r"autotune: all (\d+) ranks hold identical configs \((\d+) keys, digest (\w+)\)", text)
    if m:
        return {"agree": True, "ranks": int(m.group(1)), "keys": int(m.group(2)), "digest": m.group(3)}
    m = re.search(r"autotune: ranks hold different configs for (\d+) keys", text)
    return {"agree": False, "differing_keys": int(m.group(1))} if m else None


def startup_summary(log_path):
    """The model runner's ``ready:`` line (graphs, kernels tuned, seconds per phase), '' when absent."""
    with open(log_path) as f:
        lines = [ln.strip() for ln in f if "ready:" in ln]
    return lines[0].split("ready:", 1)[1].strip() if lines else ""


def workload_shape(args, workload):
    """``(prompt tokens, output tokens)`` per request of ``workload``; ``--output-tokens`` replaces its output."""
    prompt_len, out_len = WORKLOADS[workload]
    return prompt_len, args.output_tokens or out_len


def launch(args, model, workload, cfg, mode, rep, flags, position=0):
    """Spawn one server of ``mode``, the ``position``-th of its repeat (``--pin-cores``: its cores); ``(proc, base,
    start record, its config dir's snapshot)``, the server not yet answering (``finish_start``). The first "on"
    start tunes (level 1, empty config dir; not with ``--compare none``) and "off" starts from its files minus decode
    attention's."""
    prompt_len, out_len = workload_shape(args, workload)
    max_len = prompt_len + out_len + 64
    level = 1 if tunes(args, mode, rep) else 0
    if (mode, rep) == ("off", 0) and args.compare == "tuning":
        copy_without_decode_attention(cfg["on"], cfg["off"])
    log_path = os.path.join(args.log_dir, f"server_tp{args.tp}_{workload}_{mode}{rep}.log")
    before = config_snapshot(cfg[mode])
    sizing = list(flags) + (["--disable_overlap_schedule"] if args.compare == "overlap" and mode != "on" else [])
    if args.rounds:  # side by side on one GPU: each server a KV pool of its own, not 90 % of the device
        sizing += ["--max_total_token_num", str(side_by_side_pool(max(args.concurrency), max_len, args.mtp_step))]
    cores = args.server_cores[position] if args.server_cores else None
    t0 = time.perf_counter()
    proc, base = start_server(model, args.tp, level, cfg[mode], max(args.concurrency), max_len, log_path, sizing,
                              cores)  # fmt: skip
    start = {"workload": workload, "mode": mode, "repeat": rep, "cores": None if cores is None else sorted(cores),
             "log": log_path, "t0": t0}  # fmt: skip
    return proc, base, start, before


def finish_start(proc, base, start):
    """Wait until the spawned server answers, then complete its start record: seconds from spawn to healthy (the
    servers of one batch started together, so each one's includes its share of the machine), the runner's summary,
    the ranks' agreement."""
    log_path = start.pop("log")
    wait_healthy(proc, base, hint=f"see {log_path}")
    start["startup_s"] = time.perf_counter() - start.pop("t0")
    start.update(summary=startup_summary(log_path), ranks=rank_agreement(log_path))


def tunes(args, mode, rep):
    """Whether this start searches (level 1, an empty config dir): the first "on" start, unless on and off start
    alike (``--compare none``)."""
    return (mode, rep) == ("on", 0) and args.compare != "none"


def aa_pair(args):
    """The two modes whose difference is the method's own noise: ``--control``'s "off_b" vs "off", or with
    ``--compare none`` "on" vs "off" (started alike); None when the run has no such pair."""
    return ("off", "off_b") if args.control else ("off", "on") if args.compare == "none" else None


def start_batches(args, modes, positions, rep):
    """The servers of a repeat in the groups that start together: the tuning start ("on" at repeat 0) alone, so its
    search times kernels on an otherwise idle machine and the "off" start copies the files it wrote; every other
    server of the repeat at once (side by side they are all up and idle before the first load, so starting them
    together changes nothing measured and saves a start's time per server)."""
    pairs = list(zip(positions, modes))
    tuning = [(position, mode) for position, mode in pairs if tunes(args, mode, rep)]
    rest = [pair for pair in pairs if pair not in tuning]
    return [batch for batch in (tuning, rest) if batch]


def run_load(args, base, workload, vocab, conc, n, seed, rate=0.0):
    """``n`` streamed requests of schedule ``seed`` at concurrency ``conc`` against ``base``: the load's record."""
    prompt_len, out_len = workload_shape(args, workload)
    return asyncio.run(load(base, n, conc, prompt_len, out_len, vocab, seed=seed, rate=rate, stream=True,
                            client_procs=args.client_procs or auto_client_procs(conc)))  # fmt: skip


def scheduling_counts(pid):
    """How often the threads of process ``pid`` were taken off a CPU while they could still run (involuntary context
    switches: another thread wanted the CPU) and moved between CPUs (migrations), summed over its threads, from /proc
    (Linux; a count it cannot read is None). A server's HTTP process sharing its CPU shows in the first, one the
    scheduler keeps moving in the second."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {"involuntary_switches": None, "migrations": None}
    # a kernel without CONFIG_SCHED_DEBUG has no sched file: migrations unknown
    switches, migrations = 0, 0 if os.path.exists(f"/proc/{pid}/sched") else None
    for tid in tids:
        switches += _proc_count(f"/proc/{pid}/task/{tid}/status", "nonvoluntary_ctxt_switches:")
        if migrations is not None:
            migrations += _proc_count(f"/proc/{pid}/task/{tid}/sched", "se.nr_migrations")
    return {"involuntary_switches": switches, "migrations": migrations}


def steal_ticks():
    """Per CPU, the time the hypervisor gave this virtual machine's CPU to something else while it wanted to run
    (/proc/stat's "steal"), in clock ticks: ``{cpu: ticks}``; {} where it cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        return {}
    return {int(row[0][3:]): int(row[8]) for row in rows if len(row) > 8}


def steal_ms(before, after, cpus=None):
    """Steal time (ms) between two ``steal_ticks`` on ``cpus`` (default: every CPU); None where it is unknown."""
    keys = [c for c in (after if cpus is None else cpus) if c in before and c in after]
    if not keys:
        return None
    return sum(after[c] - before[c] for c in keys) * 1000 / os.sysconf("SC_CLK_TCK")


def _proc_count(path, name):
    """The integer after ``name`` on its line of the /proc file ``path``; 0 when the thread has exited meanwhile."""
    try:
        with open(path) as f:
            line = next((ln for ln in f if ln.startswith(name)), None)
    except OSError:
        return 0
    return 0 if line is None else int(line[len(name) :].strip(" :\t\n"))


def counts_delta(before, after):
    """``after - before`` per count of ``scheduling_counts`` (None where either is unknown)."""
    return {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in before}


def run_repeat(args, model, workload, vocab, cfg, rep, flags, results, startups):
    """One repeat: every mode's server, one after another (default), or with ``--rounds`` all of them side by side
    and each point measured in rounds that visit every server in turn."""
    order = start_order(rep, args.control)
    if args.rounds:
        run_servers(args, model, workload, vocab, cfg, rep, flags, results, startups, order, range(len(order)))
    else:  # one server at a time, one round (the same schedules)
        for position, mode in enumerate(order):
            run_servers(args, model, workload, vocab, cfg, rep, flags, results, startups, [mode], [position])


def run_servers(args, model, workload, vocab, cfg, rep, flags, results, startups, modes, positions):
    """Start the servers of ``modes`` (the ``positions``-th of the repeat) side by side and measure every point on
    each: a warm-up each, then ``--rounds`` rounds (1 without) that visit them in a rotating order. Side by side, a
    drift of the machine over minutes (clocks, the host's other load) reaches every server of a round within
    seconds of each other, instead of whichever server happened to run during it. Only one server is under load at
    a time; the others wait idle."""
    alive = []
    try:
        for batch in start_batches(args, modes, positions, rep):
            spawned = []
            for position, mode in batch:
                spawned.append((mode, *launch(args, model, workload, cfg, mode, rep, flags, position)))
                alive.append(spawned[-1])  # stopped by the finally below, answering or not
            for _, proc, base, start, _ in spawned:
                finish_start(proc, base, start)
                startups.append(start)
                # announced only once recorded: a stop that follows the line (a test's SIGTERM) stops this server
                # and saves this start
                print(json.dumps(start), flush=True)
        bases = {mode: base for mode, _, base, _, _ in alive}
        pids = {mode: proc.pid for mode, proc, _, _, _ in alive}  # the HTTP process: a server's process tree's root
        for ci, conc in enumerate(args.concurrency):
            warm = conc * 2 if args.warmup is None else args.warmup  # on its own schedule, nothing of it counted
            for mode in modes:
                if warm:
                    run_load(args, bases[mode], workload, vocab, conc, warm, point_seed(args.seed, ci, 0) + 1)
            for rnd in range(args.rounds or 1):
                cores = {}
                if args.server_cores and args.rounds:
                    for (mode, proc, _, _, _), position in zip(alive, positions):
                        cores[mode] = round_cores(args.server_cores, position, rnd)
                        repin_tree(proc.pid, cores[mode])
                for mode in round_order(modes, rnd):
                    before, stolen = scheduling_counts(pids[mode]), steal_ticks()
                    res = run_load(args, bases[mode], workload, vocab, conc, args.requests,
                                   point_seed(args.seed, ci, rnd), args.rate)  # fmt: skip
                    res.update({f"http_{k}": v for k, v in counts_delta(before, scheduling_counts(pids[mode])).items()})
                    # a stall no process of the machine caused: its CPUs given to another machine meanwhile
                    stolen_after = steal_ticks()
                    res["steal_ms_all"] = steal_ms(stolen, stolen_after)
                    res["steal_ms_server"] = steal_ms(stolen, stolen_after, cores[mode]) if mode in cores else None
                    res["repeat"] = rep  # the server start: the A/A interval's outer level
                    res["round"] = rnd
                    if mode in cores:
                        res["cores"] = sorted(cores[mode])
                    results.setdefault((mode, conc), []).append(res)
                    where = {"workload": workload, "mode": mode, "repeat": rep, "concurrency": conc}
                    print(json.dumps({**where, **({"round": rnd} if args.rounds else {}), **res}), flush=True)
    finally:
        stop_all(alive, cfg)


def stop_all(alive, cfg):
    """Stop every server (a failure or a second SIGTERM while stopping one still stops the others), then read each
    start's config check. off and off_b share a config dir: a file written after both started shows in both."""
    problem = None
    for _, proc, _, _, _ in alive:
        try:
            procs.stop(proc)
        except BaseException as e:  # re-raised below, once every server is stopped
            problem = problem or e
    for mode, _, _, start, before in alive:  # read once the servers are gone: nothing written at exit is missed
        start["config_files_written"] = written_configs(before, cfg[mode])
        start["config_check"] = config_check(mode, start["config_files_written"])
    if problem is not None:
        raise problem


def round_order(modes, rnd):
    """The servers' order in round ``rnd``: rotated, so over len(modes) rounds each goes at every position."""
    shift = rnd % len(modes)
    return modes[shift:] + modes[:shift]


def point_seed(seed, conc_index, rnd):
    """The measured schedule of one point (the ``conc_index``-th concurrency) and round: the same for every server,
    a fresh one per point and round, since a server's prefix cache would serve a schedule it saw before from cache;
    its warm-up takes this plus one, which no other schedule takes (steps of 1000 and 100000)."""
    return seed + 100_000 * conc_index + 1000 * rnd


def side_by_side_pool(max_conc, max_len, mtp_step):
    """KV tokens of one server side by side with others: every slot of the largest concurrency full (MTP's draft
    tokens included) and a quarter more, plus the pool's reserved token."""
    return max_conc * (max_len + mtp_step) * 5 // 4 + 1


def pin_kwargs(cores):
    """``Popen`` arguments that start a process on ``cores`` only (None: anywhere); what it starts inherits them."""
    return {} if cores is None else {"preexec_fn": lambda: os.sched_setaffinity(0, cores)}


def repin_tree(pid, cores):
    """Move the running process ``pid``, every process under it and every thread of them onto ``cores`` (on Linux
    an affinity is a thread's own, so each thread is set; what they start later inherits it)."""
    for member in [pid, *procs.descendants(pid)]:
        try:
            for tid in os.listdir(f"/proc/{member}/task"):
                os.sched_setaffinity(int(tid), cores)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            pass


def round_cores(server_cores, position, rnd):
    """The cores of the ``position``-th server in round ``rnd``: the core sets rotate every round, so over as many
    rounds as servers each server runs once on every set and a difference between the sets (a shared physical core,
    interrupts) reaches every server alike instead of becoming one server's bias."""
    return server_cores[(position + rnd) % len(server_cores)]


def cpu_siblings(cpu):
    """The logical CPUs of ``cpu``'s physical core, itself included (Linux's topology; just ``{cpu}`` where it cannot be
    read)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out | {cpu}


def core_plan(cores, servers, tp, per=None, siblings=cpu_siblings):
    """``--pin-cores``: ``(per-server core sets, the clients' cores, the idle cores)``. Each server gets ``per``
    physical cores of its own (default ``tp + 1``: its HTTP process and each engine rank), in launch order, and runs on
    one logical CPU of each: their SMT siblings stay idle, so neither a server's engine (a core kept busy) nor a client
    shares a physical core with another process of a server. The load clients and this script share the rest.
    ``siblings(cpu)``: the logical CPUs of ``cpu``'s physical core. ValueError when that leaves the clients fewer than
    two cores."""
    allowed = set(cores)
    physical = sorted({frozenset(siblings(c) & allowed) for c in allowed}, key=min)
    per = per or tp + 1
    need = servers * per
    clients = {c for group in physical[need:] for c in group}
    if len(physical) < need or len(clients) < 2:
        smt = len(physical) < len(allowed)
        where = f" in {len(physical)} physical cores" if smt else ""
        raise ValueError(f"--pin-cores expected at least {need} physical CPU cores ({servers} servers x {per}) and 2 "
                         f"more CPUs for the load clients, this process may run on {len(allowed)}{where}")  # fmt: skip
    server_cores = [{min(group) for group in physical[i * per : (i + 1) * per]} for i in range(servers)]
    idle = {c for group in physical[:need] for c in group} - set().union(*server_cores)
    return server_cores, clients, idle


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=512, help="measured requests per concurrency and server")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests sent before each measured load and left out of its statistics (default 2 x conc)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="Poisson arrivals at this many requests/s (0: all at once, paced by the concurrency alone)",
    )
    p.add_argument("--seed", type=int, default=0, help="the request schedule's seed (the same for every server)")
    p.add_argument("--output-tokens", type=int, default=None, help="output tokens per request instead of the "
                   "workload's (short: 256, long: 128), e.g. a quick CPU check of the method with --tiny")  # fmt: skip
    p.add_argument(
        "--client-procs",
        type=int,
        default=None,
        help="client processes per load (default: one per 4 streams, at most 8; see load_client.py)",
    )
    p.add_argument("--repeats", type=int, default=2, help="server starts per mode (medians are reported)")
    p.add_argument("--rounds", type=int, default=0, help="0: one server at a time, one load per point (default); "
                   "K (a multiple of the server count): the servers of a repeat run side by side and each point is "
                   "K rounds, every server getting --requests requests per round in a rotating order (a fresh "
                   "schedule per round)")  # fmt: skip
    p.add_argument("--pin-cores", action="store_true", help="give each server tp + 1 physical CPU cores of its own "
                   "(or --cores-per-server; one logical CPU of each, their SMT siblings left idle; in launch order; "
                   "its processes share them) and the load clients the rest, "
                   "so no server shares a core with another server or a client; with --rounds the servers' core "
                   "sets rotate every round")  # fmt: skip
    p.add_argument("--cores-per-server", type=int, default=None, help="with --pin-cores: each server's cores "
                   "(default tp + 1: its HTTP process and each engine rank)")  # fmt: skip
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        choices=list(WORKLOADS),
        help="default: all (--tiny: short, the only one within the tiny model's 4096-token context)",
    )
    p.add_argument("--out", default="benchmarks/results/serve_load.json")
    p.add_argument("--log-dir", default="serve_load_logs", help="server logs (one per start) and the tuned configs")
    p.add_argument("--control", action="store_true", help="also start a second 'off' server per repeat (off_b)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="saved runs of one method (other device calls' server "
                   "starts) as one run written to --out: every point's runs together, starts renumbered, the tables "
                   "and the A/A interval over all of them; nothing is started")  # fmt: skip
    p.add_argument("--compare", default="tuning", choices=("tuning", "overlap", "none"), help="what 'on' and 'off' "
                   "differ in: decode-attention tuning (default), overlapped decode ('off' starts with "
                   "--disable_overlap_schedule; all run the configs the first 'on' start tuned), or nothing (none: "
                   "an A/A pair of two servers started alike, level 0, nothing tuned)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model instead (a CPU check of the method)")
    p.add_argument("--model", default="qwen3", choices=MODELS, help="qwen3: Qwen3-8B widths; qwen3.5: Qwen3.5-27B "
                   "widths, --layers a multiple of 4 (3 linear + 1 full attention each), with an MTP head")  # fmt: skip
    p.add_argument("--mtp-step", type=int, default=0, choices=range(5), help="MTP draft tokens per step (qwen3.5; "
                   "0: off): every server gets --mtp_mode eagle_with_att --mtp_step N")  # fmt: skip
    p.add_argument("--mtp-head", default="agree", choices=MTP_HEADS, help="qwen3.5's MTP head: agree (drafts ~always "
                   "accepted) or random (~never); the measured acceptance is reported either way")  # fmt: skip
    p.add_argument("--decode-backend", default=None, choices=("fa3", "triton", "auto"), help="--llm_decode_att_backend "
                   "of every server; auto: fa3 when fa3_fwd_interface imports, else triton (default: auto for "
                   "qwen3.5, triton for qwen3)")  # fmt: skip
    args = p.parse_args()
    if args.merge:
        saved = read_saved_runs(p, "--merge", args.merge)
        try:
            merged, rows, startups = merge_saved(saved)
        except (KeyError, TypeError, ValueError) as e:
            p.error(str(e) if isinstance(e, ValueError) else f"--merge: not a saved serve_load run ({e!r} missing)")
        merged.out = args.out
        save(merged, rows, startups, partial=any(d.get("partial") for d in saved), merged_from=args.merge)
        report(merged, rows, startups)
        return
    if args.mtp_step and args.model != "qwen3.5":
        p.error(f"--mtp-step {args.mtp_step} expected --model qwen3.5 (the model with an MTP head), got {args.model}")
    if args.model == "qwen3.5" and not args.tiny:
        try:
            hybrid_layer_types(args.layers)
        except ValueError as e:
            p.error(str(e))
    if args.workloads is None:
        args.workloads = ["short"] if args.tiny else list(WORKLOADS)
    if args.tiny and "long" in args.workloads:
        p.error(f"--workloads long expected a model with an {sum(WORKLOADS['long']) + 64}-token context; --tiny's has "
                "4096 (use --workloads short)")  # fmt: skip
    servers = 3 if args.control else 2
    if args.rounds < 0 or args.rounds % servers:
        p.error(f"--rounds expected 0 (one server at a time) or a multiple of the {servers} servers (each goes at "
                f"every position equally often), got {args.rounds}")  # fmt: skip
    if args.output_tokens is not None and args.output_tokens < 2:
        p.error(f"--output-tokens expected at least 2 (a prefill token and a decode step), got {args.output_tokens}")
    if args.client_procs is not None and args.client_procs < 1:
        p.error(f"--client-procs expected a positive count, got {args.client_procs}")
    if args.cores_per_server is not None and (args.cores_per_server < 1 or not args.pin_cores):
        p.error(f"--cores-per-server expected a positive count with --pin-cores, got {args.cores_per_server}"
                + ("" if args.pin_cores else " without --pin-cores"))  # fmt: skip
    args.server_cores, args.idle_cores = None, None
    if args.pin_cores:
        try:
            args.server_cores, client_cores, args.idle_cores = core_plan(
                os.sched_getaffinity(0), servers, args.tp, args.cores_per_server
            )
        except ValueError as e:
            p.error(str(e))
        print(f"pinned: servers on {[sorted(c) for c in args.server_cores]}, idle (their SMT siblings): "
              f"{sorted(args.idle_cores) or 'none'}, the clients on {sorted(client_cores)}")  # fmt: skip
        os.sched_setaffinity(0, client_cores)  # this script, and the client processes it spawns
    args.decode_backend = resolve_decode_backend(args.decode_backend, args.model)
    flags = server_flags(args.decode_backend, args.model, args.mtp_step)
    procs.exit_on_sigterm()  # stopped from outside: still stop the servers and remove the temporary folders

    os.makedirs(args.log_dir, exist_ok=True)
    rows, startups = [], []
    with tempfile.TemporaryDirectory() as root:
        model = build_model(os.path.join(root, "model"), args.model, args.layers, args.tiny, args.mtp_head)
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        for workload in args.workloads:
            results = {}
            # Servers sized for the largest concurrency, as an operator would run them, --repeats starts per
            # mode in a rotating order (start_order).
            # "on": decode-attention configs tuned by the first "on" start (level 1, empty config dir: its
            # start-up includes the cold search of every kernel); later "on" starts reuse them (level 0).
            # "off": level 0 over the same files minus the decode-attention kernels', so only decode attention
            # differs (it runs its launcher default).
            # "off_b" (--control): "off" again. Servers that differ in nothing differ by off_b vs off: the
            # noise floor an on-vs-off difference must clear before decode attention can be blamed for it.
            with tempfile.TemporaryDirectory() as cfg_on, tempfile.TemporaryDirectory() as cfg_off:
                cfg = {"on": cfg_on, "off": cfg_off, "off_b": cfg_off}
                if args.compare != "tuning":  # the same configs for all: only overlapped decode differs, or nothing
                    cfg = {"on": cfg_on, "off": cfg_on, "off_b": cfg_on}
                try:
                    for rep in range(args.repeats):
                        run_repeat(args, model, workload, vocab, cfg, rep, flags, results, startups)
                except (SystemExit, KeyboardInterrupt):  # stopped (a timeout's SIGTERM, ^C): keep what was measured
                    rows += point_rows(args, workload, results, decode_attention_timings(cfg_on))
                    save(args, rows, startups, partial=True)
                    print(f"stopped: {args.out} keeps the {len(rows)} point(s) every server had measured (partial)",
                          flush=True)  # fmt: skip
                    raise
                # the tuned files keep each run key's tuned and default time: why "on" chose what it chose
                shutil.copytree(cfg_on, os.path.join(args.log_dir, f"configs_tp{args.tp}_{workload}"),
                                dirs_exist_ok=True)  # fmt: skip
                kernels = decode_attention_timings(cfg_on)
            rows += point_rows(args, workload, results, kernels)
            save(args, rows, startups)
    save(args, rows, startups)
    report(args, rows, startups)


def report(args, rows, startups):
    """The tables of a run (or of merged runs) on stdout."""
    runs = f"{args.repeats} server starts" + (f" x {args.rounds} rounds (servers side by side)" if args.rounds else "")
    print(f"\nmedian of {runs} per mode; spread = (max - min) / median")
    print("step ms = the server's mean decode step (forward, sampling, bookkeeping; median over runs): on / off")
    print("attention = decode attention per step (layers x the graph's kernel) as timed by the tuner: tuned / default")
    head = "workload conc  on tok/s  off tok/s  on vs off  on spread  off spread  step ms on/off  attention ms"
    print(head + ("  off_b vs off" if args.control else "") + "  all ok")
    for r in rows:
        on, off, att = r["on"], r["off"], r["decode_attention"]
        att_text = f"{att['tuned_ms']:.3f}/{att['default_ms']:.3f}" if att else "-"
        step_text = "/".join("-" if x is None else f"{x:.3f}" for x in (on["decode_step_ms"], off["decode_step_ms"]))
        ok = all(r[m]["all_complete_finite"] for m in MODES if m in r)
        control = f"  {r['off_b_vs_off_pct']:+11.1f}%" if args.control else ""
        print(f"{r['workload']:8s} {r['concurrency']:4d} {on['tokens_per_s']:9.0f} {off['tokens_per_s']:10.0f} "
              f"{r['on_vs_off_pct']:+9.1f}% {on['spread_pct']:8.1f}% {off['spread_pct']:10.1f}%  {step_text:>14s}"
              f"  {att_text:>12s}"
              f"{control}  {ok}")  # fmt: skip
    print("\nlatency as the client sees it (ms, median over runs): time to first token and inter-token, p50 / p99")
    pair = aa_pair(args)
    aa_name = pair and f"{pair[1]} vs {pair[0]}"
    aa_head = f"  A/A ({aa_name}): tok/s ttft50 ttft99 itl50 itl99  step   gpu" if pair else ""
    print("workload conc  mode   ttft p50  ttft p99  itl p50  itl p99" + aa_head)
    for r in rows:
        for mode in MODES:
            if mode not in r:
                continue
            m = r[mode]
            cells = " ".join("       -" if m[k] is None else f"{m[k]:8.2f}" for k in REPORTED[1:])
            aa = ""
            if pair and mode == pair[1]:
                aa = "  " + " ".join(
                    "     -" if r["aa_pct"][k] is None else f"{r['aa_pct'][k]:+5.1f}%" for k in AA_REPORTED
                )
            print(f"{r['workload']:8s} {r['concurrency']:4d}  {mode:5s} {cells}{aa}")
    if pair:
        print("\nA/A time to first token with every measured request of a point pooled (its runs' requests together):"
              f" {aa_name}, and the 95 % bootstrap interval (server starts resampled, then rounds within each, then"
              " requests within each run; with one start per server the interval cannot hold how starts differ)"
              )  # fmt: skip
        print("workload conc  starts  requests  p50                       p99                       mean")
        for r in rows:
            aa, n = r["aa_ttft_pooled"], (r["off"]["ttft_pooled"] or {}).get("requests", 0)
            cells = "  ".join("-".ljust(24) if aa is None else
                              f"{aa[k]['pct']:+5.1f}% [{aa[k]['ci95'][0]:+5.1f}, {aa[k]['ci95'][1]:+5.1f}]".ljust(24)
                              for k in POOLED_TTFT)  # fmt: skip
            starts = "-" if aa is None else aa.get("starts", 1)
            print(f"{r['workload']:8s} {r['concurrency']:4d}  {starts:>6}  {n:8d}  {cells}")
    print("\nwho kept up (median over runs): the engine's mean decode batch, its busy share of the wall time (steps"
          " / seconds), the busiest client process's CPU share, the server's HTTP and engine processes' CPU shares"
          " (% of a core), and the decode step (ms) with its GPU part (CUDA events: forward and sampling; the rest"
          " is the host's)")  # fmt: skip
    print("; mean time to first token (ms) as the client saw it and as the server timed it (from submission to the"
          " token sampled), the client's wait for the response headers (the request is submitted as they go out),"
          " and each step's message hop from the engine process to the HTTP event loop (ms)")  # fmt: skip
    print(
        "workload conc  mode   decode batch  engine busy  client CPU  http CPU  engine CPU   step ms   gpu ms  "
        "ttft client  server  headers  engine->http"
    )
    bound = []
    for r in rows:
        for mode in MODES:
            if mode in r:
                m = r[mode]
                cells = ["-" if m[k] is None else f"{m[k]:.1f}" for k in HOST_CHECK]
                step = ["-" if m[k] is None else f"{m[k]:.3f}" for k in ("decode_step_ms", "decode_gpu_ms")]
                first = ["-" if m.get(k) is None else f"{m[k]:.2f}" for k in TTFT_MEANS]
                print(f"{r['workload']:8s} {r['concurrency']:4d}  {mode:5s} {cells[0]:>12s} {cells[1]:>11s}% "
                      f"{cells[2]:>9s}% {cells[3]:>8s}% {cells[4]:>10s}% {step[0]:>9s} {step[1]:>8s} "
                      f"{first[0]:>12s} {first[1]:>7s} {first[2]:>8s} {first[3]:>13s}")  # fmt: skip
                if m["client_cpu_pct"] > CLIENT_BOUND_PCT:
                    bound.append(f"{r['workload']} {r['concurrency']} {mode}")
    if bound:
        print(f"CLIENT-BOUND (a client process over {CLIENT_BOUND_PCT}% CPU; raise --client-procs): {', '.join(bound)}")
    print("\nstalls (median over runs): the garbage collector's passes in the server's processes over a run (ms) and"
          " how many took over 10 ms (every stream sees one), and the machine's CPUs' steal time (ms: the hypervisor"
          " ran another machine there), on the server's cores (pinned) and on all")  # fmt: skip
    print("workload conc  mode   http ms  engine ms  http >10ms  engine >10ms  steal server  steal all")
    for r in rows:
        for mode in MODES:
            if mode in r:
                cells = ["-" if r[mode].get(k) is None else f"{r[mode][k]:.1f}" for k in GC_CHECK + STEAL_CHECK]
                print(f"{r['workload']:8s} {r['concurrency']:4d}  {mode:5s} {cells[0]:>8s} {cells[1]:>10s} "
                      f"{cells[2]:>11s} {cells[3]:>13s} {cells[4]:>13s} {cells[5]:>10s}")  # fmt: skip
    if args.mtp_step:
        print(f"\nMTP step {args.mtp_step}: draft acceptance (accepted / proposed drafts over the measured window, "
              "median over runs)")  # fmt: skip
        print("workload conc  " + "  ".join(f"{m:>6s}" for m in MODES if m in rows[0]))
        for r in rows:
            cells = "  ".join("     -" if r[m]["acceptance"] is None else f"{r[m]['acceptance']:6.3f}"
                              for m in MODES if m in r)  # fmt: skip
            print(f"{r['workload']:8s} {r['concurrency']:4d}  {cells}")
    for s in startups:
        ranks = s["ranks"]
        agreement = "" if ranks is None else (
            f"; {ranks['ranks']} ranks, identical configs, digest {ranks['digest']}" if ranks["agree"]
            else f"; RANKS DISAGREE on {ranks['differing_keys']} keys")  # fmt: skip
        print(f"start-up {s['workload']} {s['mode']}{s['repeat']}: {s['startup_s']:.1f}s ({s['summary']}){agreement}; "
              f"wrote {len(s['config_files_written'])} config files")  # fmt: skip
    for workload, files in tuned_config_files(startups).items() if args.compare != "none" else ():
        print(f"\nconfig files the tuning start wrote ({workload}, {len(files)}):")
        print("\n".join(f"  {f}" for f in files) or "  (none)")
    for s in startups:
        if s["config_check"]:
            print(f"CONFIG CHECK FAILED, start-up {s['workload']} {s['mode']}{s['repeat']}: {s['config_check']}")


def start_order(rep, control):
    """Server starts of one repeat. The first is "on" (its start tunes); after that the order alternates so a
    drift between consecutive starts (clocks, page cache, the last server's exit) hits every mode alike."""
    modes = ["on", "off"] + (["off_b"] if control else [])
    if rep == 0:
        return modes
    shift = rep % len(modes)
    return modes[shift:] + modes[:shift]


def decode_attention_timings(config_dir):
    """Every decode-attention run key the "on" start tuned: ``{(kernel, batch): (tuned_ms, default_ms)}``, as the
    tuner timed them at the tuning length (from the timings the config files keep)."""
    from lightllm.common.autotuner import store

    out = {}
    for name in decode_attention_kernels():
        for path in store.iter_config_files(config_dir, name):
            data = store.read_config_file(path)
            for run_key, timing in store.read_timings(data).items() if data else ():
                key = json.loads(run_key)
                batch = key[0] if isinstance(key, list) and key else None
                if isinstance(batch, int) and {"best_ms", "default_ms"} <= set(timing):
                    out[name, batch] = (timing["best_ms"], timing["default_ms"])
    return out


def per_step_attention(kernels, concurrency, layers):
    """Decode attention per step at the graph for ``concurrency`` (tuned and default ms, x layers), or None."""
    found = [(t, d) for (_, batch), (t, d) in kernels.items() if batch == concurrency]
    if not found:
        return None
    tuned, default = found[0]
    return {"tuned_ms": tuned * layers, "default_ms": default * layers, "layers": layers}


MODES = ("on", "off", "off_b")  # "off_b" only with --control
REPORTED = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
# the served step (tokens/s is mostly decode batch over it) and its GPU part (the rest is the host's)
AA_REPORTED = REPORTED + ("decode_step_ms", "decode_gpu_ms")
HOST_CHECK = ("decode_batch", "engine_busy_pct", "client_cpu_pct", "http_cpu_pct", "engine_cpu_pct")
# the client's TTFT and the server's own (its /metrics histogram), the client's wait for the headers, the hop back
TTFT_MEANS = ("ttft_mean_ms", "server_ttft_mean_ms", "headers_mean_ms", "engine_message_mean_ms")
CLIENT_BOUND_PCT = 80  # a client process busier than this may be what is measured
# the garbage collector's passes in the server's processes over a run: their time (ms), and those over 10 ms
GC_CHECK = ("http_gc_ms", "engine_gc_ms", "http_gc_long", "engine_gc_long")
# and the stalls of the virtual machine itself: its CPUs' steal time over a run (ms), the server's cores and all
STEAL_CHECK = ("steal_ms_server", "steal_ms_all")


def pct(a, b):
    """(a / b - 1) in percent; None when either is missing."""
    return None if a is None or b is None or b == 0 else (a / b - 1) * 100


def summarize(runs):
    """Per reported number the median over runs (server starts, times rounds with ``--rounds``); tokens/s's spread;
    time to first token over every measured request of the runs together; whether every request was whole."""
    tps = sorted(r["tokens_per_s"] for r in runs)
    out = {}
    for key in (
        REPORTED + ("decode_step_ms", "decode_gpu_ms", "acceptance") + HOST_CHECK + TTFT_MEANS + GC_CHECK + STEAL_CHECK
    ):
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return {**out, "spread_pct": (tps[-1] - tps[0]) / out["tokens_per_s"] * 100, "ttft_pooled": pooled_ttft(runs),
            "runs": runs, "all_complete_finite": all(r["all_complete_finite"] for r in runs)}  # fmt: skip


# Time to first token pooled over a point's runs. A round's p99 of 128 requests is its second slowest, and a median
# of three such is one request of one round; every request of every round together gives the percentiles their
# whole sample, and the bootstrap says how far apart two identical servers can read by chance.
POOLED_TTFT = {"p50": lambda xs: percentile(xs, 50), "p99": lambda xs: percentile(xs, 99), "mean": statistics.fmean}
BOOTSTRAP_RESAMPLES = 1000


def pooled_ttft(runs):
    """Time to first token (ms) over every measured request of ``runs`` together: their count, p50, p99 and mean;
    None without samples (a load that did not stream)."""
    xs = [x for r in runs for x in r.get("ttft_samples_ms") or ()]
    return {"requests": len(xs), **{f"{k}_ms": f(xs) for k, f in POOLED_TTFT.items()}} if xs else None


def aa_ttft_interval(a_runs, b_runs, resamples=BOOTSTRAP_RESAMPLES, seed=0):
    """``b`` vs ``a`` in percent for each pooled time-to-first-token statistic, with its 95 % bootstrap interval:
    ``{stat: {"pct", "ci95": [low, high]}, "starts": n}``, None without samples. Three levels, the outermost first:
    a resample draws server starts (``repeat``) with replacement, then rounds within each drawn start, the same ones
    for both servers (a round's schedule and moment are theirs alike; runs pair by position), then each drawn run's
    requests within it. The interval so holds what differs from one start of a server to the next (its process's
    state: the H200 showed two identical servers 5 % apart in all nine rounds of one start), what moves from round
    to round (the machine's drift, a core set), and the requests' own spread. With one start per server it holds
    no start-to-start variation (``starts`` says so); with few rounds it is wide, as it should be. Seeded, so a saved
    run's interval can be recomputed."""
    starts = {}
    for ra, rb in zip(a_runs, b_runs):
        if ra.get("ttft_samples_ms") and rb.get("ttft_samples_ms"):
            starts.setdefault(ra.get("repeat", 0), []).append((ra["ttft_samples_ms"], rb["ttft_samples_ms"]))
    if not starts:
        return None
    groups = list(starts.values())
    rng = random.Random(seed)
    diffs = {k: [] for k in POOLED_TTFT}
    for _ in range(resamples):
        drawn = [pair for group in rng.choices(groups, k=len(groups)) for pair in rng.choices(group, k=len(group))]
        da = [x for run, _ in drawn for x in rng.choices(run, k=len(run))]
        db = [x for _, run in drawn for x in rng.choices(run, k=len(run))]
        for k, f in POOLED_TTFT.items():
            diffs[k].append(pct(f(db), f(da)))
    pairs = [pair for group in groups for pair in group]
    out = {}
    for k, f in POOLED_TTFT.items():
        d = sorted(diffs[k])
        low, high = d[int(0.025 * resamples)], d[max(0, int(0.975 * resamples) - 1)]
        whole = pct(f([x for _, run in pairs for x in run]), f([x for run, _ in pairs for x in run]))
        out[k] = {"pct": whole, "ci95": [low, high]}
    out["starts"] = len(groups)
    return out


def tuned_config_files(startups):
    """Per workload, the config files its tuning start (on, repeat 0) wrote: the set "tuning on" is expected to
    write."""
    return {s["workload"]: s["config_files_written"] for s in startups
            if (s["mode"], s["repeat"]) == ("on", 0) and "config_files_written" in s}  # fmt: skip


def point_rows(args, workload, results, kernels):
    """One row per concurrency of ``workload`` that every server has measured at least once (a stopped run keeps
    the points it finished; the A/A interval pairs the runs both have)."""
    rows = []
    modes = MODES if args.control else MODES[:2]
    for conc in args.concurrency:
        if not all(results.get((mode, conc)) for mode in modes):
            continue
        on, off = summarize(results["on", conc]), summarize(results["off", conc])
        row = {"workload": workload, "concurrency": conc, "tp": args.tp, "on": on, "off": off,
               "on_vs_off_pct": (on["tokens_per_s"] / off["tokens_per_s"] - 1) * 100,
               # the Qwen3 graph's one kernel per layer; Qwen3.5 mixes kernels per step (left out)
               "decode_attention": per_step_attention(kernels, conc, args.layers)
               if args.model == "qwen3" else None}  # fmt: skip
        if args.control:
            off_b = row["off_b"] = summarize(results["off_b", conc])
            row["off_b_vs_off_pct"] = (off_b["tokens_per_s"] / off["tokens_per_s"] - 1) * 100
        pair = aa_pair(args)
        if pair:  # the A/A difference of every reported number at this point
            a, b = (row[m] for m in pair)
            row["aa_pct"] = {k: pct(b[k], a[k]) for k in AA_REPORTED}
            row["aa_ttft_pooled"] = aa_ttft_interval(results[pair[0], conc], results[pair[1], conc])
        rows.append(row)
    return rows


# What runs must share to merge: everything that shapes a server or a load (not how many starts each had)
MERGE_SAME = ("tp", "model", "tiny", "layers", "mtp_step", "mtp_head", "decode_backend", "requests", "output_tokens",
              "warmup", "rate", "seed", "rounds", "control", "compare", "client_procs", "pin_cores",
              "cores_per_server", "idle_cores")  # fmt: skip


def merge_saved(saved):
    """Saved runs of one method (each, say, one device call's worth of server starts) as one: ``(settings, rows,
    startups)`` with every point's runs and every start together, each file's starts numbered after the previous
    file's, so the A/A interval draws starts from all of them; rows recomputed. Within a file's point each mode keeps
    as many runs as the mode with the fewest (a stopped run may have measured "off" once more than "off_b"), so the
    A/A pairs stay run against run. ValueError naming the setting two files differ in."""
    for i, d in enumerate(saved[1:], 2):
        for key in MERGE_SAME:
            if d.get(key) != saved[0].get(key):
                raise ValueError(f"--merge: file {i} has {key}={d.get(key)!r} and file 1 {saved[0].get(key)!r}; only "
                                 "runs of one method merge")  # fmt: skip
    results, startups, attention, offset = {}, [], {}, 0
    for d in saved:
        repeats = [s["repeat"] for s in d["startups"]]
        for row in d["rows"]:
            point = (row["workload"], row["concurrency"])
            attention.setdefault(point, row.get("decode_attention"))
            modes = [m for m in MODES if m in row]
            keep = min(len(row[m]["runs"]) for m in modes)
            for mode in modes:
                runs = [{**run, "repeat": run.get("repeat", 0) + offset} for run in row[mode]["runs"][:keep]]
                results.setdefault(point, {}).setdefault(mode, []).extend(runs)
                repeats += [run.get("repeat", 0) for run in row[mode]["runs"]]
        startups += [{**s, "repeat": s["repeat"] + offset} for s in d["startups"]]
        offset += max(repeats, default=-1) + 1
    settings = argparse.Namespace(**{k: saved[0].get(k) for k in MERGE_SAME}, repeats=offset)
    rows = []
    for workload in dict.fromkeys(w for w, _ in results):
        settings.concurrency = [c for w, c in results if w == workload]
        by_mode = {(m, c): runs for (w, c), per in results.items() if w == workload for m, runs in per.items()}
        for row in point_rows(settings, workload, by_mode, {}):
            row["decode_attention"] = attention[workload, row["concurrency"]]
            rows.append(row)
    return settings, rows, startups


def save(args, rows, startups, partial=False, **extra):
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**extra, "tp": args.tp, "model": args.model, "tiny": args.tiny, "layers": args.layers,
                   "mtp_step": args.mtp_step, "mtp_head": args.mtp_head if args.model == "qwen3.5" else None,
                   "decode_backend": args.decode_backend, "requests": args.requests,
                   "output_tokens": args.output_tokens, "warmup": args.warmup, "rate": args.rate, "seed": args.seed,
                   "repeats": args.repeats, "rounds": args.rounds,
                   "control": args.control, "compare": args.compare, "client_procs": args.client_procs,
                   "pin_cores": args.pin_cores, "cores_per_server": args.cores_per_server,
                   "idle_cores": None if getattr(args, "idle_cores", None) is None else sorted(args.idle_cores),
                   "config_checks_ok": not any(s.get("config_check") for s in startups),
                   "tuned_config_files": tuned_config_files(startups), "partial": partial, "rows": rows,
                   "startups": startups},
                  f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
