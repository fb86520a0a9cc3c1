"""Model runner: loads the model, sizes the KV cache, warms up and captures decode graphs, runs steps.

Start-up, top to bottom (``ModelRunner.__init__``):
1. read the model config and fit the options to it (context length, KV group size), load weights, size
   the KV pool: on a GPU from the peak of a profiling prefill and decode over a scratch pool (no tuning
   there), on the CPU from the available RAM (``common/kv_cache/sizing.py``); the prefix cache over it is on
   unless ``--disable_dynamic_prompt_cache`` or the model says it can't reuse a prefix;
2. GENERAL warmup: dummy prefills at a spread of lengths up to the prefill step's tokens, every prefill graph
   bucket among them (with chunked prefill, each also as a second chunk);
3. decode graphs per KV length bucket (``--graph_len_buckets``, then ``--graph_max_len_in_batch``), longest
   bucket first, each bucket's largest batch first: per graph one eager decode forward launched for its bucket in
   the DECODE_ATTENTION scope (decode-attention kernels tune there, at lengths up to the bucket), then the capture;
4. prefill graphs (``engine/prefill_graphs.py``) into the decode graphs' pool, largest bucket first: per bucket
   one eager forward outside any scope, then the capture (one log line: graphs, memory, seconds);
5. with tensor parallelism, a check that every rank holds the same configs (one log line);
6. one summary line.
"""

import logging
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch

from lightllm.common import envs
from lightllm.common.autotuner import (
    AutotuneKernelType,
    AutotuneLevel,
    autotune_warmup,
    check_rank_agreement,
    get_autotune_stats,
)
from lightllm.common.autotuner.dist import all_gather_object
from lightllm.common.cuda_graph import DecodeGraphs, describe_costs
from lightllm.common.kv_cache import KVCacheManager
from lightllm.common.kv_cache.sizing import (
    GIB,
    GpuProfile,
    check_table_fits,
    cpu_pool_tokens,
    default_memory_api,
    describe_gpu_sizing,
    gpu_pool_tokens,
)
from lightllm.common.transfer import host_to_device, tensor_to_device
from lightllm.engine.args import EngineArgs
from lightllm.engine.mtp_runner import MTPRunner, check_mtp, draft_dir
from lightllm.engine.prefill_graphs import PrefillGraphs, PrefillStaging, prefill_buckets
from lightllm.engine.staging import DecodeStaging
from lightllm.layers import parallel
from lightllm.layers.attention import AttentionBackend, check_head_dim, make_pool
from lightllm.layers.infer_state import InferState
from lightllm.layers.linear_attention import SSM_DATA_TYPES
from lightllm.kernels.attention.decode.tuning import decode_attn_tuning_len, served_floor, set_decode_graph_lens
from lightllm.models.hf_config import checkpoint_dtype
from lightllm.models.registry import read_model_config

logger = logging.getLogger(__name__)

PROFILE_POOL_TOKENS = 256  # the profiling forward's scratch KV pool; its token indices wrap
# Triton compiles one program per specialization of a kernel's integer arguments (1, a multiple of 16, any other)
# and of its pointers' 16-byte alignment. The warm-up ladder's prompts are multiples of 16 and live ones mostly are
# not, so these batches (a prompt length per request) compile the other programs at start-up rather than in a
# live request's prefill, where they cost seconds on an empty Triton cache (docs/engine.md, "Start-up"). 97 is past
# Qwen3.5's fused recurrent limit (64 new tokens): its chunked kernels run.
UNALIGNED_WARMUP_BATCHES = ((1,), (17,), (17, 15), (33, 1), (97,), (97, 33))


