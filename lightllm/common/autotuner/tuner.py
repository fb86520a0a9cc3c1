"""The ``autotune`` decorator: per-call config choice, searches in the active phase, cached-config warmup."""

import functools
import hashlib
import inspect
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from tqdm import tqdm

from lightllm.common import envs
from lightllm.common.autotuner import dist, precompile
from lightllm.common.autotuner.accuracy import collect_tensors, mismatch
from lightllm.common.autotuner.bench import get_bench_func, screen_bench_func
from lightllm.common.autotuner.choice import check_rule, choose, per_scenario_best, ranking, worst_case_loss
from lightllm.common.autotuner.keys import (
    ParamPicker,
    default_run_key_distance,
    freeze,
    is_flat_key,
    key_caller,
    key_to_json,
    param_names,
)
from lightllm.common.autotuner.phase import (
    STATS,
    AutotuneKernelType,
    AutotuneLevel,
    SCOPE_CLOCK,
    _phase_stack,
    current_warmup_kernel_type,
    is_searching_level,
)
from lightllm.common.autotuner.plan import FixedPlan, Plan
from lightllm.common.autotuner.space import CandidateSpace
from lightllm.common.autotuner.store import Config, ConfigStore

logger = logging.getLogger(__name__)

_MISSING = object()
_OFF = int(AutotuneLevel.OFF)  # a plain int: every call compares the level with it
# Candidates timed a second time beside the default once every candidate has been timed (``Autotuner._retime``).
FINALISTS = 3
# A search the time budget cut short is searched again at this many later starts (level 1/2): its compiles are then
# in Triton's cache, which is where a first search on a new GPU spends its budget.
CUT_RESUMES = 1


_force_as_adaptive_logged = False
# Seconds from an arbitrary start: the clock the search budget is spent against (tests swap it, so no result
# depends on how fast the machine is).
search_clock: Callable[[], float] = time.perf_counter
_instances: "weakref.WeakSet[Autotuner]" = weakref.WeakSet()


def clear_all_caches() -> None:
    """Forget every kernel's loaded and tuned configs in this process, as a restart would (files stay)."""
    for instance in list(_instances):
        instance.clear_cache()


def kernel_names(kernel_type: AutotuneKernelType) -> set:
    """Names of the tuned kernels of ``kernel_type`` declared in this process (their modules imported)."""
    return {instance.kernel_name for instance in list(_instances) if instance.kernel_type is kernel_type}


def configs_in_use() -> Dict[str, Config]:
    """Every config this process holds, as ``"kernel static_key run_key" -> config`` (keys in JSON)."""
    out = {}
    for instance in list(_instances):
        for state in instance._states.values():
            for run_key, config in state.configs.items():
                out[f"{instance.kernel_name} {key_to_json(state.static_key)} {key_to_json(run_key)}"] = config
    return dict(sorted(out.items()))


