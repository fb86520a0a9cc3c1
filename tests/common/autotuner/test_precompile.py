"""The compile pass before a search and before a start-up's cached-config warm-up (autotuner/precompile.py): every
config's kernels compile on the pool before the first one is timed or run, each distinct kernel once; a config that
fails there fails when timed, as before; one thread or the interpreter turn it off; a search inside a pass is refused;
an interrupt drops the compiles still queued.

On the CPU a stand-in kernel plays Triton's part: its ``warmup`` submits to the active ``AsyncCompileMode`` as
``JITFunction`` does, and its launch compiles on the caller's thread what is not in its cache."""

import threading

import pytest
import torch
from triton import knobs
from triton.runtime._async_compile import active_mode

from lightllm.common import envs
from lightllm.common.autotuner import AutotuneKernelType, autotune, autotune_warmup, get_autotune_stats, precompile
from lightllm.common.autotuner import set_bench_func, tuner
from lightllm.kernels import direct_launch
from lightllm.kernels.direct_launch import DirectLaunch
from lightllm.tools import tune_shipped

GENERAL = AutotuneKernelType.GENERAL
MS = {None: 1.0, 16: 0.5, 32: 0.3, 64: 0.9}  # "time" of each BLOCK (None: the launcher default, BLOCK 8)


class _StandInKernel:
    """Compiles one "kernel" per BLOCK: on the pool under a compile pass (``warmup``), else at its first launch."""

    def __init__(self, fail=()):
        self.cache, self.fail, self.pre_run_hooks = {}, set(fail), []
        self.compiles = []  # (BLOCK, thread name) of every compile
        self.launches = []  # BLOCK of every launch that ran

    def _compile(self, block):
        self.compiles.append((block, threading.current_thread().name))
        if block in self.fail:
            raise RuntimeError(f"BLOCK={block}: out of resources")
        return ("compiled", block)

    def warmup(self, x, out, alpha, *, grid, BLOCK):
        if BLOCK in self.cache:
            return self.cache[BLOCK]
        mode = active_mode.get()
        assert mode is not None, "warm-up outside a compile pass"
        return mode.submit(("stand-in", BLOCK), lambda: self._compile(BLOCK), lambda k: self.cache.update({BLOCK: k}))

    def __getitem__(self, grid):
        def run(x, out, alpha, BLOCK):
            if BLOCK not in self.cache:
                self.cache[BLOCK] = self._compile(BLOCK)
            self.launches.append(BLOCK)
            torch.mul(x, alpha, out=out)
            return self.cache[BLOCK]

        return run


class _Tuned:
    """A tuned launcher of the stand-in kernel over BLOCK 16/32/64, each twice (``WAVES`` changes no compile)."""

    def __init__(self, name, fail=()):
        self.kernel = _StandInKernel(fail)
        self.launch = DirectLaunch(self.kernel, direct=True)
        self.first_timing = None  # compiles done when the first candidate was timed
        self.configs = self.configs_at_start = [{"BLOCK": b, "WAVES": w} for b in (16, 32, 64) for w in (1, 2)]

        @autotune(
            kernel_name=name,
            configs_gen_func=lambda: self.configs,
            static_key_func=lambda x: {"dtype": x.dtype},
            run_key_func=lambda x: x.shape[0],
            kernel_type=GENERAL,
            output_args=("out",),
        )
        def scale(x, out, alpha=2.0, run_config=None):
            block = 8 if run_config is None else run_config["BLOCK"]
            self.launch.launch((1,), x, out, alpha, BLOCK=block)
            self.last = None if run_config is None else block
            return out

        self.fn = scale

        def bench(run):
            run()
            if self.first_timing is None:
                self.first_timing = list(self.kernel.compiles)
            return MS[self.last]

        set_bench_func(bench)

    def __call__(self, n=4):
        x = torch.randn(n, 3)
        out = torch.full_like(x, float("nan"))
        self.fn(x, out)
        torch.testing.assert_close(out, 2.0 * x, rtol=0, atol=0)