class ModelRunner:
    _staging: Optional[DecodeStaging] = None  # the decode steps' staging buffer, made with the graphs' inputs
    prefill_graphs: Optional[PrefillGraphs] = None  # set after the decode graphs: the warm-up prefills run eagerly
    mtp: Optional[MTPRunner] = None  # with --mtp_mode: the draft / verify / accept steps (mtp_runner.py)
    _launch_hook: Optional[Callable[[], None]] = None  # called right before a step's forward is launched

    def __init__(self, args: EngineArgs, graph_api=None, memory_api=None):
        args.normalize()
        envs.validate_all()
        self.args = args
        self.device = torch.device(args.device)
        seconds = {}
        t = time.perf_counter()
        from lightllm.tools.make_tiny_model import default_model_dir

        self.model_dir = args.model_dir or str(default_model_dir())
        self.family, self.config = read_model_config(self.model_dir)
        args.fit_to_model(self.config.max_position_embeddings, self.config.head_dim, checkpoint_dtype(self.model_dir))
        check_head_dim(self.config.head_dim, self.device)
        self.tp_rank, self.tp = parallel.rank(), parallel.world()
        self.family.check_tp(self.config, self.tp)
        check_mtp(args, self.family, self.config, self.model_dir)
        mtp = {}  # only a family with an MTP head takes these
        if args.mtp_mode is not None:
            mtp = {"mtp": True, "mtp_dir": draft_dir(args, self.model_dir)}
        self.model = self.family.build(Path(self.model_dir), self.config, args.torch_dtype, self.device, self.tp_rank,
                                       self.tp, **mtp)  # fmt: skip
        seconds["load"] = time.perf_counter() - t

        t = time.perf_counter()
        use_graphs = not args.disable_cudagraph and (self.device.type == "cuda" or graph_api is not None)
        buckets = self._prefill_graph_buckets() if use_graphs else []
        # the decode graphs' batch sizes: each but the largest keeps its logits as extra graph memory (once: the
        # graphs of every KV length bucket share one output per size, common/cuda_graph.py); with more than one
        # bucket, a shorter bucket's largest capture holds its own logits beside the shared ones, once more
        sizes = args.graph_batch_sizes()
        graph_sizes = (sizes + sizes[-1:] * (len(args.graph_lens()) > 1)) if use_graphs else []
        # each bucket's decode attention tunes on (and keys by) the lengths its own graph serves; eager steps key alike
        set_decode_graph_lens(args.graph_lens() if use_graphs and args.graph_len_buckets else ())  # one bucket: none
        self._init_kv_cache(memory_api or default_memory_api(self.device), graph_sizes, buckets)
        seconds["kv sizing"] = time.perf_counter() - t

        stats0, t = get_autotune_stats(), time.perf_counter()
        every_size = self.device.type == "cuda" or use_graphs
        with autotune_warmup(AutotuneKernelType.GENERAL):
            self._warmup_prefill(buckets, every_size)
        if every_size:  # outside the tuning scope: compiles only
            self._warmup_unaligned()
        if self.kv.prefix is not None:  # random warm-up prompts: nothing a live request could reuse
            self.kv.prefix.clear()
        seconds["general warmup"] = time.perf_counter() - t

        self.graphs: Optional[DecodeGraphs] = None
        self.decode_graph_costs = {}  # per KV length bucket: (graphs, seconds, bytes) its capture took
        if use_graphs or self.device.type == "cuda":  # eager decode steps stage their inputs too
            self._init_graph_buffers()
        if use_graphs:
            lens = args.graph_lens()
            # each kernel times its own ladder between these (tuning.py)
            floors = [served_floor(n) for n in lens]
            ranges = "; ".join(
                f"{decode_attn_tuning_len(n)}" + (f" down to {f}" if f else "") for n, f in zip(lens, floors)
            )
            logger.info("decode graphs per KV length bucket up to %s; decode attention tunes at %s (from %s, capped at "
                        "each bucket, down to the bucket below)", ", ".join(map(str, lens)), ranges,
                        envs.DECODE_ATTN_AUTOTUNE_SEQ_LEN)  # fmt: skip
            t = time.perf_counter()
            if self.mtp is not None:  # MTP's verify and draft steps are what decodes (mtp_graphs.py)
                self.mtp.capture_graphs(args.graph_batch_sizes(), lens, graph_api)
                self.decode_graph_costs = self.mtp.graphs.costs
                seconds["mtp graphs"] = time.perf_counter() - t
            else:
                self.graphs = DecodeGraphs(args.graph_batch_sizes(), lens, graph_api).capture_all(self._graph_decode)
                self.decode_graph_costs = self.graphs.costs
                seconds["decode graphs"] = time.perf_counter() - t
        if buckets:
            t = time.perf_counter()
            self.prefill_graphs = self._capture_prefill_graphs(buckets, graph_api)
            seconds["prefill graphs"] = time.perf_counter() - t
            logger.info("prefill graphs: %d captured (buckets %s tokens, %s) in %.1f s, %.1f MiB in the decode "
                        "graphs' pool", self.prefill_graphs.num_graphs, ", ".join(map(str, buckets)),
                        "with and without a cached prefix" if self.prefill_graphs.prefixed else "no cached prefix",
                        seconds["prefill graphs"], self.prefill_graphs.memory_bytes / 2**20)  # fmt: skip
        if self.tp > 1:  # agreement is built into every search; this proves it held end to end
            check_rank_agreement()
        tuned = get_autotune_stats() - stats0
        prefill = self.prefill_graphs
        costs = self.decode_graph_costs
        logger.info(
            "ready: %d decode graphs (%.1f MiB%s), %d prefill graphs (%.1f MiB), %d kernels tuned%s, %d configs "
            "written%s; %s",
            sum(g for g, _, _ in costs.values()),
            sum(b for _, _, b in costs.values()) / 2**20,
            f"; per KV length bucket {describe_costs(costs)}" if len(costs) > 1 else "",
            prefill.num_graphs if prefill else 0,
            (prefill.memory_bytes if prefill else 0) / 2**20,
            tuned.searches,
            _untuned_device_note(self.device),
            tuned.configs_written,
            (f", {tuned.kernels_compiled_ahead} kernels compiled ahead in {tuned.compile_ahead_seconds:.1f}s"
             if tuned.kernels_compiled_ahead else ""),  # fmt: skip
            ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()),
        )
        self.startup_seconds = seconds

    # ---- KV cache ------------------------------------------------------------------------------------------

    def _init_kv_cache(self, memory_api, graph_sizes: Sequence[int], prefill_buckets: Sequence[int]) -> None:
        a, c = self.args, self.config
        max_reqs = a.running_max_req_size + 1  # one slot is the padding request of graph batches
        contiguous = False  # FA3 (decode or prefill) without paged KV reads each request's fixed row of the pool
        fa3_flags = [flag for flag, backend in a.attention_backends().items() if backend == "fa3"]
        if fa3_flags and self.device.type == "cuda":
            from lightllm.kernels.attention.decode.fa3 import require_fa3

            contiguous = not require_fa3(self.device, fa3_flags[0]).paged
        row_len = a.max_req_total_len + a.spec_tokens - 1
        if not memory_api.profiles:  # the CPU: a table too big for the RAM is refused before anything is allocated
            check_table_fits(memory_api.available(), max_reqs, row_len)
        # per-request model state (linear attention) first, so the GPU profile and the RAM reading count it
        ssm_dtype = SSM_DATA_TYPES[a.linear_att_ssm_data_type]
        # prefix-cache checkpoints of that state, where the prefix cache can be on at all
        cache_off = self._prefix_cache_off(contiguous)
        checkpoints = a.linear_att_cache_size if cache_off is None else 0
        # MTP: one state slot per verified token (mtp_runner.py)
        state_bytes = self.model.alloc_request_state(max_reqs, ssm_dtype, checkpoints=checkpoints,
                                                     slots_per_request=a.spec_tokens)  # fmt: skip
        checkpoints = checkpoints if state_bytes else 0  # a model without state keeps none
        # MTP: the head's KV is one more pool layer; a row also holds a verify's drafts past max_req_total_len
        kv_layers = c.num_kv_layers + (a.mtp_mode is not None)
        rows = max_reqs * a.spec_tokens + checkpoints  # MTP: a state slot per verified token
        held = f"{max_reqs} slots" + (f" + {checkpoints} prefix-cache checkpoints" if checkpoints else "")
        state_note = (f"; request state {state_bytes / 2**20:.2f} MiB ({held} x {state_bytes // rows} B, "
                      f"ssm {a.linear_att_ssm_data_type}) allocated before sizing" if state_bytes else "")  # fmt: skip
        # a one-token pool on the meta device: bytes per token of whichever KV type, nothing allocated
        per_token = make_pool(a.llm_kv_type, 1, kv_layers, self.model.kv_heads, c.head_dim,
                              a.torch_dtype, "meta", a.llm_kv_quant_group_size).bytes_per_token()  # fmt: skip
        if contiguous:  # fixed per-request rows
            num_tokens = max_reqs * row_len
        elif memory_api.profiles:
            profile = self._profile_memory(memory_api, graph_sizes, prefill_buckets)
            num_tokens = gpu_pool_tokens(profile, a.mem_fraction, per_token, a.max_total_token_num)
            logger.info("%s%s", describe_gpu_sizing(profile, a.mem_fraction, per_token, num_tokens), state_note)
        else:
            available = memory_api.available()
            num_tokens = cpu_pool_tokens(available, a.mem_fraction, per_token, max_reqs * a.max_req_total_len,
                                         a.max_total_token_num, table_bytes=max_reqs * row_len * 4)  # fmt: skip
            logger.info("KV cache sizing: %.2f GiB RAM available x --mem_fraction %s, at most %d requests of %d "
                        "tokens -> %d tokens x %d B%s", available / GIB, a.mem_fraction, max_reqs,
                        a.max_req_total_len, num_tokens, per_token, state_note)  # fmt: skip
        if self.tp > 1:  # ranks share token indices: every pool takes the smallest rank's size
            num_tokens = min(all_gather_object(num_tokens))
        if num_tokens - 1 < row_len:  # one token is the padding request's
            drafts = f" + --mtp_step {a.mtp_step}" if a.mtp_mode is not None else ""
            raise ValueError(f"the KV cache holds {num_tokens} tokens, fewer than one --max_req_total_len "
                             f"({a.max_req_total_len}){drafts} request plus padding: raise --max_total_token_num or "
                             "--mem_fraction, or lower --max_req_total_len")  # fmt: skip
        prefix_cache = self._use_prefix_cache(cache_off)  # a model with checkpoints has no blocker: they stay
        # MTP: the head's KV at a position reads the next token too, so the tree keys a slot by both
        self.kv = KVCacheManager(num_tokens, max_reqs, row_len, self.device, contiguous_slots=contiguous,
                                 prefix_cache=prefix_cache, state_checkpoints=checkpoints,
                                 next_token_keys=a.mtp_mode is not None)  # fmt: skip
        pool = make_pool(a.llm_kv_type, num_tokens, kv_layers, self.model.kv_heads, c.head_dim,
                         a.torch_dtype, self.device, a.llm_kv_quant_group_size)  # fmt: skip
        # fa3 picks its layout too
        self.attn = AttentionBackend(pool, a.llm_decode_att_backend, self.device, a.llm_prefill_att_backend)
        self.model.set_attention(self.attn)
        self.pad_slot = self.kv.add_request()
        self.pad_token = int(self.kv.extend(self.pad_slot, 1)[0])
        self.mtp = MTPRunner(self, a.mtp_step, max_reqs) if a.mtp_mode is not None else None
        logger.info("KV cache: %d tokens (%s, %s, prefix cache %s)", num_tokens, a.llm_kv_type, "contiguous slots"
                    if contiguous else "token pool", "on" if prefix_cache else "off")  # fmt: skip

    def _prefix_cache_off(self, contiguous: bool) -> Optional[str]:
        """Why the prefix cache is off whatever the model ("" when turned off by its flag), None when it can be on."""
        if self.args.disable_dynamic_prompt_cache:
            return ""
        if contiguous:
            return "the FA3 build without paged KV gives each request a fixed row of the pool"
        return None

    def _use_prefix_cache(self, why: Optional[str]) -> bool:
        """The prefix cache is on unless turned off, or the KV layout (``why``, from :meth:`_prefix_cache_off`) or
        the model can't reuse a prefix (one log line)."""
        if why is None:
            why = self.model.prefix_cache_blocker()
            why = why and f"the model's {why}"
        if why:
            logger.info("prefix cache (dynamic prompt cache) off: %s", why)
        return why is None

    def _profile_memory(self, memory_api, graph_sizes: Sequence[int], prefill_buckets: Sequence[int]) -> GpuProfile:
        """The worst forwards the server runs (a prefill of ``prefill_step_tokens`` tokens with chunked prefill, else
        of ``max(batch_max_tokens, max_req_total_len)``, a
        ``running_max_req_size`` decode at ``max_req_total_len``) over a scratch pool whose token indices wrap,
        outside any autotune scope so no kernel searches on dummy data; their peak allocation above the state before
        them. The decode graphs are estimated to keep the decode peak plus the float32 logits each smaller size's graph
        holds as its output; the prefill graphs the profiled prefill's peak scaled to the largest bucket's tokens
        (activations grow with tokens) plus the logits row each of up to two graphs per bucket holds."""
        a, c, dev = self.args, self.config, self.device
        scratch = make_pool(a.llm_kv_type, PROFILE_POOL_TOKENS, c.num_kv_layers, self.model.kv_heads, c.head_dim,
                            a.torch_dtype, dev, a.llm_kv_quant_group_size)  # fmt: skip
        self.model.set_attention(AttentionBackend(scratch, a.llm_decode_att_backend, dev, a.llm_prefill_att_backend))
        max_reqs, max_len = a.running_max_req_size + 1, a.max_req_total_len
        table = (torch.arange(max_len, device=dev) % PROFILE_POOL_TOKENS).to(torch.int32).repeat(max_reqs, 1)
        # without chunking a prompt longer than batch_max_tokens still prefills, alone (as does a re-prefill)
        most = a.prefill_step_tokens if not a.disable_chunked_prefill else max(a.batch_max_tokens, max_len)
        sizes = _prefill_sizes(most, max_len, a.running_max_req_size)
        prefill = InferState.packed_prefill(range(len(sizes)), table, [0] * len(sizes), sizes,
                                            torch.arange(sum(sizes)) % PROFILE_POOL_TOKENS, dev)  # fmt: skip
        i32 = dict(dtype=torch.int32, device=dev)
        bs = a.running_max_req_size * a.spec_tokens  # MTP: a verify step's tokens, as that many one-token rows
        decode = InferState(
            is_prefill=False,
            b_req_idx=torch.arange(bs, **i32) % max_reqs,
            req_to_token=table,
            b_seq_len=torch.full((bs,), max_len, **i32),
            out_token_idx=torch.arange(bs, device=dev) % PROFILE_POOL_TOKENS,
            positions=torch.full((bs,), max_len - 1, dtype=torch.int64, device=dev),
            max_len_in_batch=max_len,
        )
        peaks = []
        base = memory_api.allocated()
        for state in (prefill, decode):
            memory_api.reset_peak()
            self.model.forward(torch.zeros(state.positions.shape[0], dtype=torch.int64, device=dev), state)
            peaks.append(memory_api.peak_allocated() - base)
        self.model.set_attention(None)
        del scratch, table, prefill, decode, state
        used, total = memory_api.used_and_total()
        # MTP: each size's verify graph holds N + 1 rows of logits per request (the profiled decode has the largest
        # size's), its first-draft graph one more and (N > 1) its draft-step graph one more, each set in its own pool
        heads = (a.mtp_mode is not None) + (a.mtp_mode is not None and a.mtp_step > 1)
        largest = max(graph_sizes, default=0)
        outputs = (sum(sorted(graph_sizes)[:-1]) * (a.spec_tokens + heads) + largest * heads) * c.vocab_size * 4
        prefill_graphs = _prefill_graphs_estimate(peaks[0], sum(sizes), prefill_buckets, c.vocab_size)
        return GpuProfile(total=total, used=used, torch_allocated=memory_api.allocated(), activation_peak=max(peaks),
                          graph_estimate=peaks[1] + outputs if graph_sizes else 0,
                          prefill_graph_estimate=prefill_graphs)  # fmt: skip

    # ---- steps ---------------------------------------------------------------------------------------------

    def set_launch_hook(self, hook: Optional[Callable[[], None]]) -> None:
        """``hook()`` runs right before each prefill or decode forward is launched, once the host has staged its
        inputs: where the engine's step GPU timer starts (``engine/gpu_timer.py``)."""
        self._launch_hook = hook

    def _launching(self) -> None:
        if self._launch_hook is not None:
            self._launch_hook()

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        publish: Sequence[Tuple[int, bool]] = (),
        following: Sequence[Optional[int]] = (),
    ) -> torch.Tensor:
        """Append each request's new tokens to its KV and run them as one packed prefill; float32 logits of each
        request's last new token. A slot that already holds tokens (the earlier chunks of a chunked prefill) is
        continued: its new tokens sit after them and attend to them (and Qwen3.5's state slot carries on). One
        request within a prefill graph's bucket replays that graph (its logits valid until the next replay).
        ``publish``: ``(slot, lasting)`` of the rows whose computed tokens the prefix cache takes now, while they run
        (``kv.publish``), with their state (Qwen3.5) copied into the checkpoint it records after them, before any
        later forward moves it. ``following`` (MTP, one per row): the token after each chunk, None after a prompt's
        last: the head's KV at a chunk's last position reads it (``MTPRunner.prefill``)."""
        lens = [len(p) for p in prompts]
        prefix = [self.kv.seq_len(s) for s in slots]
        token_idx = self.kv.extend_many(slots, lens)  # one allocation and one table write for the step
        logits = None
        if self.prefill_graphs is not None and len(slots) == 1:  # one request within a bucket: a graph replay
            logits = self.prefill_graphs.prefill(slots[0], prefix[0], prompts[0], token_idx, self._launching)
        if logits is None:
            logits = self._prefill_eager(slots, prompts, lens, prefix, token_idx, following)
        if self.mtp is None:  # after the forward: a failed one leaves no KV to reuse (MTP books its own keys)
            for slot, prompt in zip(slots, prompts):
                self.kv.computed(slot, prompt)
        ends = {s for s, after in zip(slots, following or [None] * len(slots)) if after is None}
        for slot, lasting in publish:
            self.publish_row(slot, lasting)
            if self.mtp is not None and slot in ends and self.kv.prefix is not None:
                self.mtp.publish_at_draft.add(slot)  # the prompt's last slot is whole at the first draft
        return logits

    def publish_row(self, slot: int, lasting: bool, state_at_computed: Optional[bool] = None) -> None:
        """``kv.publish``, and the row's current state into the checkpoint it records."""
        checkpoint = self.kv.publish(slot, lasting, state_at_computed)
        if checkpoint is not None:
            self.model.save_state(self._state_row(slot), checkpoint)

    def _state_row(self, slot: int) -> int:
        """The state row holding request ``slot``'s current state (MTP: one of its verify slots)."""
        return slot if self.mtp is None else slot * self.mtp.tokens + self.mtp.current[slot]

    def _prefill_eager(self, slots, prompts, lens, prefix, token_idx, following=()) -> torch.Tensor:
        dev = self.device
        state = InferState.packed_prefill(slots, self.kv.table, prefix, lens, token_idx, dev)
        input_ids = host_to_device([t for p in prompts for t in p], torch.int64, dev)
        self._launching()
        if self.mtp is not None:  # the MTP head's KV follows each chunk
            return self.mtp.prefill(input_ids, state, slots, prompts, following)
        return self.model.forward(input_ids, state)

    def decode(self, slots: Sequence[int], last_tokens: Sequence[int]) -> torch.Tensor:
        """One decode step (one new token per request); a captured graph when one fits, else eager."""
        return self._decode(slots, last_tokens, None)

    def decode_ahead(self, slots: Sequence[int], rows: Sequence[int], drawn: Optional[torch.Tensor] = None):
        """A decode step launched before the host has read its input tokens: request ``i``'s is ``drawn[rows[i]]``,
        the previous step's draws still on the device (the engine's overlapped decode). With tensor parallelism
        only rank 0 has ``drawn`` (it samples); the other ranks pass None and receive its tokens by a broadcast on
        the device. Once the host reads them it books them with :meth:`inputs_known`, as ``decode`` books its host
        tokens."""
        if drawn is None and self.tp == 1:
            raise ValueError("decode_ahead: expected the previous step's draws on rank 0, got None")
        return self._decode(slots, None, (rows, drawn))

    def inputs_known(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """The input tokens of a ``decode_ahead`` step, read: the prefix cache keeps them with their KV."""
        self.kv.computed_each(slots, tokens)

    def _decode(self, slots: Sequence[int], last_tokens: Optional[Sequence[int]], ahead) -> torch.Tensor:
        staging, bs = self._staging, len(slots)
        staged = staging is not None and bs <= staging.rows
        token_idx = self.kv.extend_each(slots, write_table=not staged)  # staged: written from the staged columns
        seq_lens = self.kv.seq_lens(slots)
        max_len = max(seq_lens)
        graph = self.graphs.pick(bs, max_len) if self.graphs else None
        positions = [n - 1 for n in seq_lens]
        dev = self.device
        host_ids = last_tokens if ahead is None else [0] * bs  # ahead: filled from the draws on the device
        if staged:  # one host-to-device copy for the whole step
            staging.stage(input_ids=host_ids, positions=positions, out_token_idx=token_idx, b_req_idx=slots,
                          b_seq_len=seq_lens)  # fmt: skip
            staging.write_table(self.kv.table, bs)
            if ahead is not None:
                self._buf["input_ids"][:bs].copy_(self._ahead_ids(*ahead))
            if graph is not None:
                self._launching()
                return self._computed_each(slots, last_tokens, self.graphs.replay(graph)[:bs])
            b = {name: view[:bs] for name, view in self._buf.items()}
        else:
            i32, i64 = torch.int32, torch.int64
            ids = host_to_device(list(host_ids), i64, dev) if ahead is None else self._ahead_ids(*ahead)
            b = {"input_ids": ids, "positions": host_to_device(positions, i64, dev),
                 "out_token_idx": tensor_to_device(token_idx, dev), "b_req_idx": host_to_device(slots, i32, dev),
                 "b_seq_len": host_to_device(seq_lens, i32, dev)}  # fmt: skip
        state = InferState(is_prefill=False, b_req_idx=b["b_req_idx"], req_to_token=self.kv.table,
                           b_seq_len=b["b_seq_len"], out_token_idx=b["out_token_idx"], positions=b["positions"],
                           max_len_in_batch=max_len)  # fmt: skip
        self._launching()
        return self._computed_each(slots, last_tokens, self.model.forward(b["input_ids"], state))

    def _ahead_ids(self, rows: Sequence[int], drawn: Optional[torch.Tensor]) -> torch.Tensor:
        """A ``decode_ahead`` step's input ids on this rank's device: ``drawn[rows]`` on rank 0, and broadcast from
        it to the other ranks with tensor parallelism (on the device, no host round trip)."""
        if drawn is None:  # a worker: rank 0's arrive by the broadcast
            ids = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        else:
            ids = _drawn_rows(drawn, rows, self.device)
        return parallel.broadcast_(ids) if self.tp > 1 else ids

    def _computed_each(self, slots: Sequence[int], last_tokens, logits: torch.Tensor) -> torch.Tensor:
        if last_tokens is not None:  # decode_ahead: booked by inputs_known once read
            self.kv.computed_each(slots, last_tokens)
        return logits

    def add_request(self, prefix: Sequence[int] = ()) -> int:
        """A request slot whose KV row starts with the prefix cache's slots for ``prefix`` (the first ``cached``
        entries of ``kv.context_key``, all cached: the scheduler matched them first), and its state (Qwen3.5) with
        the prefix's checkpoint."""
        slot = self.kv.add_request(prefix)
        if self.mtp is not None:  # the head's KV is whole up to the prefix's end (keys of the next token too)
            self.mtp.reset(slot, len(prefix))
        checkpoint = self.kv.prefix_state(slot)
        if checkpoint is not None:
            self.model.load_state(checkpoint, self._state_row(slot))
        return slot

    def free(self, slot: int, last_token: Optional[int] = None) -> None:
        """Free the request's slot; its computed KV goes to the prefix cache, and its state (Qwen3.5) to the
        checkpoint the cache recorded after those tokens. ``last_token`` (MTP): the request's newest token, which
        its KV does not hold: the head's KV at the position before it reads it (``MTPRunner.finish``)."""
        try:
            if self.mtp is not None and self.kv.prefix is not None and last_token is not None:
                try:
                    self.mtp.finish(slot, last_token)
                except Exception:  # the slot is freed whatever happens; the tree then keeps its KV up to the head's
                    logger.exception("MTP head catch-up of slot %d at its request's end failed", slot)
        finally:  # an interrupt (Ctrl-C in LLM.generate) inside the catch-up must not leak the slot and its KV
            if self.mtp is not None:
                self.mtp.publish_at_draft.discard(slot)
            checkpoint = self.kv.free_request(slot)
            if checkpoint is not None:  # the cache holds it from now on: it must be filled, interrupt or not
                self.model.save_state(self._state_row(slot), checkpoint)

    # ---- warmup and graphs ---------------------------------------------------------------------------------

    def _warmup_prefill(self, graph_buckets: Sequence[int], every_size: bool = True) -> None:
        """Dummy prefills at 16, 32, ... up to the most tokens a prefill step carries (several requests when one
        request can't hold them), and at every prefill graph bucket within that, so GENERAL kernels tune and
        compile before the first live request and the prefill graphs' capture. With chunked prefill each size also
        runs as a second chunk, after a first one of the same size (the prefix kernels). ``every_size`` False (the
        CPU, no graphs: the torch references run, nothing compiles or tunes): the smallest size alone, which proves
        the forward runs before the first request (the whole ladder took 4 s of a CPU server start, docs/engine.md)."""
        a = self.args
        chunks = self._warmup_chunks()
        most = min(a.prefill_step_tokens, self.kv.num_free_tokens // chunks)
        lengths = sorted(set(prefill_buckets(most)) | {b for b in graph_buckets if b <= most})
        if not every_size:
            lengths = lengths[:1]
        gen = torch.Generator().manual_seed(0)
        for total in lengths:
            sizes = _prefill_sizes(total, a.max_req_total_len // chunks, a.running_max_req_size)
            self._dummy_prefill(sizes, chunks, gen)

    def _warmup_unaligned(self) -> None:
        """Dummy prefills of ``UNALIGNED_WARMUP_BATCHES``, then of one token less than each ladder size past them:
        tuned kernels key their configs by power-of-two buckets of a prefill's tokens, and each bucket's config is a
        program of its own, so each bucket needs an unaligned total too (a 3-request prefill of 388 tokens compiled
        for 1.5 s in a live request on an H200). Those that fit (request slots, a request's length, the KV pool and
        a prefill step), each as two chunks with chunked prefill. Called outside the tuning scope: their keys take
        the nearest tuned configs, as a live request's do, so they compile what it would and tune nothing."""
        a = self.args
        chunks = self._warmup_chunks()
        gen = torch.Generator().manual_seed(1)
        batches = [list(sizes) for sizes in UNALIGNED_WARMUP_BATCHES]
        past = max(sum(sizes) for sizes in batches)
        most = min(a.prefill_step_tokens, self.kv.num_free_tokens // chunks)
        for total in prefill_buckets(most):
            sizes = _prefill_sizes(total, a.max_req_total_len // chunks, a.running_max_req_size)
            sizes[-1] -= 1  # requests cap it below ``total`` where few or short: still one token off a multiple
            if sum(sizes) > past and sizes[-1] > 0 and sizes not in batches:
                batches.append(sizes)
        for sizes in batches:
            fits_slots = len(sizes) <= a.running_max_req_size and max(sizes) * chunks <= a.max_req_total_len
            fits_step = sum(sizes) <= a.prefill_step_tokens and sum(sizes) * chunks <= self.kv.num_free_tokens
            if fits_slots and fits_step:
                self._dummy_prefill(sizes, chunks, gen)

    def _warmup_chunks(self) -> int:
        """2 where a warm-up prompt also runs as a second chunk (chunked prefill on a GPU: the prefix kernels compile
        and tune there; on the CPU the references run either way), else 1."""
        a = self.args
        return 2 if self.device.type == "cuda" and not a.disable_chunked_prefill and a.max_req_total_len > 1 else 1

    def _dummy_prefill(self, sizes: Sequence[int], chunks: int, gen: torch.Generator) -> None:
        """Random prompts of ``sizes`` tokens in fresh request slots, prefilled ``chunks`` times (each after the
        last), then freed."""
        slots = [self.kv.add_request() for _ in sizes]
        try:
            for _ in range(chunks):
                prompts = [torch.randint(0, self.config.vocab_size, (n,), generator=gen).tolist() for n in sizes]
                self.prefill(slots, prompts)
        finally:
            for s in slots:
                self.free(s)

    def _prefill_graph_buckets(self) -> list:
        """The prefill graphs' token buckets: up to ``--prefill_graph_max_tokens``, at most a prefill step's tokens
        and a request's length (longer new tokens never come alone); [] when off or the model can't pad a prefill
        (logged)."""
        a = self.args
        if not a.prefill_graph_max_tokens:
            return []
        why = self.model.prefill_graph_blocker()
        if why is None and a.mtp_mode is not None:  # a replay would skip the MTP head's prefill (mtp_runner.py)
            why = "MTP head follows every prefill"
        if why is not None:
            logger.info("prefill graphs off: the model's %s", why)
            return []
        own = self.model.prefill_graph_max_tokens()
        most = min(a.prefill_graph_max_tokens, a.prefill_step_tokens, a.max_req_total_len, own or a.max_req_total_len)
        return prefill_buckets(most)

    def _capture_prefill_graphs(self, buckets: Sequence[int], graph_api) -> PrefillGraphs:
        """Prefill graphs over the decode graphs' pool. Cached-prefix graphs only where a prefill can continue a
        request (chunked prefill or the prefix cache) and the pool is unquantized: a quantized pool's prefix path
        sizes its gather by the longest prefix on the host, which a graph would freeze."""
        a = self.args
        prefixed = (self.kv.prefix is not None or not a.disable_chunked_prefill) and self.attn.quant == "none"
        staging = PrefillStaging(max(buckets), self.device, self.pad_slot, self.pad_token)
        graphs = PrefillGraphs(self.model.forward, buckets, prefixed, self.kv.table, a.max_req_total_len, staging,
                               graph_api, self.graphs.pool)  # fmt: skip
        return graphs.capture()

    def _init_graph_buffers(self) -> None:
        """The decode graphs' static inputs: device views of one staging buffer, every row the padding request
        (1 token, its own KV slot, harmless to compute) until a step stages its batch."""
        pad = {"input_ids": 0, "positions": 0, "b_req_idx": self.pad_slot, "b_seq_len": 1,
               "out_token_idx": self.pad_token}  # fmt: skip
        self._staging = DecodeStaging(self.args.graph_max_batch_size, self.device, pad)
        self._buf = self._staging.device_views

    def _graph_decode(self, bs: int, graph_len: int) -> torch.Tensor:
        """The decode forward a graph captures: the first ``bs`` rows of the static buffers, kernels launched
        for ``graph_len`` (its KV length bucket) so the graph serves any length up to it."""
        b = self._buf
        state = InferState(
            is_prefill=False,
            b_req_idx=b["b_req_idx"][:bs],
            req_to_token=self.kv.table,
            b_seq_len=b["b_seq_len"][:bs],
            out_token_idx=b["out_token_idx"][:bs],
            positions=b["positions"][:bs],
            max_len_in_batch=1,
            graph_max_len=graph_len,
        )
        return self.model.forward(b["input_ids"][:bs], state)


def _drawn_rows(drawn: torch.Tensor, rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``drawn[rows]`` as int64 on ``device``, without a host read: a plain slice when ``rows`` are 0..n-1 (the
    batch kept every request of the step that drew them, the common case)."""
    n = len(rows)
    if all(r == i for i, r in enumerate(rows)):
        picked = drawn[:n]
    else:
        picked = drawn.index_select(0, host_to_device(rows, torch.int64, drawn.device))
    return picked.to(device=device, dtype=torch.int64).contiguous()


def _untuned_device_note(device: torch.device) -> str:
    """Why a level that asks for tuning tuned nothing: off the GPU the torch references run, no Triton kernel."""
    level = envs.get_triton_autotune_level()
    if device.type == "cuda" or level not in (AutotuneLevel.ADAPTIVE, AutotuneLevel.FORCE):
        return ""
    return (
        f" ({envs.AUTOTUNE_LEVEL}={level} asks for tuning, but tuning runs only on a GPU: on {device.type} the "
        "torch references run)"
    )


def _prefill_graphs_estimate(prefill_peak: int, prefill_tokens: int, buckets: Sequence[int], vocab: int) -> int:
    """Bytes the prefill graphs add to the graphs' pool: the profiled prefill's activation peak scaled to the
    largest bucket (activations grow with tokens), plus the float32 logits row each of up to two graphs per bucket
    keeps as its output; 0 without buckets."""
    if not buckets:
        return 0
    return -(-prefill_peak * max(buckets) // prefill_tokens) + 2 * len(buckets) * vocab * 4


def _prefill_sizes(total: int, max_len: int, max_reqs: int) -> list:
    """``total`` prompt tokens as requests of at most ``max_len`` tokens, at most ``max_reqs`` of them."""
    full, rest = divmod(total, max_len)
    return ([max_len] * full + ([rest] if rest else []))[:max_reqs]
