"""KV pool sizing at start-up, on the CPU: the GPU path (profiling forward, then size, then warm-up, then
graphs) with a fake device-memory API, and the CPU path with a fake host-memory API."""

import logging

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, current_warmup_kernel_type
from lightllm.common.kv_cache.sizing import HostMemory
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import PROFILE_POOL_TOKENS, ModelRunner
from lightllm.models.qwen3.model import Qwen3Model
from lightllm.tools.make_tiny_model import QWEN3_8B_SHAPE, make_tiny_qwen3

MIB, GIB = 2**20, 2**30
BYTES_PER_TOKEN = 2 * 2 * 16 * 2 * 4  # the tiny model: 2 layers x 2 KV heads x head_dim 16 x (K, V) x fp32


class FakeDeviceMemory:
    """A device whose numbers the test sets; records when the runner reads them."""

    profiles = True

    def __init__(self, log, total, used, torch_allocated, prefill_peak, decode_peak):
        self.log, self.total, self.used, self.base = log, total, used, torch_allocated
        self.peaks = [prefill_peak, decode_peak]  # above ``allocated()``, in the order the forwards run

    def allocated(self):
        return self.base

    def reset_peak(self):
        self.log.append(("reset_peak",))

    def peak_allocated(self):
        self.log.append(("peak",))
        return self.base + self.peaks.pop(0)

    def used_and_total(self):
        self.log.append(("used_and_total",))
        return self.used, self.total


class FakeHostMemory:
    profiles = False

    def __init__(self, available):
        self._available = available

    def available(self):
        return self._available


class FakeGraphAPI:
    def __init__(self, log):
        self.log = log

    def new_graph(self):
        return object()

    def capture(self, graph, pool):
        log = self.log

        class _Ctx:
            def __enter__(self):
                log.append(("capture",))

            def __exit__(self, *exc):
                return False

        return _Ctx()

    def pool(self, graph):
        return "pool"

    def replay(self, graph):
        pass

    def memory_used(self):
        return 0


@pytest.fixture
def forwards(monkeypatch):
    """Every model forward: (kind, tokens, active autotune phase, KV pool size it runs over)."""
    log = []
    real = Qwen3Model.forward

    def forward(self, input_ids, state):
        kind = "prefill" if state.is_prefill else "decode"
        log.append((kind, input_ids.shape[0], current_warmup_kernel_type(), self.attn.pool.k.shape[1]))
        return real(self, input_ids, state)

    monkeypatch.setattr(Qwen3Model, "forward", forward)
    return log


def _args(tmp_path, **kw):
    opts = dict(model_dir=str(make_tiny_qwen3(tmp_path / "m", seed=0)), data_type="fp32", device="cpu",
                batch_max_tokens=48, max_req_total_len=32, running_max_req_size=4, graph_max_batch_size=2,
                graph_split_batch_size=2)  # fmt: skip
    opts.update(kw)
    return EngineArgs(**opts)


@pytest.mark.parametrize("disable_chunked_prefill, longest", [(True, 64), (False, 16)], ids=["whole", "chunked"])
def test_profiled_prefill_is_the_longest_the_server_runs(tmp_path, forwards, disable_chunked_prefill, longest):
    """Without chunking a prompt longer than batch_max_tokens prefills alone, whole: the profile must cover it, not
    the budget. With chunking no prefill step carries more than the budget."""
    mem = FakeDeviceMemory(forwards, total=16 * GIB, used=4 * GIB, torch_allocated=3 * GIB, prefill_peak=1 * GIB,
                           decode_peak=1 * GIB)  # fmt: skip
    # a given pool size (still checked against the profile): the 6 GiB the peaks leave is seconds of zeroing
    ModelRunner(_args(tmp_path, batch_max_tokens=16, max_req_total_len=64, mem_fraction=0.75, max_total_token_num=4096,
                      disable_chunked_prefill=disable_chunked_prefill),
                graph_api=FakeGraphAPI(forwards), memory_api=mem)  # fmt: skip
    assert forwards[1] == ("prefill", longest, None, PROFILE_POOL_TOKENS)