@pytest.fixture
def compile_pass(monkeypatch):
    """Compiled kernels (no interpreter), launches through ``kernel[grid]`` (the stand-in has no binding), 4 threads
    and tuning level 1."""
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    monkeypatch.setattr(direct_launch, "_enabled", False)
    monkeypatch.setenv(envs.AUTOTUNE_COMPILE_THREADS, "4")
    monkeypatch.setenv(envs.AUTOTUNE_LEVEL, "1")


def _pool_compiled(kernel):
    return sorted(b for b, thread in kernel.compiles if thread.startswith("autotune-compile"))


def test_a_search_compiles_every_candidate_on_the_pool_before_the_first_timing(compile_pass, caplog, monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(tuner, "search_clock", lambda: float(next(ticks)))  # a second a reading
    t = _Tuned("precompile_search")
    before = get_autotune_stats()
    with caplog.at_level("INFO", logger="lightllm.common.autotuner"), autotune_warmup(GENERAL):
        t(n=4)
    assert sorted(t.first_timing) == sorted(t.kernel.compiles)  # every compile done before any timing
    assert _pool_compiled(t.kernel) == [8, 16, 32, 64]  # the default too, each BLOCK once, all on the pool
    assert len(t.kernel.compiles) == 4
    record = t.fn.last_search
    assert record.chosen == {"BLOCK": 32, "WAVES": 1} and record.kernels_compiled == 4
    assert record.compile_seconds == 1.0 and record.seconds > 1.0  # the pass is timed on the search's clock
    done = get_autotune_stats() - before
    assert done.kernels_compiled_ahead == 4 and done.compile_ahead_seconds >= record.compile_seconds
    assert "candidates in" in caplog.text and "; 4 kernels compiled ahead in" in caplog.text  # the search's line
    assert "searching; 4 kernels compiled ahead in" in caplog.text  # the warm-up scope's summary
    summary = tune_shipped.search_summary(caplog.text)  # a tune_shipped start's line, from the same log
    assert summary == "precompile_search 1 searches 11.0 s (4 kernels compiled ahead in 1.0 s)"


def test_a_config_that_fails_to_compile_ahead_fails_when_timed_as_before(compile_pass):
    t = _Tuned("precompile_fail", fail={32})
    with autotune_warmup(GENERAL):
        t(n=4)
    assert _pool_compiled(t.kernel) == [8, 16, 32, 64]
    # BLOCK 32 tried again on the main thread when timed, once per candidate that has it, and ruled out there
    assert [b for b, thread in t.kernel.compiles if not thread.startswith("autotune-compile")] == [32, 32]
    assert t.fn.last_search.chosen == {"BLOCK": 16, "WAVES": 1}
    assert 32 not in t.kernel.launches


@pytest.mark.parametrize("why", ["one thread", "interpreter"])
def test_one_thread_or_the_interpreter_compiles_each_config_as_it_first_launches(compile_pass, monkeypatch, why):
    if why == "one thread":
        monkeypatch.setenv(envs.AUTOTUNE_COMPILE_THREADS, "1")
    else:
        monkeypatch.setattr(knobs.runtime, "interpret", True)
    t = _Tuned(f"precompile_off_{why.replace(' ', '_')}")
    with autotune_warmup(GENERAL):
        t(n=4)
    assert sorted(t.kernel.compiles) == [(b, "MainThread") for b in (8, 16, 32, 64)]
    assert t.first_timing == [(8, "MainThread")]  # the default's kernel only: the others compile as timed
    assert t.fn.last_search.kernels_compiled == 0 and t.fn.last_search.compile_seconds == 0


def test_cached_configs_compile_ahead_before_a_start_up_warms_them(compile_pass, monkeypatch):
    t = _Tuned("precompile_warm")
    with autotune_warmup(GENERAL):
        t(n=4)
        t.configs = [{"BLOCK": 64, "WAVES": 1}]
        MS[64] = 0.1
        try:
            t(n=8)  # a second run key whose winner compiles another kernel
        finally:
            MS[64] = 0.9
            t.configs = t.configs_at_start
    tuner.clear_all_caches()  # a restart: Triton's in-process caches and the tuner's are gone, the files stay
    t.kernel.cache.clear()
    t.kernel.compiles.clear()
    monkeypatch.setenv(envs.AUTOTUNE_LEVEL, "0")
    before = get_autotune_stats()
    with autotune_warmup(GENERAL):
        t(n=4)
    assert _pool_compiled(t.kernel) == [32, 64] and len(t.kernel.compiles) == 2
    assert (get_autotune_stats() - before).kernels_compiled_ahead == 2


def test_no_search_inside_a_compile_pass(compile_pass):
    inner = _Tuned("precompile_inner")
    outer_kernel = _StandInKernel()
    outer_launch = DirectLaunch(outer_kernel, direct=True)
    searched = []

    @autotune(
        kernel_name="precompile_outer",
        configs_gen_func=lambda: [{"BLOCK": 16}, {"BLOCK": 32}],
        static_key_func=lambda x: {"dtype": x.dtype},
        run_key_func=lambda x: x.shape[0],
        kernel_type=GENERAL,
        output_args=("out",),
    )
    def outer(x, out, run_config=None):
        searched.append(precompile.compiling())
        inner.fn(x, out)  # an untuned key: this call would search, but not inside the pass
        outer_launch.launch((1,), x, out, 2.0, BLOCK=8 if run_config is None else run_config["BLOCK"])
        return out

    set_bench_func(lambda run: (run(), 1.0)[1])
    x = torch.randn(4, 3)
    with autotune_warmup(GENERAL):
        outer(x, torch.empty_like(x))
    assert searched[:3] == [True] * 3 and not any(searched[3:]) and not precompile.compiling()  # the pass, each config
    # the inner search was refused in the pass (so each config gave up there) and ran at the first timed launch
    assert inner.fn.last_search is not None and inner.fn.last_search.run_key == 4
    assert _pool_compiled(outer_kernel) == [] and sorted(b for b, _ in outer_kernel.compiles) == [8, 16, 32]


@pytest.mark.parametrize("when", ["launching", "waiting"])
def test_an_interrupted_pass_drops_its_queued_compiles(monkeypatch, when):
    """Ctrl-C in a pass, while its launchers run or while it waits for the compiles: the compiles not started are
    dropped, the running one finishes, and afterwards launches run again and no compile mode is left active."""
    from triton.runtime import _async_compile

    kernel = _StandInKernel()
    started, release = threading.Event(), threading.Event()
    compile_one = kernel._compile

    def slow_compile(block):  # the first compile holds the pool's one thread until the queue was dropped
        started.set()
        assert release.wait(timeout=30)
        return compile_one(block)

    kernel._compile = slow_compile
    drop = precompile._Queue.drop
    monkeypatch.setattr(precompile._Queue, "drop", lambda queue: (drop(queue), release.set()))
    launch = DirectLaunch(kernel, direct=True)
    x = torch.randn(4, 3)

    def run(block):
        launch.launch((1,), x, torch.empty_like(x), 2.0, BLOCK=block)
        if block == 32 and when == "launching":
            assert started.wait(timeout=30)
            raise KeyboardInterrupt

    def interrupted(futures):
        assert started.wait(timeout=30)
        raise KeyboardInterrupt
        yield

    if when == "waiting":
        monkeypatch.setattr(_async_compile, "as_completed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        precompile.compile_ahead(run, [8, 16, 32, 64], threads=1)
    assert [b for b, _ in kernel.compiles] == [8]  # the others waited in the queue and were dropped
    assert not precompile.compiling() and not direct_launch._compile_only and active_mode.get() is None


@pytest.mark.parametrize("raw", ["0", "-2", "x", "1.5"])
def test_compile_threads_must_be_a_positive_integer(monkeypatch, raw):
    monkeypatch.setenv(envs.AUTOTUNE_COMPILE_THREADS, raw)
    with pytest.raises(ValueError, match=rf"LIGHTLLM_AUTOTUNE_COMPILE_THREADS={raw!r}.*positive integer"):
        envs.validate_all()


def test_compile_threads_default_shares_the_cpus_among_ranks_at_most_8(monkeypatch):
    assert envs.get_autotune_compile_threads() is None  # unset: the tuner's default
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [precompile.default_threads(r) for r in (1, 2, 4, 8, 16, 32)] == [8, 8, 4, 2, 1, 1]
    monkeypatch.setenv(envs.AUTOTUNE_COMPILE_THREADS, " 3 ")
    assert envs.get_autotune_compile_threads() == 3