def check_rank_agreement(show: int = 5) -> bool:
    """Collective: compare every rank's :func:`configs_in_use`. Rank 0 logs one line saying they are identical
    (and their digest), or warns with the first ``show`` keys that differ. True when they agree."""
    mine = configs_in_use()
    everyone = dist.all_gather_object(mine)
    digests = [hashlib.sha256(json.dumps(c, sort_keys=True, default=str).encode()).hexdigest()[:12] for c in everyone]
    agree = len(set(digests)) == 1
    if dist.rank() == 0:
        if agree:
            logger.info("autotune: all %d ranks hold identical configs (%d keys, digest %s)", len(everyone),
                        len(mine), digests[0])  # fmt: skip
        else:
            differ = []
            for key in sorted(set().union(*everyone)):
                per_rank = [key_to_json(c.get(key, "missing")) for c in everyone]
                if len(set(per_rank)) > 1:
                    differ.append(f"{key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(per_rank)))
            logger.warning(
                "autotune: ranks hold different configs for %d keys, e.g. %s", len(differ), "; ".join(differ[:show])
            )
    return agree


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class SearchRecord:
    """What the latest search of a kernel measured (for reports and benchmarks); times are per scenario."""

    static_key: Any
    run_key: Any
    rule: str
    default_ms: List[float]
    timings: List[Tuple[dict, List[float]]]  # (candidate, ms per scenario); inf = failed, rejected, not reached
    chosen: Config
    chosen_ms: List[float]
    seconds: float
    # The default (-1) and the finalists re-timed after the first pass: index -> its first pass's ms per scenario
    # (``timings`` and ``default_ms`` keep each one's faster time).
    first_pass: Dict[int, List[float]] = field(default_factory=dict)
    retime_seconds: float = 0.0  # of ``seconds``
    compile_seconds: float = 0.0  # of ``seconds``: the compile pass before the first timing (precompile.py)
    kernels_compiled: int = 0  # compile requests that pass sent to its pool


class _StaticKeyState:
    """What one kernel knows about one static key: its configs, the config each run key launched, warmed configs."""

    def __init__(self, static_key: Any, configs: Dict[Any, Config], sources: Dict[Any, Any], cut: Dict[Any, int]):
        self.static_key = static_key
        self.configs = configs
        self.sources = sources  # run key -> file its config was read from
        self.cut = cut  # run key -> searches in a row the time budget cut short (the writable root's file)
        self.resolved: Dict[Any, Config] = {}  # run key -> config (exact or nearest) that has launched for it
        self.warmed: set = set()  # JSON of configs already run once in this process
        self.searched: set = set()  # run keys searched in this process (FORCE searches each once)
        # Run keys the ranks decided together in this process: resolving one again (a plan stale after another run
        # key's change on some ranks only, a config dropped on one rank) takes this rank's config, or its nearest,
        # without a gather the other ranks would not enter.
        self.decided: set = set()
        # Bumped whenever a config a plan of this key may hold changes: those plans then resolve again. Per key, not
        # per kernel: with tensor parallelism a change on some ranks only (taking rank 0's config) must not make
        # the plans of the kernel's other keys resolve again there, with a collective the other ranks never enter.
        self.generation = 0


# The state plans hold where the level is off: nothing is keyed, and it never changes.
_UNTUNED = _StaticKeyState(None, {}, {}, {})


class Autotuner:
    """Wraps a launcher ``fn(..., run_config=None)``; see :func:`autotune`."""

    def __init__(
        self,
        fn: Callable,
        kernel_name: str,
        configs_gen_func: Callable[..., Iterable[dict]],
        static_key_func: Callable[..., Any],
        run_key_func: Callable[..., Any],
        run_key_distance_func: Callable[[Any, Any], float],
        mutates_args: Sequence[str],
        kernel_type: AutotuneKernelType,
        rebuild_input_func: Optional[Callable[[Dict[str, Any]], Any]],
        warmup_all_exist_config: bool,
        output_args: Sequence[str],
        accuracy_tol: Optional[Tuple[float, float]],
        choice_rule: str,
    ):
        if not isinstance(kernel_type, AutotuneKernelType):
            raise TypeError(f"autotune kernel {kernel_name!r}: kernel_type must be an AutotuneKernelType")
        check_rule(choice_rule, f"autotune kernel {kernel_name!r}: choice_rule")
        signature = inspect.signature(fn)
        if "run_config" not in signature.parameters:
            raise TypeError(
                f"autotune kernel {kernel_name!r}: launcher {fn.__qualname__} needs a run_config=None param"
            )
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
            raise TypeError(
                f"autotune kernel {kernel_name!r}: launcher {fn.__qualname__} must name every parameter (no *args or "
                "**kwargs): the tuner passes rebuilt inputs by name"
            )
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.signature = signature
        self.kernel_name = kernel_name
        self.kernel_type = kernel_type
        self.configs_gen_func = configs_gen_func
        self.static_key_func = static_key_func
        self.run_key_func = run_key_func
        self.run_key_distance_func = run_key_distance_func
        self.rebuild_input_func = rebuild_input_func
        self.warmup_all_exist_config = warmup_all_exist_config
        self.accuracy_tol = accuracy_tol
        self.choice_rule = choice_rule
        self.store = ConfigStore(kernel_name)
        pick = functools.partial(ParamPicker, kernel_name, fn)
        self._static_picker = pick(param_names(static_key_func))
        self._run_picker = pick(param_names(run_key_func))
        self._configs_picker = pick(param_names(configs_gen_func))
        self._static_key_of = key_caller(self._static_picker, static_key_func)
        self._run_key_of = key_caller(self._run_picker, run_key_func)
        self._mutates_picker = pick(tuple(mutates_args))
        self._outputs_picker = pick(tuple(output_args))
        self._states: Dict[Any, _StaticKeyState] = {}
        # Consecutive calls (every layer of a step) mostly share the static key; equal flat keys freeze equal.
        self._last_static: Tuple[Optional[dict], Any] = (None, None)
        self.last_search: Optional[SearchRecord] = None
        _instances.add(self)

    # ---- per call -------------------------------------------------------------------------------------

    def __call__(self, *args, run_config: Optional[dict] = None, **kwargs):
        if run_config is not None:
            return self.fn(*args, run_config=run_config, **kwargs)
        level = envs.get_triton_autotune_level()
        if level == _OFF:
            return self.fn(*args, run_config=None, **kwargs)
        state = self._state_of(args, kwargs)
        run_key = freeze(self._run_key_of(args, kwargs))
        if not _phase_stack:  # the hot path, serving outside any warmup: a launched run key is one dict look-up
            config = state.resolved.get(run_key, _MISSING)
            if config is not _MISSING:
                return self.fn(*args, run_config=config, **kwargs)
        config, searching, launched = self._resolve_keyed(state, run_key, level, args, kwargs)
        if launched:
            return self.fn(*args, run_config=config, **kwargs)
        return self._first_launch(state, run_key, config, searching, level, args, kwargs)

    def plan(self, *args, run_config: Optional[dict] = None, **kwargs) -> Union[Plan, FixedPlan]:
        """A plan whose ``run(...)`` launches with one resolved config, for every call that shares these keys
        (every layer of a step). With arguments it resolves now (searching, in the kernel's own phase at level
        1/2, as a call would) without launching; without any it settles on its first ``run``'s arguments, so a
        kernel's plan can be made from shapes before any layer runs. ``run_config``: launch with it, untuned."""
        if run_config is not None:
            return FixedPlan(self, run_config)
        plan = Plan(self)
        if args or kwargs:
            self._settle(plan, args, kwargs)
        return plan

    def _resolve(self, args: tuple, kwargs: dict) -> tuple:
        """What a call with these arguments launches: ``(state, run_key, config, searching, level, launched)``;
        ``launched``: the config has launched for the run key in this process (else this is its first launch)."""
        level = envs.get_triton_autotune_level()
        if level == _OFF:
            return _UNTUNED, None, None, False, level, True
        state = self._state_of(args, kwargs)
        run_key = freeze(self._run_key_of(args, kwargs))
        config, searching, launched = self._resolve_keyed(state, run_key, level, args, kwargs)
        return state, run_key, config, searching, level, launched

    def _resolve_keyed(self, state: _StaticKeyState, run_key: Any, level: int, args: tuple, kwargs: dict) -> tuple:
        """``(config, searching, launched)`` for keys already made, at a level other than off."""
        phase = current_warmup_kernel_type()
        searching = phase is self.kernel_type and is_searching_level(level)
        if phase is not None and self.warmup_all_exist_config and not _is_capturing():
            self._warm_cached_configs(state, args, kwargs)  # first: a config that fails to run is dropped
        if searching:
            config = self._decide(state, run_key, level, args, kwargs)
        else:
            config = state.resolved.get(run_key, _MISSING)
            if config is not _MISSING:
                return config, False, True
            config = self._lookup(state, run_key)
        return config, searching, state.resolved.get(run_key, _MISSING) is config

    def _settle(self, plan: Plan, args: tuple, kwargs: dict) -> None:
        plan.state, plan.run_key, plan.config, plan.searching, plan.level, plan.confirmed = self._resolve(args, kwargs)
        plan.generation, plan.scope_ticks = plan.state.generation, SCOPE_CLOCK.ticks

    def _run_unsettled(self, plan: Plan, args: tuple, kwargs: dict):
        """``Plan.run`` off its fast path: a stale plan resolves again on these arguments; a config that has not
        launched for its run key yet gets its first launch."""
        if plan.state is None or plan.generation != plan.state.generation or plan.scope_ticks != SCOPE_CLOCK.ticks:
            self._settle(plan, args, kwargs)
            if plan.confirmed:
                return self.fn(*args, run_config=plan.config, **kwargs)
        state, run_key, config = plan.state, plan.run_key, plan.config
        out = self._first_launch(state, run_key, config, plan.searching, plan.level, args, kwargs)
        plan.confirmed = state.resolved.get(run_key, _MISSING) is config
        return out

    def _state_of(self, args: tuple, kwargs: dict) -> _StaticKeyState:
        """The static key's state for a call's arguments (keyed on every call: kept cheap)."""
        static_key = self._static_key_of(args, kwargs)
        memo = self._last_static  # (a copy of the last flat static key, its frozen form): one atomic read
        if static_key == memo[0]:
            frozen = memo[1]
        else:
            frozen = freeze(static_key)
            if is_flat_key(static_key):
                self._last_static = (dict(static_key), frozen)
        state = self._states.get(frozen)
        return state if state is not None else self._state(static_key, args, kwargs)

    def _state(self, static_key: Any, args: tuple, kwargs: dict) -> _StaticKeyState:
        frozen = freeze(static_key)
        state = self._states.get(frozen)
        if state is None:
            entries = self._candidate_entries(self.store.load_layers(frozen), args, kwargs)
            configs = {run_key: config for run_key, (config, _) in entries.items()}
            sources = {run_key: path for run_key, (_, path) in entries.items()}
            state = _StaticKeyState(static_key, configs, sources, self.store.cut_counts(frozen))
            self._states[frozen] = state
        return state

    def _space(self, args: tuple, kwargs: dict) -> CandidateSpace:
        """Asked once per static key at load, and again by each (rare) search."""
        return CandidateSpace(self.kernel_name, self.configs_gen_func(**self._configs_picker.pick(args, kwargs)))

    def _candidate_entries(self, layers: List[Dict[Any, Tuple[Config, Any]]], args: tuple, kwargs: dict) -> dict:
        """Once per static key, at load: the roots' entries (shipped first, the writable root's over them) less the
        configs the kernel would never offer (one warning). A writable root's entry that is not a candidate leaves
        the shipped config of its run key in place; a run key with no usable config is a miss."""
        entries: Dict[Any, Tuple[Config, Any]] = {}
        if not any(layers):
            return entries
        space = self._space(args, kwargs)
        bad = []
        for layer in layers:
            for run_key, (config, path) in layer.items():
                why = space.why_not(config)
                if why is None:
                    entries[run_key] = (config, path)
                else:
                    bad.append(f"{key_to_json(config)} for run key {key_to_json(run_key)} in {path}: {why}")
        if bad:
            logger.warning(
                "autotune %s: ignoring %d cached config(s) that are not among the kernel's candidates, their run "
                "keys count as misses (or take the shipped config of the key, where it is one): %s",
                self.kernel_name,
                len(bad),
                "; ".join(bad),
            )
        return entries

    def _lookup(self, state: _StaticKeyState, run_key: Any) -> Config:
        """The run key's cached config, else the nearest cached run key's, else None (launcher default)."""
        config = state.configs.get(run_key, _MISSING)
        if config is not _MISSING:
            return config
        best, best_distance = None, math.inf
        for cached, config in state.configs.items():
            distance = self.run_key_distance_func(run_key, cached)
            if distance < best_distance:
                best, best_distance = config, distance
        return best

    def _first_launch(self, state, run_key, config: Config, searching: bool, level: int, args, kwargs):
        """The first launch of ``config`` for ``run_key`` in this process. A cached config that raises is dropped
        (its run keys become misses). This call then runs a fresh search's winner (the kernel's own phase, level
        1/2, one process; with tensor parallelism the next call searches, every rank together) or the default,
        which raises when the input itself is at fault (then the config is kept). Nothing is cloned: a launch
        that raises does so before its kernel runs (Triton binds arguments and compiles first), so the inputs
        are untouched, and a kernel that advances state in place never has its real state copied."""
        try:
            out = self.fn(*args, run_config=config, **kwargs)
        except Exception as e:
            if config is None or _is_capturing():  # nothing to fall back to; never retry inside a graph capture
                raise
            why = f"failed to launch ({type(e).__name__}: {e})"
        else:
            state.resolved[run_key] = config
            return out
        if searching and dist.world() == 1 and run_key not in state.searched:
            self._drop(state, config, why, "a fresh search replaces it")
            config = self._decide(state, run_key, level, args, kwargs)
            out = self.fn(*args, run_config=config, **kwargs)
            state.resolved[run_key] = config
            return out
        out = self.fn(*args, run_config=None, **kwargs)  # raises when the input is at fault: config kept
        self._drop(state, config, why, "its run keys count as misses (this call ran the launcher default)")
        return out

    def _drop(self, state: _StaticKeyState, config: Config, why: str, instead: str) -> None:
        """Forget ``config`` for every run key that holds it (in this process; the files stay)."""
        text = key_to_json(config)
        run_keys = [run_key for run_key, c in state.configs.items() if c is not None and key_to_json(c) == text]
        for run_key in run_keys:
            del state.configs[run_key]
        state.resolved.clear()
        state.generation += 1
        files = sorted({str(state.sources[k]) for k in run_keys if k in state.sources}) or ["tuned in this process"]
        logger.warning(
            "autotune %s: dropped cached config %s (run keys %s; %s): %s; %s",
            self.kernel_name,
            text,
            ", ".join(key_to_json(k) for k in run_keys),
            ", ".join(files),
            why,
            instead,
        )

    def _decide(self, state: _StaticKeyState, run_key: Any, level: int, args: tuple, kwargs: dict) -> Config:
        """In the kernel's own phase at level 1/2: search if needed (agreed across ranks), else use the cache."""
        if level == AutotuneLevel.FORCE and self.kernel_type is AutotuneKernelType.DECODE_ATTENTION:
            _log_force_as_adaptive()
            level = AutotuneLevel.ADAPTIVE
        cached = state.configs.get(run_key, _MISSING)
        again = level == AutotuneLevel.FORCE or 0 < state.cut.get(run_key, 0) <= CUT_RESUMES  # once a process
        need = cached is _MISSING or (again and run_key not in state.searched)
        if dist.world() == 1:
            return self._search(state, run_key, args, kwargs, split=False) if need else cached
        if run_key in state.decided:  # whatever this rank dropped since (alone): the others gather no more
            return cached if cached is not _MISSING else self._lookup(state, run_key)
        state.decided.add(run_key)
        mine = (key_to_json(freeze(state.static_key)), key_to_json(run_key), need, None if need else cached)
        infos = dist.all_gather_object(mine)
        if any(info[:2] != mine[:2] for info in infos):
            logger.warning(
                "autotune %s: ranks disagree on keys (%s); each rank decides alone",
                self.kernel_name,
                "; ".join(f"rank {r}: {s} {k}" for r, (s, k, _, _) in enumerate(infos)),
            )
            return self._search(state, run_key, args, kwargs, split=False) if need else cached
        if any(info[2] for info in infos):
            return self._search(state, run_key, args, kwargs, split=True)
        agreed = infos[0][3]  # every rank has a config: all take rank 0's
        if agreed == cached:
            return cached  # the very object, so the run key's memo of its launched config stays valid
        state.configs[run_key] = agreed
        state.resolved.clear()
        state.generation += 1
        return agreed

    def _warm_cached_configs(self, state: _StaticKeyState, args: tuple, kwargs: dict) -> None:
        """Run each cached config once so Triton compiles them at start-up, not on a live request."""
        pending = {}
        for config in state.configs.values():
            text = key_to_json(config)
            if config is not None and text not in state.warmed:
                pending[text] = config
        if not pending:
            return
        snapshot = _Snapshot(self._mutates_picker.pick(args, kwargs))
        self._compile_ahead(list(pending.values()), [(args, kwargs)], snapshot.restore)
        for text, config in pending.items():
            state.warmed.add(text)
            try:
                self.fn(*args, run_config=config, **kwargs)
            except Exception as e:  # a stale config must not stop start-up; the search or default takes over
                self._drop(state, config, f"failed to launch ({type(e).__name__}: {e})", "its run keys count as misses")
            finally:
                snapshot.restore()

    # ---- search ---------------------------------------------------------------------------------------

    def _search(self, state: _StaticKeyState, run_key: Any, args: tuple, kwargs: dict, split: bool) -> Config:
        if _is_capturing():
            raise RuntimeError(
                f"autotune kernel {self.kernel_name!r}: refusing to search while a CUDA graph is being captured; "
                "run one eager forward inside autotune_warmup(...) before capturing"
            )
        if precompile.compiling():
            raise RuntimeError(
                f"autotune kernel {self.kernel_name!r}: refusing to search inside another kernel's compile pass, "
                "where no launch runs"
            )
        start = search_clock()
        budget = envs.get_autotune_max_seconds_per_search()
        rule = envs.get_autotune_choice_rule(self.choice_rule)
        candidates = self._space(args, kwargs).candidates
        scenarios = self._rebuild(args, kwargs) if self.rebuild_input_func else [(args, kwargs)]
        rank, world = (dist.rank(), dist.world()) if split else (0, 1)
        mine = [i for i in range(len(candidates)) if i % world == rank]  # ranks time disjoint slices
        trials = [_Trial(self, t_args, t_kwargs) for t_args, t_kwargs in scenarios]
        compiled = self._compile_ahead(
            [None] + [candidates[i] for i in mine],
            scenarios,
            lambda: [trial.snapshot.restore() for trial in trials],
        )
        timings: Dict[int, List[float]] = {}
        try:
            default_ms = [trial.measure(None) for trial in trials]  # first: the bar every candidate must beat
            bar = tqdm(mine, desc=f"autotune {self.kernel_name}", delay=2.0, leave=False, disable=rank != 0)
            for i in bar:
                if search_clock() - start > budget:
                    resumes = state.cut.get(run_key, 0) < CUT_RESUMES
                    logger.warning(
                        "autotune %s: search budget of %gs spent after %d of %d candidates; keeping the best so far%s",
                        self.kernel_name,
                        budget,
                        len(timings),
                        len(mine),
                        " (the next start at level 1 searches this key again)" if resumes else "",
                    )
                    break
                timings[i] = []
                for trial in trials:  # a failure on one input rules the candidate out
                    timings[i].append(trial.measure(candidates[i]) if all(map(math.isfinite, timings[i])) else math.inf)
            bar.close()
        finally:
            for trial in trials:
                trial.snapshot.restore()
        first_pass, retime_start = {}, search_clock()  # a split search's re-timing seconds include the gather
        retime = retime_start - start <= budget
        if split:  # every rank takes rank 0's default and its word on re-timing, which gathers again
            parts = dist.all_gather_object((default_ms, timings, retime))
            default_ms, retime = parts[0][0], parts[0][2]
            timings = {i: ms for _, part, _ in parts for i, ms in part.items()}
        if retime:
            default_ms, first_pass = self._retime(trials, candidates, default_ms, timings, rule, split)
        retime_seconds = search_clock() - retime_start
        winner = choose(default_ms, timings, rule)
        best, best_ms = (None, default_ms) if winner < 0 else (candidates[winner], timings[winner])
        if not all(map(math.isfinite, best_ms)):
            raise RuntimeError(f"autotune kernel {self.kernel_name!r}: no config, the default included, could run")
        seconds = search_clock() - start
        self.last_search = SearchRecord(
            state.static_key,
            run_key,
            rule,
            default_ms,
            [(c, timings.get(i, [math.inf] * len(trials))) for i, c in enumerate(candidates)],
            best,
            best_ms,
            seconds,
            first_pass,
            retime_seconds,
            compiled.seconds,
            compiled.kernels,
        )
        self._log_search(self.last_search, len(timings))
        cut = len(timings) < len(candidates)
        self._adopt(state, run_key, best, best_ms[0], default_ms[0], len(timings), cut, write=not split or rank == 0)
        STATS.searches += 1
        STATS.search_seconds += seconds
        return best

    def _compile_ahead(self, configs: list, inputs, restore: Callable[[], object]) -> precompile.CompilePass:
        """Compile ``configs`` for each of ``inputs`` (``(args, kwargs)`` pairs) on a thread pool before any of them
        runs (autotuner/precompile.py); ``restore`` undoes the launchers' own writes to mutated inputs."""
        threads = envs.get_autotune_compile_threads() or precompile.default_threads(dist.world())
        if len(configs) < 2 or not precompile.usable(threads):
            return precompile.CompilePass()

        def run(config):
            for args, kwargs in inputs:
                self.fn(*args, run_config=config, **kwargs)

        try:
            done = precompile.compile_ahead(run, configs, threads, search_clock)
        finally:
            restore()
        STATS.kernels_compiled_ahead += done.kernels
        STATS.compile_ahead_seconds += done.seconds
        return done

    def _retime(self, trials, candidates, default_ms, timings, rule, split) -> tuple:
        """Time the default and the ``FINALISTS`` leading candidates once more, in the reverse of their first order,
        each keeping its faster time per scenario; returns ``(default_ms, first_pass)`` and updates ``timings``.

        A guard for the default, timed first on inputs just made: in one H200 run of benchmarks/decode_attention.py
        such first launches ran up to 12 % slow at 1K. In the tuner's own decode searches on the H200 they ran at
        most 1.1 % slow, and the re-timing moved 3 of 22 picks by at most 0.5 points of worst-case loss for
        0.33-0.59 s a search (benchmarks/autotune_retime.py). Under a split search every rank re-times the same
        finalists and all take rank 0's times."""
        leaders = [i for i in ranking(default_ms, timings, rule) if i >= 0 and all(map(math.isfinite, timings[i]))]
        finalists = sorted(leaders[:FINALISTS], reverse=True) + [-1]
        again = {}
        try:
            for i in finalists:
                config = None if i < 0 else candidates[i]
                again[i] = [trial.measure(config, again=True) for trial in trials]
        finally:
            for trial in trials:
                trial.snapshot.restore()
        if split:
            again = dist.all_gather_object(again)[0]
        first_pass = {i: list(default_ms if i < 0 else timings[i]) for i in again}
        for i, ms in again.items():
            kept = [min(a, b) for a, b in zip(first_pass[i], ms)]
            if i >= 0 and not all(map(math.isfinite, ms)):  # raised or disagreed this time: out, whatever it did before
                kept = [math.inf] * len(ms)
            if i < 0:
                default_ms = kept
            else:
                timings[i] = kept
        return default_ms, first_pass

    def _rebuild(self, args: tuple, kwargs: dict) -> List[Tuple[tuple, dict]]:
        """Timing inputs: ``rebuild_input_func`` gets every launcher argument by name (defaults filled) in one
        dict and returns such a dict, or a list of them (the first is the tuning point); launched by keyword."""
        rebuilt = self.rebuild_input_func(self.named_arguments(args, kwargs))
        many = rebuilt if isinstance(rebuilt, list) else [rebuilt]
        if not many or not all(isinstance(r, dict) for r in many):
            got = (
                type(rebuilt).__name__
                if not isinstance(rebuilt, list)
                else f"a list of {len(rebuilt)}: " + (", ".join(sorted({type(r).__name__ for r in rebuilt})) or "empty")
            )
            raise TypeError(
                f"autotune kernel {self.kernel_name!r}: rebuild_input_func must return a dict of named launcher "
                f"arguments or a non-empty list of them, got {got}"
            )
        for named in many:
            try:
                self.signature.bind(**named)
            except TypeError as e:
                raise TypeError(
                    f"autotune kernel {self.kernel_name!r}: rebuild_input_func returned arguments that don't fit "
                    f"launcher {self.fn.__qualname__}{self.signature}: {e}"
                ) from None
        return [((), dict(named)) for named in many]

    def named_arguments(self, args: tuple, kwargs: dict) -> Dict[str, Any]:
        """Every launcher parameter of one call by name, defaults filled, ``run_config`` left out."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named = dict(bound.arguments)
        named.pop("run_config", None)
        return named

    def _log_search(self, record: SearchRecord, timed: int) -> None:
        best, default = record.chosen_ms[0], record.default_ms[0]
        extra = ""
        if len(record.default_ms) > 1:
            everyone = [record.default_ms] + [t for _, t in record.timings if all(map(math.isfinite, t))]
            per_best = per_scenario_best(everyone)
            extra = (
                f", worst-case loss {worst_case_loss(record.chosen_ms, per_best) - 1:.1%} over {len(per_best)} inputs"
            )
            i = choose(record.default_ms, {i: t for i, (_, t) in enumerate(record.timings)}, "tuning_len")
            fastest = record.default_ms if i < 0 else record.timings[i][1]
            if fastest[0] < best:  # the rule gave up speed at the first input for the other inputs
                name = "default" if i < 0 else key_to_json(record.timings[i][0])
                extra += (
                    f"; best at tuning length was {name} ({fastest[0]:.4f} ms, worst-case loss "
                    f"{worst_case_loss(fastest, per_best) - 1:.1%}), chosen by {record.rule}"
                )
        if record.kernels_compiled:
            extra += f"; {record.kernels_compiled} kernels compiled ahead in {record.compile_seconds:.2f}s"
        logger.info(
            "autotune %s %s run_key=%s: %s %.4f ms, %.2fx over default (%.4f ms), %d candidates in %.2fs%s",
            self.kernel_name,
            key_to_json(record.static_key),
            key_to_json(record.run_key),
            "default" if record.chosen is None else key_to_json(record.chosen),
            best,
            default / best if best > 0 else 1.0,
            default,
            timed,
            record.seconds,
            extra,
        )

    def _adopt(self, state, run_key, config, best_ms: float, default_ms: float, timed: int, cut: bool, write: bool):
        """Use and store a search's winner; ``cut``: the budget ended the search early (counted in its timing)."""
        state.configs[run_key] = config
        state.resolved.clear()
        state.generation += 1
        state.searched.add(run_key)
        state.cut[run_key] = state.cut.get(run_key, 0) + 1 if cut else 0
        if config is not None:
            state.warmed.add(key_to_json(config))
        if write:
            timing = {"best_ms": round(best_ms, 6), "default_ms": round(default_ms, 6), "candidates": timed}
            if cut:
                timing["cut"] = state.cut[run_key]
            entry = {run_key: (config, timing)}
            if self.store.save(state.static_key, freeze(state.static_key), entry) is not None:
                STATS.configs_written += 1

    def clear_cache(self) -> None:
        """Forget what this process loaded and tuned (the files stay)."""
        for state in [*self._states.values(), _UNTUNED]:  # plans made before hold these: they resolve again
            state.generation += 1
        self._states.clear()


class _Snapshot:
    """Clones of the tensors a kernel mutates, to restore after each candidate run."""

    def __init__(self, tensors: Dict[str, Any]):
        self.saved = [(t, t.clone()) for t in tensors.values() if isinstance(t, torch.Tensor)]

    def restore(self) -> None:
        for tensor, copy in self.saved:
            tensor.copy_(copy)


class _Trial:
    """Runs candidates on one set of (possibly rebuilt) inputs: eager run, accuracy gate, timing."""

    def __init__(self, tuner: Autotuner, args: tuple, kwargs: dict):
        self.tuner, self.args, self.kwargs = tuner, args, kwargs
        self.snapshot = _Snapshot(tuner._mutates_picker.pick(args, kwargs))
        self.reference: Optional[List[torch.Tensor]] = None

    def _outputs(self, returned: Any) -> List[torch.Tensor]:
        named = {**self.tuner._mutates_picker.pick(self.args, self.kwargs)}
        named.update(self.tuner._outputs_picker.pick(self.args, self.kwargs))
        return collect_tensors(returned) + [t for t in named.values() if isinstance(t, torch.Tensor)]

    def measure(self, config: Config, again: bool = False) -> float:
        """Milliseconds per run, or inf when the config fails or disagrees with the default's outputs; the first
        pass screens (``screen_bench_func``), ``again`` (a re-timing, counted apart) times in full."""
        tuner = self.tuner

        def run():
            return tuner.fn(*self.args, run_config=config, **self.kwargs)

        try:
            outputs = self._outputs(run())
            if self.reference is None:
                self.reference = [t.detach().clone() for t in outputs]
            else:
                why = mismatch(self.reference, outputs, tuner.accuracy_tol)
                if why is not None:
                    STATS.candidates_rejected += 1
                    logger.warning(
                        "autotune %s: rejected %s, disagrees with default: %s", tuner.kernel_name, config, why
                    )
                    return math.inf
            self.snapshot.restore()
            ms = float((get_bench_func() if again else screen_bench_func())(run))
            if again:
                STATS.candidates_retimed += 1
            else:
                STATS.candidates_timed += 1
            return ms if ms >= 0 else math.inf
        except Exception as e:
            if config is None:
                raise RuntimeError(f"autotune kernel {tuner.kernel_name!r}: launcher default failed: {e}") from e
            logger.info("autotune %s: config %s failed (%s: %s)", tuner.kernel_name, config, type(e).__name__, e)
            return math.inf
        finally:
            self.snapshot.restore()


def _log_force_as_adaptive() -> None:
    global _force_as_adaptive_logged
    if not _force_as_adaptive_logged:
        _force_as_adaptive_logged = True
        logger.info(
            "%s=2 (force) acts as 1 (adaptive) for decode-attention kernels: every layer calls the same key. "
            "To re-tune one, clear its configs (python -m lightllm.common.autotuner clear KERNEL) and, where configs "
            "ship for it, set LIGHTLLM_AUTOTUNE_IGNORE_SHIPPED=KERNEL; then start at level 1",
            envs.AUTOTUNE_LEVEL,
        )


def autotune(
    kernel_name: str,
    configs_gen_func: Callable[..., Iterable[dict]],
    static_key_func: Callable[..., Any],
    run_key_func: Callable[..., Any],
    run_key_distance_func: Callable[[Any, Any], float] = default_run_key_distance,
    mutates_args: Sequence[str] = (),
    kernel_type: AutotuneKernelType = AutotuneKernelType.GENERAL,
    rebuild_input_func: Optional[Callable[[Dict[str, Any]], Any]] = None,
    warmup_all_exist_config: bool = True,
    output_args: Sequence[str] = (),
    accuracy_tol: Optional[Tuple[float, float]] = None,
    choice_rule: str = "minimax_loss",
) -> Callable[[Callable], Autotuner]:
    """Declare how a launcher ``fn(..., run_config=None)`` is tuned.

    Args:
        kernel_name: names the config folder; change it (or the store version) when the kernel changes.
        configs_gen_func: candidate configs (dicts); may name launcher parameters to prune by shape.
        static_key_func / run_key_func: name launcher parameters and return a JSON-able key. The static
            key selects a config file (shapes that compile differently); the run key an entry in it.
        run_key_distance_func: ``(run_key, cached_run_key) -> distance`` to pick the nearest cached key.
        mutates_args: tensors the kernel changes in place; cloned and restored around each candidate.
        kernel_type: the warmup phase in which the kernel may search.
        rebuild_input_func: ``(named: dict) -> dict | list[dict]``: gets the call's launcher arguments by name
            (defaults filled) and returns representative inputs by name, used only for timing a search; a list
            times several inputs, the first being the tuning point.
        warmup_all_exist_config: during any warmup, run each cached config once so Triton compiles it.
        output_args: out-parameters the kernel overwrites; compared by the accuracy gate, never cloned.
        accuracy_tol: ``(rtol, atol)`` for the gate, atol in units of the reference output's RMS.
        choice_rule: how a search over several inputs picks its winner (``choice.py``);
            ``LIGHTLLM_AUTOTUNE_CHOICE_RULE``, when set, overrides it for every kernel.
    """

    def decorator(fn: Callable) -> Autotuner:
        return Autotuner(
            fn,
            kernel_name,
            configs_gen_func,
            static_key_func,
            run_key_func,
            run_key_distance_func,
            mutates_args,
            kernel_type,
            rebuild_input_func,
            warmup_all_exist_config,
            output_args,
            accuracy_tol,
            choice_rule,
        )

    return decorator