def test_gpu_pool_is_sized_from_the_profiled_peak_before_warmup(tmp_path, forwards, caplog):
    log = forwards
    # 16 GiB device; 4 GiB in use after load (3 of it torch weights); the profile peaks at 7 GiB - 4 MiB
    # (prefill) and 1 GiB (decode, which the graphs keep, with the logits of the smaller graph: 1 row x 512
    # vocab x 4 B): 0.75 x 16 - 4 - (7 GiB - 4 MiB) - (1 GiB + 2048 B) = 4 MiB - 2048 B of KV.
    mem = FakeDeviceMemory(log, total=16 * GIB, used=4 * GIB, torch_allocated=3 * GIB, prefill_peak=7 * GIB - 4 * MIB,
                           decode_peak=1 * GIB)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        args = _args(tmp_path, mem_fraction=0.75, prefill_graph_max_tokens=0)  # prefill graphs: test_prefill_graph.py
        runner = ModelRunner(args, graph_api=FakeGraphAPI(log), memory_api=mem)
    assert runner.kv.num_tokens == (4 * MIB - 2048) // BYTES_PER_TOKEN == 8188
    assert runner.model.attn is runner.attn and runner.attn.pool.k.shape[1] == 8188  # scratch pool dropped
    # the old formula, mem_fraction x free memory before warm-up, gives a pool that does not fit
    old = int(0.75 * 12 * GIB) // BYTES_PER_TOKEN
    assert old > runner.kv.num_tokens and old * BYTES_PER_TOKEN + (4 + 7 + 1) * GIB - 4 * MIB > 16 * GIB

    # load -> profile (no tuning, scratch pool) -> size -> GENERAL warm-up (real pool) -> decode graphs
    assert log[:7] == [
        ("reset_peak",),
        ("prefill", 48, None, PROFILE_POOL_TOKENS),  # batch_max_tokens, as requests of max_req_total_len
        ("peak",),
        ("reset_peak",),
        ("decode", 4, None, PROFILE_POOL_TOKENS),  # running_max_req_size
        ("peak",),
        ("used_and_total",),
    ]
    kinds = [e[0] for e in log[7:]]
    warmup = log[7 : 7 + kinds.index("decode")]
    # the ladder tunes; then the unaligned batches that fit 32-token requests (1, 17 and 17 + 15 tokens) only compile
    ladder, unaligned = warmup[:-3], warmup[-3:]
    assert ladder and all(e[0] == "prefill" and e[2] is AutotuneKernelType.GENERAL and e[3] == 8188 for e in ladder)
    assert unaligned == [("prefill", n, None, 8188) for n in (1, 17, 32)]
    assert kinds[len(warmup) :] == ["decode", "capture", "decode"] * 2  # graph batch sizes 2, 1

    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache sizing:")]
    assert line == ("KV cache sizing: 16.00 GiB total x --mem_fraction 0.75 = 12.00 GiB, minus in use after load "
                    "4.00 GiB (torch 3.00, other 1.00), activation peak 7.00 GiB, decode graphs (estimate) 1.00 GiB "
                    "= KV 0.00 GiB; pool 8188 tokens x 512 B = 0.00 GiB")  # fmt: skip


def test_gpu_pool_keeps_one_set_of_logits_whatever_the_buckets(tmp_path, forwards):
    """Graphs of 1 and 2 rows for KV lengths up to 16 and up to 32: the buckets share one output per batch size
    (common/cuda_graph.py), so every size but the largest keeps its float32 logits (512 vocab x 4 B a row) in the
    pool once, and the shorter bucket's 2-row capture holds its own 2 rows beside the shared ones while it is
    captured: 1 + 2 rows (each bucket's own logits would be 1 + 1 + 2 rows)."""
    mem = FakeDeviceMemory(forwards, total=16 * GIB, used=4 * GIB, torch_allocated=3 * GIB,
                           prefill_peak=7 * GIB - 4 * MIB, decode_peak=1 * GIB)  # fmt: skip
    args = _args(tmp_path, mem_fraction=0.75, prefill_graph_max_tokens=0, graph_len_buckets=[16])
    runner = ModelRunner(args, graph_api=FakeGraphAPI(forwards), memory_api=mem)
    assert runner.kv.num_tokens == (4 * MIB - 3 * 2048) // BYTES_PER_TOKEN and sorted(runner.graphs.graphs) == [
        (16, 1), (16, 2), (32, 1), (32, 2)]  # fmt: skip


def test_gpu_pool_without_graphs_keeps_no_graph_memory(tmp_path, forwards):
    mem = FakeDeviceMemory([], total=16 * MIB, used=4 * MIB, torch_allocated=3 * MIB, prefill_peak=1 * MIB,
                           decode_peak=2 * MIB)  # fmt: skip
    runner = ModelRunner(_args(tmp_path, mem_fraction=0.75), memory_api=mem)  # no graph API on the CPU: no graphs
    assert runner.kv.num_tokens == (12 - 4 - 2) * MIB // BYTES_PER_TOKEN  # the larger peak (decode), once


def test_gpu_explicit_token_count_is_used_when_it_fits(tmp_path, forwards):
    mem = FakeDeviceMemory([], total=16 * MIB, used=4 * MIB, torch_allocated=3 * MIB, prefill_peak=3 * MIB,
                           decode_peak=1 * MIB)  # fmt: skip
    runner = ModelRunner(_args(tmp_path, max_total_token_num=9000, mem_fraction=0.5), memory_api=mem)
    assert runner.kv.num_tokens == 9000  # above what 0.5 would give: an explicit count overrides the fraction


def test_gpu_explicit_token_count_that_cannot_fit_is_one_line(tmp_path, forwards):
    mem = FakeDeviceMemory([], total=16 * MIB, used=4 * MIB, torch_allocated=3 * MIB, prefill_peak=3 * MIB,
                           decode_peak=1 * MIB)  # fmt: skip
    fits = (16 - 4 - 3) * MIB // BYTES_PER_TOKEN  # no graphs here
    with pytest.raises(ValueError, match=rf"^--max_total_token_num 100000 does not fit on the GPU: at most {fits} "
                       r"tokens of 512 B fit in its 0.02 GiB .*; lower --max_total_token_num$"):  # fmt: skip
        ModelRunner(_args(tmp_path, max_total_token_num=100000), memory_api=mem)


