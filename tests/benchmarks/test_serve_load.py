"""serve_load's plan and its reading of the tuned files (the GPU run itself is a benchmark, not a test)."""

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import types
from http.server import BaseHTTPRequestHandler

import pytest
import torch

from lightllm.common import proc as procs
from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func
from lightllm.kernels.attention.decode import flash_decode, gqa_decode_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(REPO, "benchmarks", "serve_load.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def load_client(serve_load):
    import load_client  # serve_load put benchmarks/ on sys.path

    return load_client


@pytest.mark.parametrize("control", [False, True])
def test_start_order_tunes_first_then_rotates(serve_load, control):
    modes = ["on", "off"] + (["off_b"] if control else [])
    orders = [serve_load.start_order(rep, control) for rep in range(len(modes))]
    assert orders[0][0] == "on"  # the start that tunes comes before any start that copies its files
    assert all(sorted(o) == sorted(modes) for o in orders)
    for position in range(len(modes)):  # over len(modes) repeats every mode starts once at every position
        assert sorted(o[position] for o in orders) == sorted(modes)


def test_the_request_schedule_is_fixed_by_its_seed(load_client):
    """Every server of a comparison gets the same prompts at the same arrival offsets; warm-up takes another seed."""
    a = load_client.request_schedule(0, 50, 8, 1000, rate=20.0)
    assert a == load_client.request_schedule(0, 50, 8, 1000, rate=20.0)
    assert a != load_client.request_schedule(1, 50, 8, 1000, rate=20.0)
    arrivals, prompts = a
    assert arrivals[0] == 0 and all(x < y for x, y in zip(arrivals, arrivals[1:]))  # Poisson: strictly later
    assert len(prompts) == 50 and all(len(p) == 8 and all(125 <= t < 1000 for t in p) for p in prompts)
    closed, _ = load_client.request_schedule(0, 5, 8, 1000)  # rate 0: all at once, the concurrency paces them
    assert closed == [0.0] * 5


def test_percentile_is_nearest_rank(load_client):
    values = list(range(1, 101))
    assert [load_client.percentile(values, q) for q in (50, 99, 100)] == [50, 99, 100]
    assert load_client.percentile([3.0], 99) == 3.0 and load_client.percentile([], 50) is None


def test_server_sent_events_are_parsed_across_and_within_network_reads(load_client):
    """Events split over reads, several in one read, and the OpenAI end marker: each event once, stamped with the
    read that completed it."""
    import asyncio

    events = [{"token": {"id": i, "logprob": -0.5 * i}} for i in range(5)]
    wire = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    cuts = [0, 7, 8, 60, 61, len(wire) - 3, len(wire)]  # mid-field, one byte, mid-separator, several events

    class Response:
        async def aiter_bytes(self):
            for a, b in zip(cuts, cuts[1:]):
                yield wire[a:b]

    async def read():
        return [e async for _, e in load_client.sse_events(Response())]

    assert asyncio.run(read()) == events


def test_tokens_of_one_read_share_the_interval_since_the_read_before(load_client):
    """Two tokens with the first read, three in the next read a second later, one more 0.6 s after: the three
    each get a third of that second (not 1 s and two zeros), the last its 0.6 s."""
    gaps = load_client.token_gaps([1.0, 1.0, 2.0, 2.0, 2.0, 2.6])
    assert gaps == pytest.approx([1 / 3] * 3 + [0.6])
    assert load_client.token_gaps([0.5, 0.7, 1.0]) == pytest.approx([0.2, 0.3])  # one token per read: plain gaps
    assert load_client.token_gaps([]) == [] and load_client.token_gaps([1.0, 1.0]) == []


def test_a_load_split_over_client_processes_keeps_every_request_and_stream(load_client):
    assert [load_client.auto_client_procs(c) for c in (1, 4, 5, 16, 32, 256)] == [1, 1, 2, 4, 8, 8]
    arrivals, prompts = load_client.request_schedule(0, 10, 4, 100, rate=5.0)
    for concurrency, parts, shares in ((64, 4, [16] * 4), (10, 3, [4, 3, 3]), (2, 2, [1, 1])):
        dealt = load_client.deal(arrivals, prompts, concurrency, parts)
        assert [share for *_, share in dealt] == shares
        got = sorted((a, p) for arr, prm, _ in dealt for a, p in zip(arr, prm))
        assert got == sorted(zip(arrivals, prompts))  # every request once, with its own arrival
        assert all(arr == sorted(arr) for arr, _, _ in dealt)  # each process sends in schedule order


class HealthHandler(BaseHTTPRequestHandler):
    """A stand-in server's handler: every GET an empty 200 on a kept-alive connection, as the real server's /health."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_every_request_of_a_load_goes_out_on_a_connection_opened_before_the_clock(load_client, monkeypatch):
    """A process's first request imports the rest of the HTTP stack and a new connection is set up on the way: both
    were counted as time to first token (the H200's TTFT p99 read 160-190 ms at 60 requests/s, p50 8-12 ms). So each
    client opens its pool's connections before its clock starts, and the load's requests find them open."""
    import asyncio
    import threading
    from http.server import ThreadingHTTPServer

    ports = []  # the client port of every request, in the order they came

    class Handler(HealthHandler):
        def do_GET(self):
            ports.append(self.client_address[1])
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    opened = []

    async def one(client, base, prompt, out_len, stream, api):  # a request of the load: the same pool, another GET
        if not opened:
            opened.extend(ports)  # what the warm-up opened, before the first request of the load
        await asyncio.sleep(0.01)  # in flight together, as streams are
        (await client.get(base + "/health")).raise_for_status()
        return out_len, True, 0.0, [], 0.0

    monkeypatch.setattr(load_client, "_one", one)
    try:
        out = asyncio.run(load_client._shard(base, [0.0] * 12, [[1]] * 12, 4, 3, True, "native", 0.0))
    finally:
        server.shutdown()
    assert len(out["results"]) == 12 and len(opened) == 4 and len(set(opened)) == 4
    assert set(ports[4:]) <= set(opened), "a request of the load opened a connection of its own"


def test_a_loads_seconds_leave_out_the_connections_opened_before_its_clock(load_client, monkeypatch):
    """Throughput is over the load's own time: a warm-up that opens the pool's connections (slow here: 1 s) comes
    before the clock starts, so it must not be in ``seconds`` (the load itself: three 0.1 s requests at once)."""
    import asyncio

    async def slow_open(client, base, n):
        await asyncio.sleep(1.0)

    async def one(client, base, prompt, out_len, stream, api):
        await asyncio.sleep(0.1)
        return out_len, True, 0.01, [], 0.005

    async def steps(base):
        return {}

    monkeypatch.setattr(load_client, "open_connections", slow_open)
    monkeypatch.setattr(load_client, "_one", one)
    monkeypatch.setattr(load_client, "engine_steps", steps)
    out = asyncio.run(load_client.load("http://127.0.0.1:9", 3, 3, 2, 4, 100))
    assert out["output_tokens"] == 12 and 0.1 <= out["seconds"] < 1.0, out["seconds"]
    assert out["ttft_mean_ms"] == pytest.approx(10.0) and out["headers_mean_ms"] == pytest.approx(5.0)


def test_a_server_that_does_not_answer_fails_a_split_load_with_its_own_error(load_client, monkeypatch):
    """Nothing listens at ``base``: each client process's first request fails. The load raises that error, not a
    broken start barrier after ``_START_TIMEOUT_S`` (the pool replacing every client process that failed)."""
    import asyncio
    import socket

    import httpx

    async def steps(base):
        return {}

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(load_client, "engine_steps", steps)
    monkeypatch.setattr(load_client, "_START_TIMEOUT_S", 60.0)  # this process's wait at the barrier
    with pytest.raises(httpx.ConnectError):
        asyncio.run(load_client.load(base, 4, 4, 3, 5, 100, client_procs=2))


def test_a_split_load_cancelled_while_its_requests_wait_ends_and_stops_its_client_processes(load_client, monkeypatch):
    """SIGTERM (a device call's ``timeout``) cancels the load while its client processes wait on a server that never
    answers. Leaving the pool terminates them; the load must then end: a ``pool.map`` on an executor thread never
    returned from a terminated pool, and ``asyncio.run`` waited for that thread forever (a stopped serve_load kept
    its device call busy until the call's own limit)."""
    import asyncio
    import threading
    from http.server import ThreadingHTTPServer

    posted = threading.Semaphore(0)

    class Handler(HealthHandler):  # GET (the warm-up, the opened connections) answered
        def do_POST(self):  # a load's request: never answered
            posted.release()
            threading.Event().wait()

    async def steps(base):
        return {}

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(load_client, "engine_steps", steps)

    async def main():
        task = asyncio.ensure_future(load_client.load(base, 4, 4, 3, 5, 100, stream=True, client_procs=2))
        while not posted.acquire(blocking=False):  # both client processes have sent a request of the load
            await asyncio.sleep(0.05)
        while not posted.acquire(blocking=False):
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    done = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    done.start()
    done.join(procs.HANG_TIMEOUT_S / 10)  # minutes for what ends at once; before, it never ended
    server.shutdown()
    assert not done.is_alive(), "the cancelled load did not end"


def test_per_step_attention_reads_what_a_search_wrote(serve_load, monkeypatch, isolated_autotune):
    """A real decode-attention search (interpreter, stubbed timer: the default takes 2 ms, every candidate
    1 ms) writes its config file; the benchmark reads tuned and default time per graph batch back from it."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q: [{"BLOCK_N": 256, "num_warps": 2, "num_stages": 1,
                                                               "WAVES": 1}])  # fmt: skip
    calls = []

    def bench(run_fn):
        run_fn()
        calls.append(run_fn)
        # two lengths (1024, 512): the default is timed first and, after the candidate's re-timing, last
        return 2.0 if len(calls) <= 2 or len(calls) > 6 else 1.0

    set_bench_func(bench)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k, v = torch.randn(512, 2, 64, generator=g), torch.randn(512, 2, 64, generator=g)
    r2t = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        gqa_decode_attention(q, k, v, r2t, torch.tensor([0, 2], dtype=torch.int32),
                             torch.tensor([3, 8], dtype=torch.int32), 2048)  # fmt: skip
    tuned.clear_cache()
    assert len(calls) == 8
    timings = serve_load.decode_attention_timings(isolated_autotune)
    assert timings == {("gqa_flash_decode", 2): (1.0, 2.0)}
    assert serve_load.per_step_attention(timings, 2, layers=4) == {"tuned_ms": 4.0, "default_ms": 8.0, "layers": 4}
    assert serve_load.per_step_attention(timings, 16, layers=4) is None  # no graph of that batch was tuned


def _benchmark(tmp_path, *args):
    """The command line and environment of serve_load.py on the tiny model, its temporary folders in tmp_path."""
    (tmp_path / "tmp").mkdir()
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "serve_load.py"), "--tiny", "--log-dir",
           str(tmp_path / "logs"), "--out", str(tmp_path / "out.json"), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path / "tmp"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "unused"),
           "LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH": "1e9"}  # no search is cut short on a busy machine  # fmt: skip
    return cmd, env


def _left_behind(tmp_path):
    """The benchmark's temporary folders (tempfile's tmp*) still there; torch's own caches (torchinductor_*) aside."""
    return [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("tmp")]


def test_runs_end_to_end_on_the_tiny_model(tmp_path):
    """The whole method on the CPU: servers started in order, every request whole, an A/A pair, JSON written, no
    temporary folder left (at tp 2 the ranks' config agreement is read from the start's log: the stopping test)."""
    cmd, env = _benchmark(tmp_path, "--requests", "3", "--concurrency", "2", "--repeats", "1", "--control",
                          "--workloads", "short", "--client-procs", "2", "--output-tokens", "32")  # fmt: skip
    out = tmp_path / "out.json"
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _left_behind(tmp_path) == []
    result = json.loads(out.read_text())
    assert [(s["mode"], s["repeat"]) for s in result["startups"]] == [("on", 0), ("off", 0), ("off_b", 0)]
    assert all(s["ranks"] is None for s in result["startups"])  # one rank: nothing to agree on
    (row,) = result["rows"]
    assert row["concurrency"] == 2 and result["control"] is True
    assert result["warmup"] is None and result["seed"] == 0  # default warm-up: 2 x concurrency requests
    assert result["output_tokens"] == 32  # the short workload's prompts, shorter outputs
    for mode in ("on", "off", "off_b"):
        (run,) = row[mode]["runs"]
        # the warm-up's 4 requests are left out: only the 3 measured ones are counted, here and in the steps
        assert run["all_complete_finite"] and run["output_tokens"] == 3 * 32
        assert run["client_procs"] == 2 and 0 < run["client_cpu_pct"] and 0 < run["engine_busy_pct"] <= 100
        # the server's two processes' CPU shares over the load, from their /metrics counters (the engine computed
        # every step on this CPU: more than the counters' 10 ms tick)
        assert run["http_cpu_pct"] is not None and run["engine_cpu_pct"] > 0
        # and how the HTTP process was scheduled over it (counts, from /proc); the round it was measured in
        assert run["http_involuntary_switches"] >= 0 and run["round"] == 0
        assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"] and 0 < run["itl_p50_ms"] <= run["itl_p99_ms"]
        # from the server's step histograms: each request's first token comes from its prefill, the rest
        # from decode steps, and every step of the load is counted once
        assert round(run["prefill_batch"] * run["prefill_steps"]) == 3
        assert round(run["decode_batch"] * run["decode_steps"]) == 3 * 31
        assert run["decode_step_ms"] > 0 and 1 <= run["decode_batch"] <= 2
        assert run["decode_gpu_ms"] is None  # CUDA events only: a CPU step is all host time
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == [
        "server_tp1_short_off0.log", "server_tp1_short_off_b0.log", "server_tp1_short_on0.log"]  # fmt: skip
    assert "off_b vs off" in done.stdout and row["on"]["decode_step_ms"] > 0
    # the A/A difference of every reported number at this point
    assert set(row["aa_pct"]) == {"tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                                  "decode_step_ms", "decode_gpu_ms"}  # fmt: skip
    assert row["aa_pct"]["decode_gpu_ms"] is None
    # time to first token over every measured request, and the A/A's bootstrap interval, printed too
    assert all(row[m]["ttft_pooled"]["requests"] == 3 for m in ("on", "off", "off_b"))
    assert set(row["aa_ttft_pooled"]) == {"p50", "p99", "mean", "starts"} and "bootstrap interval" in done.stdout
    assert row["aa_pct"]["itl_p50_ms"] == pytest.approx(
        (row["off_b"]["itl_p50_ms"] / row["off"]["itl_p50_ms"] - 1) * 100
    )


def test_rounds_run_the_servers_side_by_side_in_rotating_order(tmp_path):
    """--rounds: every server of the repeat is up before the first load; each point is measured in rounds that visit
    every server once, in a rotating order (two servers here, to keep the CPU run short; --control adds a third)."""
    cmd, env = _benchmark(tmp_path, "--requests", "2", "--concurrency", "2", "--repeats", "1", "--rounds", "2",
                          "--workloads", "short", "--warmup", "0", "--output-tokens", "32")  # fmt: skip
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _left_behind(tmp_path) == []
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    starts = [(ln["mode"], ln["repeat"]) for ln in lines if "startup_s" in ln]
    loads = [(ln["round"], ln["mode"]) for ln in lines if "concurrency" in ln]
    assert starts == [("on", 0), ("off", 0)]
    assert [ln for ln in lines if "startup_s" in ln] == lines[:2]  # both up before any load
    assert loads == [(0, "on"), (0, "off"), (1, "off"), (1, "on")]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["rounds"] == 2 and result["config_checks_ok"]
    (row,) = result["rows"]
    for mode in ("on", "off"):
        runs = row[mode]["runs"]
        assert len(runs) == 2 and all(r["all_complete_finite"] and r["output_tokens"] == 2 * 32 for r in runs)
    assert "2 rounds (servers side by side)" in done.stdout
    # each server got its own KV pool, sized for the load (not a fraction of the machine)
    log = (tmp_path / "logs" / "server_tp1_short_off0.log").read_text()
    assert "-> 561 tokens x" in log  # concurrency 2 x (128 + 32 + 64) tokens x 5 / 4, + 1


def test_every_point_and_round_has_its_own_schedule_and_warm_up(serve_load):
    """A server's prefix cache must never serve a measured schedule it saw before (another round or concurrency, or
    a warm-up)."""
    measured = [serve_load.point_seed(7, ci, r) for ci in range(3) for r in range(6)]
    warm_ups = [serve_load.point_seed(7, ci, 0) + 1 for ci in range(3)]
    assert measured[0] == 7 and len(set(measured + warm_ups)) == len(measured) + len(warm_ups)


def test_pooled_time_to_first_token_takes_every_request_of_every_run(serve_load):
    runs = [{"ttft_samples_ms": [4.0, 1.0, 3.0]}, {"ttft_samples_ms": [2.0]}, {"ttft_samples_ms": []}, {}]
    assert serve_load.pooled_ttft(runs) == {"requests": 4, "p50_ms": 2.0, "p99_ms": 4.0, "mean_ms": 2.5}
    assert serve_load.pooled_ttft([{}, {"ttft_samples_ms": []}]) is None  # a load that did not stream


def test_the_pooled_a_a_interval_brackets_a_known_shift_and_is_seeded(serve_load):
    rng = random.Random(1)
    a = [{"ttft_samples_ms": [rng.uniform(3.0, 9.0) for _ in range(400)]} for _ in range(3)]
    b = [{"ttft_samples_ms": [x * 1.1 for x in run["ttft_samples_ms"]]} for run in a]  # every request 10 % later
    got = serve_load.aa_ttft_interval(a, b, resamples=200)
    for stat in ("p50", "p99", "mean"):
        assert got[stat]["pct"] == pytest.approx(10.0)
        low, high = got[stat]["ci95"]
        assert low < 10.0 < high and high - low < 10.0
    assert serve_load.aa_ttft_interval(a, b, resamples=200) == got  # the same seed, the same interval
    same = serve_load.aa_ttft_interval(a, a, resamples=200)
    assert all(same[s]["pct"] == 0.0 and same[s]["ci95"][0] < 0.0 < same[s]["ci95"][1] for s in ("p50", "p99", "mean"))
    assert same["starts"] == 1  # runs without a start index: one start
    assert serve_load.aa_ttft_interval(a, [{}]) is None


def test_the_pooled_a_a_interval_resamples_within_each_run(serve_load):
    """Two rounds that differ in level (a round's schedule and its server's state) keep their shares in every
    resample: identical servers then read identical means in every draw, where a resample over the pooled requests
    would move each server's mean on its own."""
    runs = [{"ttft_samples_ms": [1.0] * 20}, {"ttft_samples_ms": [3.0] * 20}]
    got = serve_load.aa_ttft_interval(runs, runs, resamples=200)
    assert got["mean"] == {"pct": 0.0, "ci95": [0.0, 0.0]}


def test_the_pooled_a_a_interval_holds_the_rounds_disagreement(serve_load):
    """Server b 8 % slower than a in one round, level in the next, 8 % faster in the third: pooled they agree, but
    three rounds cannot tell a 5 % difference from none, so the interval must span it (requests resampled only
    within runs would read about +-1.5 %)."""
    rng = random.Random(2)
    a = [{"ttft_samples_ms": [rng.uniform(3.0, 9.0) for _ in range(400)]} for _ in range(3)]
    b = [{"ttft_samples_ms": [x * f for x in run["ttft_samples_ms"]]} for run, f in zip(a, (1.08, 1.0, 0.92))]
    low, high = serve_load.aa_ttft_interval(a, b, resamples=400)["mean"]["ci95"]
    assert low < -5.0 and high > 5.0, (low, high)
    paired = [{"ttft_samples_ms": [x * f for x in run["ttft_samples_ms"]]} for run, f in zip(a, (1.0, 3.0, 0.5))]
    got = serve_load.aa_ttft_interval(paired, paired, resamples=400)["mean"]  # rounds apart, servers alike
    assert got["pct"] == 0.0 and -3.0 < got["ci95"][0] < 0.0 < got["ci95"][1] < 3.0, got


def test_the_pooled_a_a_interval_holds_how_server_starts_differ(serve_load):
    """Server b 8 % slower than a in every round of the first start and 8 % faster in every round of the second (a
    process's own state, as the H200 showed at concurrency 64): rounds agree within each start, so only resampling
    the starts shows that two starts cannot resolve 5 %. One start alone reads its +8 % as resolved, and says it had
    one start."""
    rng = random.Random(3)
    a = [{"repeat": rep, "ttft_samples_ms": [rng.uniform(3.0, 9.0) for _ in range(300)]}
         for rep in (0, 1) for _ in range(3)]  # fmt: skip
    b = [{**run, "ttft_samples_ms": [x * (1.08 if run["repeat"] == 0 else 0.92) for x in run["ttft_samples_ms"]]}
         for run in a]  # fmt: skip
    got = serve_load.aa_ttft_interval(a, b, resamples=400)
    low, high = got["mean"]["ci95"]
    assert got["starts"] == 2 and low < -5.0 and high > 5.0, got
    first = serve_load.aa_ttft_interval(a[:3], b[:3], resamples=400)
    assert first["starts"] == 1 and 0.0 < first["mean"]["ci95"][0] < 8.0 < first["mean"]["ci95"][1] < 12.0, first


def test_a_stopped_run_keeps_the_points_every_server_measured(serve_load):
    """Stopped in the middle of concurrency 4 (its "off_b" not yet loaded): concurrency 2 is a row, 4 is not."""

    def run(tps, ttft):
        return {"tokens_per_s": tps, "all_complete_finite": True, "ttft_samples_ms": [ttft, ttft + 1.0]}

    results = {(mode, 2): [run(100.0, 5.0), run(110.0, 6.0)] for mode in ("on", "off", "off_b")}
    results.update({("on", 4): [run(200.0, 5.0)], ("off", 4): [run(190.0, 5.0)]})
    args = types.SimpleNamespace(control=True, compare="tuning", concurrency=[2, 4], tp=1, model="qwen3", layers=4)
    rows = serve_load.point_rows(args, "short", results, {})
    assert [r["concurrency"] for r in rows] == [2]
    assert rows[0]["on"]["tokens_per_s"] == 105.0 and rows[0]["aa_ttft_pooled"]["mean"]["pct"] == 0.0
    args.control = False  # without the A/A server, 4 is whole
    assert [r["concurrency"] for r in serve_load.point_rows(args, "short", results, {})] == [2, 4]


def test_compare_none_makes_on_and_off_the_a_a_pair(serve_load):
    """Two servers started alike: their difference is reported as the A/A (every number and the pooled interval);
    with --control the A/A stays off_b vs off."""

    def run(tps, ttft):
        return {"tokens_per_s": tps, "all_complete_finite": True, "ttft_samples_ms": [ttft, ttft + 1.0, ttft + 2.0]}

    results = {("on", 2): [run(110.0, 6.0)], ("off", 2): [run(100.0, 5.0)], ("off_b", 2): [run(100.0, 5.0)]}
    args = types.SimpleNamespace(control=False, compare="none", concurrency=[2], tp=1, model="qwen3", layers=4)
    (row,) = serve_load.point_rows(args, "short", results, {})
    assert "off_b" not in row and row["aa_pct"]["tokens_per_s"] == pytest.approx(10.0)
    assert row["aa_ttft_pooled"]["p50"]["pct"] == pytest.approx(100 * (7.0 / 6.0 - 1))
    args.control = True
    (row,) = serve_load.point_rows(args, "short", results, {})
    assert row["aa_pct"]["tokens_per_s"] == 0.0 and row["aa_ttft_pooled"]["p50"]["pct"] == 0.0
    args.control, args.compare = False, "tuning"  # on and off differ: no A/A pair
    (row,) = serve_load.point_rows(args, "short", results, {})
    assert "aa_pct" not in row and "aa_ttft_pooled" not in row


def _saved_run(serve_load, path, factors, off_runs=1, **changed):
    """A saved --control run at concurrency 2, one start per factor: in start i every off_b request takes factors[i]
    times its off twin (a start's own state), "on" as "off"; "off" measured ``off_runs`` times a start, the others
    once (a run stopped between them)."""
    rng = random.Random(len(factors) * 10 + off_runs)
    results, startups = {}, []
    for rep, factor in enumerate(factors):
        for i in range(off_runs):
            samples = [rng.uniform(3.0, 9.0) for _ in range(200)]
            for mode, f in (("on", 1.0), ("off", 1.0), ("off_b", factor)) if i == 0 else (("off", 1.0),):
                run = {"repeat": rep, "tokens_per_s": 100.0 / f, "all_complete_finite": True, "client_cpu_pct": 10.0,
                       "ttft_samples_ms": [x * f for x in samples]}  # fmt: skip
                results.setdefault((mode, 2), []).append(run)
        startups += [{"workload": "short", "mode": m, "repeat": rep, "startup_s": 1.0, "summary": "-", "ranks": None,
                      "config_files_written": [], "config_check": None} for m in ("on", "off", "off_b")]  # fmt: skip
    settings = dict(tp=1, model="qwen3", tiny=False, layers=4, mtp_step=0, mtp_head="agree", decode_backend="triton",
                    requests=200, output_tokens=None, warmup=None, rate=0.0, seed=0, rounds=0, control=True,
                    compare="tuning", client_procs=None, pin_cores=False, cores_per_server=None, concurrency=[2],
                    repeats=len(factors), out=str(path))  # fmt: skip
    args = types.SimpleNamespace(**{**settings, **changed})
    serve_load.save(args, serve_load.point_rows(args, "short", results, {}), startups)
    return str(path)


def test_merged_runs_draw_the_a_a_interval_from_every_start(serve_load, tmp_path, monkeypatch, capsys):
    """Two device calls' runs, one start each: off_b 8 % slower in the first, 8 % faster in the second. Each alone
    reads its 8 % as resolved; merged, their starts are numbered apart and the interval spans both."""
    first = _saved_run(serve_load, tmp_path / "a.json", [1.08])
    second = _saved_run(serve_load, tmp_path / "b.json", [0.92], off_runs=2)  # "off" once more than off_b
    for path, sign in ((first, 1), (second, -1)):
        low, high = json.loads(open(path).read())["rows"][0]["aa_ttft_pooled"]["mean"]["ci95"]
        assert sign * low > 0 and sign * high > 0  # one start: "resolved"
    out = tmp_path / "merged.json"
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--merge", first, second, "--out", str(out)])
    serve_load.main()
    merged = json.loads(out.read_text())
    (row,) = merged["rows"]
    assert merged["merged_from"] == [first, second] and merged["repeats"] == 2
    assert [s["repeat"] for s in merged["startups"]] == [0, 0, 0, 1, 1, 1]
    # the second file's extra "off" run is left out: each start pairs its one off run with its one off_b run
    assert {m: [r["repeat"] for r in row[m]["runs"]] for m in ("on", "off", "off_b")} == {
        "on": [0, 1], "off": [0, 1], "off_b": [0, 1]}  # fmt: skip
    pooled = row["aa_ttft_pooled"]
    assert pooled["starts"] == 2 and pooled["mean"]["ci95"][0] < -5.0 and pooled["mean"]["ci95"][1] > 5.0, pooled
    assert row["off"]["ttft_pooled"]["requests"] == 400
    assert "A/A time to first token" in capsys.readouterr().out


def test_runs_of_different_methods_do_not_merge(serve_load, tmp_path, monkeypatch, capsys):
    first = _saved_run(serve_load, tmp_path / "a.json", [1.0])
    other = _saved_run(serve_load, tmp_path / "b.json", [1.0], requests=100)
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--merge", first, other, "--out", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit) as e:
        serve_load.main()
    assert e.value.code == 2 and not (tmp_path / "m.json").exists()
    assert "--merge: file 2 has requests=100 and file 1 200; only runs of one method merge" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "--merge", first, str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):
        serve_load.main()
    assert f"--merge {tmp_path / 'bad.json'}: cannot read a saved run" in capsys.readouterr().err


def test_three_rounds_put_each_of_three_servers_at_every_position(serve_load):
    orders = [serve_load.round_order(["on", "off", "off_b"], r) for r in range(3)]
    assert orders == [["on", "off", "off_b"], ["off", "off_b", "on"], ["off_b", "on", "off"]]
    assert serve_load.round_order(["on", "off", "off_b"], 3) == orders[0]  # then it starts over


@pytest.mark.parametrize("rep", [0, 1])
def test_side_by_side_servers_start_together_after_the_tuning_start(serve_load, monkeypatch, rep):
    """With --rounds the tuning start ("on" at repeat 0) comes up alone first; the other servers are all spawned
    before any is waited for. A server that never answers stops every server spawned with it."""
    events = []

    def launch(args, model, workload, cfg, mode, rep, flags, position=0):
        events.append(("spawn", mode))
        proc = types.SimpleNamespace(mode=mode, pid=os.getpid())  # a live pid: its scheduling counts are read
        return proc, f"http://{mode}", {"mode": mode, "repeat": rep}, {}

    def finish_start(proc, base, start):
        events.append(("ready", proc.mode))
        if proc.mode == "off_b" and rep == 1:
            raise RuntimeError("off_b never answered")

    monkeypatch.setattr(serve_load, "launch", launch)
    monkeypatch.setattr(serve_load, "finish_start", finish_start)
    monkeypatch.setattr(serve_load, "run_load", lambda *a, **k: {"tokens_per_s": 1.0})
    stopped = []
    monkeypatch.setattr(serve_load, "stop_all", lambda alive, cfg: stopped.extend(m for m, *_ in alive))
    args = argparse.Namespace(
        compare="tuning", concurrency=[2], warmup=0, rounds=3, server_cores=None, requests=1, seed=0, rate=0.0
    )
    modes = serve_load.start_order(rep, True)
    startups, results = [], {}

    def run():
        serve_load.run_servers(args, "model", "short", 8, {}, rep, [], results, startups, modes, [0, 1, 2])

    if rep == 0:
        run()
        assert events == [("spawn", "on"), ("ready", "on"), ("spawn", "off"), ("spawn", "off_b"), ("ready", "off"),
                          ("ready", "off_b")]  # fmt: skip
        assert [s["mode"] for s in startups] == ["on", "off", "off_b"] and len(results[("off_b", 2)]) == 3
    else:
        with pytest.raises(RuntimeError, match="off_b never answered"):
            run()
        assert [e for e, _ in events] == ["spawn"] * 3 + ["ready"] * 2  # nothing tunes: all three at once
        assert not results
    assert sorted(stopped) == ["off", "off_b", "on"]


def test_output_tokens_below_two_is_a_one_line_error(tmp_path):
    cmd, env = _benchmark(tmp_path, "--output-tokens", "1")
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 2
    assert "--output-tokens expected at least 2 (a prefill token and a decode step), got 1" in done.stderr


def test_rounds_must_give_every_server_every_position(tmp_path):
    cmd, env = _benchmark(tmp_path, "--rounds", "4", "--control")
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 2
    assert "--rounds expected 0 (one server at a time) or a multiple of the 3 servers" in done.stderr
    assert "got 4" in done.stderr


def test_the_tiny_model_takes_the_short_workload_only(tmp_path):
    """The long workload's 8K prompts do not fit the tiny model's 4096-token context: one line at once, not a server
    that fails to start after the short workload has run."""
    cmd, env = _benchmark(tmp_path, "--workloads", "short", "long")
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "--workloads long expected a model with an 8384-token context; --tiny's has 4096 (use --workloads short)"
        )
    )


def test_pinned_cores_give_each_server_its_own_and_the_clients_the_rest(serve_load):
    def alone(cpu):  # no SMT: every logical CPU a physical core
        return {cpu}

    servers, clients, idle = serve_load.core_plan(range(15, -1, -1), servers=3, tp=1, siblings=alone)
    assert servers == [{0, 1}, {2, 3}, {4, 5}] and clients == set(range(6, 16)) and idle == set()
    servers, clients, _ = serve_load.core_plan(range(8), servers=2, tp=2, siblings=alone)  # HTTP + two engine ranks
    assert servers == [{0, 1, 2}, {3, 4, 5}] and clients == {6, 7}
    servers, clients, _ = serve_load.core_plan(range(16), servers=3, tp=1, per=3, siblings=alone)  # per server 3
    assert servers == [{0, 1, 2}, {3, 4, 5}, {6, 7, 8}] and clients == set(range(9, 16))
    with pytest.raises(ValueError, match=r"--pin-cores expected at least 6 physical CPU cores \(3 servers x 2\) and "
                       r"2 more CPUs for the load clients, this process may run on 7$"):  # fmt: skip
        serve_load.core_plan(range(7), servers=3, tp=1, siblings=alone)


def test_a_pinned_server_runs_on_whole_physical_cores_and_leaves_their_smt_siblings_idle(serve_load):
    """16 logical CPUs on 8 physical cores, siblings i and i + 8 (as Linux numbers them on most x86 servers): a
    server's HTTP process and engine each get a physical core, neither shares it with a client or the other server,
    and the clients get every logical CPU of the physical cores left."""

    def pairs(cpu):
        return {cpu % 8, cpu % 8 + 8}

    servers, clients, idle = serve_load.core_plan(range(16), servers=2, tp=1, siblings=pairs)
    assert servers == [{0, 1}, {2, 3}] and idle == {8, 9, 10, 11}
    assert clients == {4, 5, 6, 7, 12, 13, 14, 15}
    # siblings numbered next to each other (0-1, 2-3, ...): the same, one CPU of each pair
    servers, clients, idle = serve_load.core_plan(range(16), servers=2, tp=1, siblings=lambda c: {c & ~1, c | 1})
    assert servers == [{0, 2}, {4, 6}] and idle == {1, 3, 5, 7} and clients == set(range(8, 16))
    # only the CPUs this process may run on count, and the error names the physical cores
    with pytest.raises(ValueError, match=r"at least 6 physical CPU cores \(3 servers x 2\) and 2 more CPUs for the "
                       r"load clients, this process may run on 12 in 6 physical cores$"):  # fmt: skip
        serve_load.core_plan([0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], servers=3, tp=1, siblings=pairs)


def test_the_siblings_of_a_cpu_come_from_linux_topology_or_it_stands_alone(serve_load, monkeypatch):
    import builtins

    real_open = builtins.open

    def fake_open(path, *a, **k):
        if str(path).endswith("cpu3/topology/thread_siblings_list"):
            import io

            return io.StringIO("3,11\n")
        if str(path).endswith("cpu5/topology/thread_siblings_list"):
            import io

            return io.StringIO("4-5\n")
        if "topology" in str(path):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert serve_load.cpu_siblings(3) == {3, 11} and serve_load.cpu_siblings(5) == {4, 5}
    assert serve_load.cpu_siblings(7) == {7}  # unreadable: alone


def test_a_pinned_process_and_its_children_run_on_their_cores_only(serve_load):
    core = min(os.sched_getaffinity(0))
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " + (
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    with procs.running([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                       **serve_load.pin_kwargs({core})) as proc:  # fmt: skip
        out, _ = proc.communicate(timeout=procs.HANG_TIMEOUT_S)
    assert out.split() == [f"[{core}]", f"[{core}]"]
    assert serve_load.pin_kwargs(None) == {}


def test_core_sets_rotate_every_round_so_each_server_runs_on_each_set(serve_load):
    sets = [{0, 1}, {2, 3}, {4, 5}]
    for rnd in range(3):
        assert [serve_load.round_cores(sets, pos, rnd) for pos in range(3)] == sets[rnd:] + sets[:rnd]
    assert {frozenset(serve_load.round_cores(sets, 1, rnd)) for rnd in range(3)} == {frozenset(c) for c in sets}


def test_repinning_moves_every_thread_of_a_running_process_and_of_its_children(serve_load):
    """A server's tree (an HTTP process, engine ranks, their threads) moves to a round's cores while it runs."""
    everywhere, last = os.sched_getaffinity(0), max(os.sched_getaffinity(0))
    assert len(everywhere) >= 2, "this test moves a process between cores: it needs two"
    # each process: a second thread, and both wait until the group is stopped (however slow the machine)
    sleeper = "import threading; threading.Thread(target=threading.Event().wait, daemon=True).start(); "
    child = sleeper + "threading.Event().wait()"
    parent = sleeper + f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {child!r}]); print(1); "
    parent += "sys.stdout.flush(); threading.Event().wait()"
    with procs.running([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "1"
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while True:  # the child and both sleeping threads up
            tasks = {pid: os.listdir(f"/proc/{pid}/task") for pid in tree_pids(proc.pid)}
            if len(tasks) == 2 and all(len(t) >= 2 for t in tasks.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(tasks) == 2, tasks
        serve_load.repin_tree(proc.pid, {last})
        moved = {int(tid): os.sched_getaffinity(int(tid)) for pid, tids in tasks.items() for tid in tids}
    assert len(moved) >= 4 and all(cores == {last} for cores in moved.values()), moved


def tree_pids(pid):
    """``pid`` and every process under it, from /proc."""
    out, stack = [], [pid]
    while stack:
        out.append(stack.pop())
        for tid in os.listdir(f"/proc/{out[-1]}/task"):
            with open(f"/proc/{out[-1]}/task/{tid}/children") as f:
                stack.extend(int(c) for c in f.read().split())
    return out


def test_pin_cores_on_too_few_cores_is_a_one_line_error(serve_load, tmp_path):
    cmd, env = _benchmark(tmp_path, "--pin-cores", "--control")
    one_core = serve_load.pin_kwargs({min(os.sched_getaffinity(0))})  # whatever this machine has
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=procs.HANG_TIMEOUT_S, **one_core)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith("--pin-cores expected at least 6 physical CPU cores (3 servers x 2) and 2 more CPUs for the "
                         "load clients, this process may run on 1"), last  # fmt: skip


def test_stopping_the_benchmark_stops_its_server_and_removes_its_folders(tmp_path):
    """SIGTERM (what procs.stop, a timeout or a CI runner sends) while a server is under load: the benchmark
    stops its server and removes its temporary model and config folders before it exits. At tp 2, the start's
    record has the ranks' config agreement, read from its log."""
    cmd, env = _benchmark(tmp_path, "--tp", "2", "--requests", "1000", "--concurrency", "2", "--workloads", "short")
    bench = procs.start(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(bench.stdout.readline())["mode"] == "on"  # printed once the first server answers
        server_tree = procs._tree(bench.pid)
        assert len(server_tree) >= 2  # the server and its worker
    finally:
        procs.stop(bench, grace_s=procs.HANG_TIMEOUT_S)  # SIGTERM first; SIGKILL only if the benchmark hangs
    assert bench.returncode == 128 + signal.SIGTERM  # it ended itself: no SIGKILL was needed
    assert [p for p, started in server_tree.items() if procs._alive(p, started)] == []
    assert _left_behind(tmp_path) == []
    saved = json.loads((tmp_path / "out.json").read_text())  # what it had, marked partial: no point finished
    assert saved["partial"] is True and saved["rows"] == [] and saved["startups"][0]["mode"] == "on"
    ranks = saved["startups"][0]["ranks"]
    assert ranks["agree"] and ranks["ranks"] == 2 and ranks["keys"] >= 0 and ranks["digest"]


def test_tuning_off_drops_every_decode_attention_kernel_mtp_and_linear_ones_included(serve_load):
    """ "off" copies the tuned files minus decode attention's: MTP verify and linear-attention decode included."""
    names = serve_load.decode_attention_kernels()
    assert {"gqa_flash_decode", "fa3_decode", "mtp_diverse_decode", "gated_delta_decode",
            "gated_delta_verify"} <= names  # fmt: skip


def test_qwen3_5_layers_keep_the_3_to_1_pattern(serve_load):
    assert serve_load.hybrid_layer_types(8) == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    with pytest.raises(ValueError, match=r"--layers expected a positive multiple of 4 .* got 6"):
        serve_load.hybrid_layer_types(6)


def test_server_flags_per_model_and_mtp_step(serve_load):
    assert serve_load.server_flags("triton", "qwen3", 0) == ["--llm_decode_att_backend", "triton"]
    assert serve_load.server_flags("fa3", "qwen3.5", 3) == [
        "--llm_decode_att_backend", "fa3", "--linear_att_ssm_data_type", "float32",
        "--mtp_mode", "eagle_with_att", "--mtp_step", "3"]  # fmt: skip
    assert serve_load.resolve_decode_backend(None, "qwen3") == "triton"  # Qwen3 runs as before
    assert serve_load.resolve_decode_backend("fa3", "qwen3.5") == "fa3"
    expected = "fa3" if importlib.util.find_spec("fa3_fwd_interface") else "triton"
    assert (
        serve_load.resolve_decode_backend(None, "qwen3.5")
        == serve_load.resolve_decode_backend("auto", "qwen3")
        == (expected)
    )


def test_written_config_files_are_the_new_or_changed_ones(serve_load, tmp_path):
    """A start's config files: new and rewritten ones count, untouched ones and lock files do not; a tuning-off
    start that wrote any fails its check with the files named (the run goes on: the check is a value)."""
    kernel_dir = tmp_path / "triton_3.6.0" / "NVIDIA_H200" / "gqa_flash_decode"
    kernel_dir.mkdir(parents=True)
    (kernel_dir / "kept.json").write_text('{"a": 1}')
    (kernel_dir / "changed.json").write_text('{"a": 1}')
    before = serve_load.config_snapshot(tmp_path)
    (kernel_dir / "changed.json").write_text('{"a": 2}')
    (kernel_dir / "new.json").write_text("{}")
    (kernel_dir / "new.json.lock").write_text("")
    written = serve_load.written_configs(before, tmp_path)
    prefix = "triton_3.6.0/NVIDIA_H200/gqa_flash_decode/"
    assert written == [prefix + "changed.json", prefix + "new.json"]
    assert serve_load.config_check("on", written) is None
    assert serve_load.config_check("off", []) is None and serve_load.config_check("off_b", []) is None
    assert serve_load.config_check("off_b", written) == (
        f"tuning off (off_b) wrote 2 config files: {prefix}changed.json, {prefix}new.json"
    )


def test_acceptance_is_the_delta_of_the_spec_counters(load_client):
    steps = {("lightllm_step_seconds_count", k): 0.0 for k in ("prefill", "decode")}
    before = {**steps, ("lightllm_spec_decode_num_draft_tokens", None): 100.0,
              ("lightllm_spec_decode_num_accepted_tokens", None): 90.0}  # fmt: skip
    after = {**steps, ("lightllm_spec_decode_num_draft_tokens", None): 140.0,
             ("lightllm_spec_decode_num_accepted_tokens", None): 100.0}  # fmt: skip
    stats = load_client.step_stats(before, after)
    assert (stats["draft_tokens"], stats["accepted_tokens"], stats["acceptance"]) == (40, 10, 0.25)
    assert load_client.step_stats(steps, steps)["acceptance"] is None  # no drafts (MTP off): no acceptance


@pytest.mark.parametrize("family, key", [("TTFT_FAMILY", "server_ttft_mean_ms"),
                                         ("MESSAGE_FAMILY", "engine_message_mean_ms")])  # fmt: skip
def test_a_servers_mean_latency_is_the_delta_of_its_histogram(load_client, family, key):
    """The server's own mean TTFT, and the mean hop of a step's message from the engine process to the HTTP event
    loop, over the load (ms): the delta of the histogram's sum over the delta of its count; None when nothing was
    observed in the window (or the server has no such histogram)."""
    name = getattr(load_client, family)
    before = {(name + "_count", None): 5.0, (name + "_sum", None): 0.5}
    after = {(name + "_count", None): 25.0, (name + "_sum", None): 0.62}
    assert load_client.step_stats(before, after)[key] == pytest.approx(6.0)
    assert load_client.step_stats(after, after)[key] is None
    assert load_client.step_stats({}, {})[key] is None


def test_each_server_process_cpu_share_is_its_counters_delta_over_the_load(load_client):
    """CPU seconds over wall seconds, in percent of a core, per process; None where the server has no counter."""
    before = {("process_cpu_seconds", None): 10.0, ("lightllm_engine_process_cpu_seconds", None): 40.0}
    after = {("process_cpu_seconds", None): 11.5, ("lightllm_engine_process_cpu_seconds", None): 42.7}
    assert load_client.cpu_shares(before, after, 3.0) == pytest.approx({"http_cpu_pct": 50.0, "engine_cpu_pct": 90.0})
    in_process = {("process_cpu_seconds", None): 11.5}  # the engine on a thread of the HTTP process
    assert load_client.cpu_shares(before, in_process, 3.0) == {"http_cpu_pct": pytest.approx(50.0),
                                                               "engine_cpu_pct": None}  # fmt: skip


def test_scheduling_counts_are_counts_for_a_live_process_and_unknown_for_a_gone_one(serve_load):
    import threading

    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        counts = serve_load.scheduling_counts(os.getpid())
    finally:
        release.set()
        thread.join()
    assert isinstance(counts["involuntary_switches"], int) and counts["involuntary_switches"] >= 0
    assert counts["migrations"] is None or counts["migrations"] >= 0  # None: a kernel without scheduler statistics
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert serve_load.scheduling_counts(gone.pid) == {"involuntary_switches": None, "migrations": None}
    assert serve_load.counts_delta({"a": 1, "b": None}, {"a": 5, "b": 3}) == {"a": 4, "b": None}


def test_the_gpu_part_of_a_step_is_the_delta_of_its_own_histogram(load_client):
    """Mean GPU ms over the steps the server timed (steps that sampled), beside the mean step ms over every step."""
    before = {("lightllm_step_seconds_count", "decode"): 10.0, ("lightllm_step_seconds_sum", "decode"): 0.02,
              ("lightllm_step_batch_size_sum", "decode"): 40.0, ("lightllm_step_gpu_seconds_count", "decode"): 10.0,
              ("lightllm_step_gpu_seconds_sum", "decode"): 0.015}  # fmt: skip
    after = {("lightllm_step_seconds_count", "decode"): 110.0, ("lightllm_step_seconds_sum", "decode"): 0.145,
             ("lightllm_step_batch_size_sum", "decode"): 440.0, ("lightllm_step_gpu_seconds_count", "decode"): 110.0,
             ("lightllm_step_gpu_seconds_sum", "decode"): 0.115}  # fmt: skip
    stats = load_client.step_stats(before, after)
    assert stats["decode_steps"] == 100 and stats["decode_batch"] == pytest.approx(4.0)
    assert stats["decode_step_ms"] == pytest.approx(1.25) and stats["decode_gpu_ms"] == pytest.approx(1.0)
    assert stats["prefill_gpu_ms"] is None  # no prefill step in the window
    cpu = {k: v for k, v in after.items() if not k[0].startswith("lightllm_step_gpu")}
    assert load_client.step_stats({}, cpu)["decode_gpu_ms"] is None  # a CPU server never observes the histogram


def test_mtp_step_needs_qwen3_5(tmp_path):
    cmd, env = _benchmark(tmp_path, "--model", "qwen3", "--mtp-step", "2")
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 2
    assert "--mtp-step 2 expected --model qwen3.5 (the model with an MTP head), got qwen3" in done.stderr


def test_mtp_matrix_runs_end_to_end_on_the_tiny_qwen3_5(tmp_path):
    """The service matrix's method on the CPU: tiny Qwen3.5 with its agreeing MTP head at step 2, tuning on and
    off. Every request whole with finite logprobs, the drafts counted over the measured window, each start's
    written config files recorded (on a CPU nothing is tuned, so none), and the off start wrote none."""
    cmd, env = _benchmark(tmp_path, "--model", "qwen3.5", "--mtp-step", "2", "--requests", "2", "--concurrency", "2",
                          "--repeats", "1", "--workloads", "short", "--output-tokens", "32")  # fmt: skip
    done = procs.run(cmd, env=env, timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _left_behind(tmp_path) == []
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["model"], result["mtp_step"], result["mtp_head"]) == ("qwen3.5", 2, "agree")
    assert result["decode_backend"] == "triton"  # auto without fa3_fwd_interface (CPU)
    (row,) = result["rows"]
    for mode in ("on", "off"):
        (run,) = row[mode]["runs"]
        assert run["all_complete_finite"] and run["output_tokens"] == 2 * 32
        # the agreeing head: 2 drafts per request per decode step, (almost) all accepted
        assert run["draft_tokens"] == 2 * round(run["decode_batch"] * run["decode_steps"]) > 0
        assert 0.9 <= run["acceptance"] == run["accepted_tokens"] / run["draft_tokens"] <= 1.0
        assert row[mode]["acceptance"] == run["acceptance"]
    assert [(s["mode"], s["config_files_written"], s["config_check"]) for s in result["startups"]] == [
        ("on", [], None), ("off", [], None)]  # fmt: skip
    assert result["config_checks_ok"] is True and result["tuned_config_files"] == {"short": []}
    assert "draft acceptance" in done.stdout and "config files the tuning start wrote (short, 0)" in done.stdout
    assert "CONFIG CHECK FAILED" not in done.stdout
    for name in ("on0", "off0"):  # every server got the matrix's flags (its args line)
        log = (tmp_path / "logs" / f"server_tp1_short_{name}.log").read_text()
        for arg in ("llm_decode_att_backend=triton", "linear_att_ssm_data_type=float32", "mtp_mode=eagle_with_att",
                    "mtp_step=2"):  # fmt: skip
            assert f" {arg} " in log, arg


@pytest.mark.parametrize("compare", ["tuning", "overlap", "none"])
def test_on_and_off_differ_in_what_compare_names(serve_load, monkeypatch, tmp_path, compare):
    """tuning: "off" runs the tuned configs less decode attention's, from a config dir of its own; overlap: every
    server runs the "on" start's configs and "off" / "off_b" decode synchronously (--disable_overlap_schedule);
    none: every server starts alike, nothing tuned."""
    started, copied = [], []
    monkeypatch.setattr(serve_load, "start_server", lambda model, tp, level, cfg_dir, mb, ml, log, flags, cores:
                        started.append((level, cfg_dir, list(flags))) or (None, "http://x"))  # fmt: skip
    monkeypatch.setattr(serve_load, "copy_without_decode_attention", lambda src, dst: copied.append((src, dst)))
    monkeypatch.setattr(serve_load, "startup_summary", lambda log: {})
    monkeypatch.setattr(serve_load, "rank_agreement", lambda log: {})
    args = type("Args", (), dict(log_dir=str(tmp_path), tp=1, rounds=0, server_cores=None, concurrency=[2],
                                 mtp_step=0, output_tokens=None, compare=compare))()  # fmt: skip
    on_dir, off_dir = str(tmp_path / "on"), str(tmp_path / "off")
    cfg = {"on": on_dir, "off": off_dir, "off_b": off_dir}
    if compare != "tuning":
        cfg = {"on": on_dir, "off": on_dir, "off_b": on_dir}
    for mode in ("on", "off", "off_b"):
        serve_load.launch(args, "model", "short", cfg, mode, 0, ["--x"])
    on, off, off_b = started
    if compare == "none":  # an A/A pair (and a third with --control): all alike, all start together
        assert on == off == off_b == (0, on_dir, ["--x"]) and copied == []
        together = [(0, "on"), (1, "off"), (2, "off_b")]
        assert serve_load.start_batches(args, ["on", "off", "off_b"], [0, 1, 2], 0) == [together]
        return
    assert on == (1, on_dir, ["--x"])  # the first "on" start tunes
    if compare == "tuning":
        assert off == off_b == (0, off_dir, ["--x"]) and copied == [(on_dir, off_dir)]
    else:
        assert off == off_b == (0, on_dir, ["--x", "--disable_overlap_schedule"]) and copied == []


def test_each_server_process_collector_time_and_long_passes_over_a_load(load_client, monkeypatch):
    """Read from the server's own exposition: per process, the passes' time (ms) and how many took over 10 ms,
    every generation together; None for a process the server does not report (the engine on a thread)."""
    from prometheus_client import generate_latest

    from lightllm.common import gc_heap
    from lightllm.server.metrics import Metrics

    metrics = Metrics()
    own = metrics.gc_pauses

    def passes(pauses, *spans):  # (generation, seconds) each, through the callback on a fake clock
        for generation, seconds in spans:
            clock = iter([1.0, 1.0 + seconds])
            monkeypatch.setattr(gc_heap.time, "perf_counter", lambda: next(clock))
            pauses._callback("start", {"generation": generation})
            pauses._callback("stop", {"generation": generation})

    def counters():
        return load_client.server_counters(generate_latest(metrics.registry).decode())

    passes(own, (0, 0.001))
    before = counters()
    count = load_client.GC_FAMILY + "_count"
    assert before[(count, "http")] == 1 and (count, "engine") not in before
    passes(own, (0, 0.002), (2, 0.04))
    engine = gc_heap.GcPauses()
    passes(engine, (1, 0.003), (2, 0.02), (2, 0.5))
    metrics.on_gc_pauses(*engine.snapshot())
    stats = load_client.step_stats(before, counters())
    assert stats["http_gc_ms"] == pytest.approx(42.0) and stats["http_gc_long"] == 1
    assert stats["engine_gc_ms"] == pytest.approx(523.0) and stats["engine_gc_long"] == 2
    assert load_client.step_stats(before, before)["engine_gc_ms"] is None  # the engine on a thread: none of its own


def test_no_collector_pass_runs_while_a_load_is_measured(load_client):
    import gc

    assert gc.isenabled()
    with load_client.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), load_client.collector_paused():
        raise RuntimeError("a failed load")
    assert gc.isenabled()
    gc.disable()  # a caller that runs without the collector keeps it off
    try:
        with load_client.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_steal_time_is_read_per_cpu_and_summed_over_the_cpus_asked_for(serve_load):
    """The hypervisor's stalls of the machine over a run: /proc/stat's steal ticks per CPU, as ms over a set of CPUs."""
    ticks = serve_load.steal_ticks()
    assert ticks and all(isinstance(c, int) and v >= 0 for c, v in ticks.items())  # CI runs on Linux
    assert set(ticks) <= set(range(os.cpu_count() or 1024))
    hz = os.sysconf("SC_CLK_TCK")
    before, after = {0: 10, 1: 5, 2: 7}, {0: 10 + hz, 1: 5 + hz // 2, 2: 7}
    assert serve_load.steal_ms(before, after) == pytest.approx(1500.0)
    assert serve_load.steal_ms(before, after, {1, 2}) == pytest.approx(500.0)
    assert serve_load.steal_ms(before, after, {5}) is None and serve_load.steal_ms({}, {}) is None