def test_gpu_with_no_room_for_one_request_keeps_the_existing_error(tmp_path, forwards):
    mem = FakeDeviceMemory([], total=16 * MIB, used=4 * MIB, torch_allocated=3 * MIB, prefill_peak=10 * MIB,
                           decode_peak=1 * MIB)  # fmt: skip
    with pytest.raises(ValueError, match=r"the KV cache holds 0 tokens, fewer than one --max_req_total_len \(32\)"):
        ModelRunner(_args(tmp_path, mem_fraction=0.75), memory_api=mem)


@pytest.mark.parametrize(
    "available, extra, tokens",
    [
        (1 * MIB, {}, 1 * MIB // 4 // BYTES_PER_TOKEN),  # a quarter of 1 MiB: 512 tokens
        (10**12, {}, (4 + 1) * 256),  # plenty of RAM: capped at every request slot full
        (10**12, {"max_total_token_num": 300}, 300),
    ],
    ids=["fraction-of-available", "capped", "explicit"],
)
def test_cpu_pool_is_bounded_by_mem_fraction_of_available_ram(tmp_path, available, extra, tokens):
    args = _args(tmp_path, mem_fraction=0.25, max_req_total_len=256, batch_max_tokens=16, **extra)
    runner = ModelRunner(args, memory_api=FakeHostMemory(available))
    assert runner.kv.num_tokens == tokens


def test_cpu_with_too_little_ram_for_one_request_is_the_existing_error(tmp_path):
    args = _args(tmp_path, mem_fraction=0.5, max_req_total_len=256, batch_max_tokens=16)
    with pytest.raises(ValueError, match=r"the KV cache holds 128 tokens, fewer than one --max_req_total_len \(256\)"):
        ModelRunner(args, memory_api=FakeHostMemory(128 * 1024))


@pytest.mark.parametrize("extra, expected", [
    ({"running_max_req_size": 10**6}, "--running_max_req_size 1000000 does not fit in RAM: its req_to_token table, "
                                      "1000001 slots x 256 tokens x 4 B = 0.95 GiB, is more than the 0.00 GiB "
                                      "available; lower --running_max_req_size or --max_req_total_len"),
    ({"max_total_token_num": 10**6}, "--max_total_token_num 1000000 does not fit in RAM: at most 2038 tokens of 512 B "
                                     "fit in the 0.00 GiB available after the weights and the req_to_token table; "
                                     "lower --max_total_token_num"),
], ids=["running_max_req_size", "max_total_token_num"])  # fmt: skip
def test_cpu_sizes_beyond_the_ram_name_the_flag(tmp_path, extra, expected):
    """Refused before allocating: a MemoryError or the OOM killer otherwise. 1 MiB available less the table of
    5 slots x 256 tokens x 4 B leaves 2038 tokens of 512 B."""
    args = _args(tmp_path, max_req_total_len=256, batch_max_tokens=16, **extra)
    with pytest.raises(ValueError) as e:
        ModelRunner(args, memory_api=FakeHostMemory(1 * MIB))
    assert str(e.value) == expected


def test_host_memory_reads_memavailable_else_sysconf(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000000 kB\nMemFree:         100000 kB\nMemAvailable:    2048 kB\n")
    assert HostMemory(str(meminfo)).available() == 2048 * 1024
    pages = {"SC_AVPHYS_PAGES": 3, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr("os.sysconf", lambda name: pages[name])
    assert HostMemory(str(tmp_path / "missing")).available() == 3 * 4096


@pytest.mark.gpu
def test_gpu_high_mem_fraction_leaves_room_for_the_worst_forwards(tmp_path, caplog):
    """On a real device at --mem_fraction 0.95 (8B-shaped layers): the worst prefill and an eager full-length
    decode of the largest batch run on the real pool, after the graphs, without running out of memory."""
    model = str(make_tiny_qwen3(tmp_path / "m", num_hidden_layers=2, **QWEN3_8B_SHAPE))
    args = EngineArgs(model_dir=model, data_type="bf16", mem_fraction=0.95, running_max_req_size=64,
                      batch_max_tokens=8192, max_req_total_len=4096, graph_max_batch_size=64)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="lightllm.engine.model_runner"):
        runner = ModelRunner(args)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache sizing:")]
    print(line)
    slots = [runner.add_request() for _ in range(64)]
    for s in slots:
        runner.kv.extend(s, 4094)
    runner.decode(slots, [1] * 64)  # the graph of 64
    runner.graphs = None
    runner.decode(slots, [1] * 64)  # eager, every request at 4096 tokens
    for s in slots:
        runner.free(s)
    sizes = [2048, 2048]  # the largest prefill step: --chunked_prefill_size 4096 (below batch_max_tokens)
    runner.prefill([runner.add_request() for _ in sizes], [[1] * n for n in sizes])
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    print(f"free {free / GIB:.2f} GiB of {total / GIB:.2f}; peak reserved {torch.cuda.max_memory_reserved() / GIB:.2f}")
