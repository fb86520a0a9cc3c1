"""CUDA graphs for small prefills: one request's new tokens padded to a token bucket, replayed from a graph.

A prefill of a few hundred tokens costs more on the host (Python and about ten kernel launches per layer) than on
the GPU; replaying a forward captured at start-up takes that host cost away, as decode graphs do for decode.

A replayed step of ``n`` new tokens after ``p`` cached ones (bucket ``B >= n``, the static inputs' first ``B``
rows):

- rows ``[0, n)``: the request's tokens at positions ``p .. p + n - 1``, their K/V to the request's new KV slots;
- rows ``[n, B)``: padding, token 0 at position 0, its K/V written to the padding request's token (only padding
  rows read that token, each after writing it in the same layer). They come after every real row, so causal
  attention never lets a real row see them, and every other op works row by row;
- the request's lengths are device tensors: ``b_q_len = n``, ``b_prefix_len = p``, ``b_seq_len = p + n``. Context
  attention computes only the ``n`` real rows, and the forward hands on only the last real row
  (``b_q_start + b_q_len - 1``): the logits are those of the request's last token;
- linear attention (Qwen3.5) would carry the padding rows into the request's state, so the state (``padded``) marks
  them as a second sequence, the padding request's, run from and into its state slot: ``state_idx`` is
  ``[slot, pad_slot, pad_slot]`` (the third for an empty sequence the chunked kernels' plan adds). Its plan derives
  the sequence bounds on the device from ``b_q_len`` and the bucket (``layers/linear_attention.py``).

Buckets are 16, 32, 64, ... up to ``--prefill_graph_max_tokens`` (and that number itself), each one of the
GENERAL warm-up's lengths, so the tuned prefill kernels have settled their configs for every bucket's keys before
the capture. A graph key is ``(bucket, prefixed)``: a prefixed graph launches the prefix-aware context attention,
which reads each request's cached length and its row of ``req_to_token`` on the device, so one graph serves any
cached prefix (a chunked prefill's later chunk, a prefix-cache hit).
"""

import bisect
import contextlib
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from lightllm.common.cuda_graph import GraphSet
from lightllm.layers.infer_state import InferState

MIN_BUCKET = 16  # the GENERAL warm-up's first length (context attention keys fewer tokens as 16)

TOKEN_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("out_token_idx", torch.int64))
REQUEST_FIELDS = (("b_req_idx", torch.int32), ("b_seq_len", torch.int32), ("b_q_start", torch.int32),
                  ("b_q_len", torch.int32), ("b_prefix_len", torch.int32))  # fmt: skip
# the request's linear-attention state slot, then the padding request's twice (a padded plan's second and third
# sequence: layers/linear_attention.py)
STATE_ROWS = ("state_idx", torch.int32, 3)


def prefill_buckets(max_tokens: int) -> List[int]:
    """16, 32, 64, ... below ``max_tokens``, then ``max_tokens`` itself; [] for 0 (graphs off)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ValueError(f"prefill_buckets: max_tokens expected a non-negative integer, got {max_tokens!r}")
    buckets, size = [], MIN_BUCKET
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_tokens] if max_tokens else []


def bucket_for(buckets: Sequence[int], tokens: int) -> Optional[int]:
    """The smallest of the ascending ``buckets`` that holds ``tokens`` (at least 1), or None."""
    if tokens < 1:
        return None
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] if i < len(buckets) else None


class PrefillStaging:
    """One request's prefill inputs for ``rows`` token rows, written on the host (pinned on a GPU) and sent to
    their device twins with one copy. Rows past the request's tokens hold padding; until the first
    :meth:`stage`, the request is the padding request with one new token and no prefix (what the captures run)."""

    def __init__(self, rows: int, device: torch.device, pad_slot: int, pad_token: int):
        self.rows, pinned = rows, device.type == "cuda"
        self.pad = {"input_ids": 0, "positions": 0, "out_token_idx": pad_token}
        layout = [(name, dtype, rows) for name, dtype in TOKEN_FIELDS]
        layout += [(name, dtype, 1) for name, dtype in REQUEST_FIELDS] + [STATE_ROWS]  # int64 first: aligned
        nbytes = sum(n * dtype.itemsize for _, dtype, n in layout)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._host, self.device_views, start = {}, {}, 0
        for name, dtype, n in layout:
            end = start + n * dtype.itemsize
            self._host[name] = self.host[start:end].view(dtype).numpy()
            self.device_views[name] = self.device_buffer[start:end].view(dtype)
            start = end
        for name, value in self.pad.items():
            self._host[name][:] = value
        for name, value in (("b_req_idx", pad_slot), ("b_seq_len", 1), ("b_q_start", 0), ("b_q_len", 1),
                            ("b_prefix_len", 0)):  # fmt: skip
            self._host[name][0] = value
        self._host["state_idx"][:] = pad_slot
        self._live = 0  # token rows holding the last request's values
        self._copied = torch.cuda.Event() if pinned else None  # the last copy has read the host buffer
        self.device_buffer.copy_(self.host)

    def stage(self, slot: int, prefix_len: int, token_ids: Sequence[int], token_idx: torch.Tensor) -> None:
        """Rows ``[0, n)`` get the request's ``n`` new tokens (ids, positions after ``prefix_len``, their KV slots
        ``token_idx``), the rows the previous request used past them padding again; then one ``non_blocking`` copy
        (ordered on the current stream before the replay)."""
        n = len(token_ids)
        if not 1 <= n <= self.rows or len(token_idx) != n:
            raise ValueError(f"PrefillStaging.stage: expected 1 to {self.rows} new tokens and one KV slot each, got "
                             f"{n} tokens and {len(token_idx)} slots")  # fmt: skip
        if self._copied is not None:
            self._copied.synchronize()
        h = self._host
        h["input_ids"][:n] = token_ids
        h["positions"][:n] = range(prefix_len, prefix_len + n)
        h["out_token_idx"][:n] = token_idx.numpy() if isinstance(token_idx, torch.Tensor) else token_idx
        if self._live > n:
            for name, value in self.pad.items():
                h[name][n : self._live] = value
        self._live = n
        for name, value in (("b_req_idx", slot), ("b_seq_len", prefix_len + n), ("b_q_len", n),
                            ("b_prefix_len", prefix_len), ("state_idx", slot)):  # fmt: skip
            h[name][0] = value
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def state(self, bucket: int, prefixed: bool, req_to_token: torch.Tensor, max_len: int):
        """``(input_ids, InferState)`` of a one-request prefill over the first ``bucket`` rows: kernels launch for
        ``bucket`` tokens (grid, tuning keys); a prefixed state takes the prefix path for any cached length up to
        ``max_len`` (read on the device)."""
        v = self.device_views
        state = InferState(
            is_prefill=True,
            b_req_idx=v["b_req_idx"],
            req_to_token=req_to_token,
            b_seq_len=v["b_seq_len"],
            out_token_idx=v["out_token_idx"][:bucket],
            positions=v["positions"][:bucket],
            max_len_in_batch=max_len if prefixed else bucket,
            b_q_start=v["b_q_start"],
            b_q_len=v["b_q_len"],
            max_q_len=bucket,
            b_prefix_len=v["b_prefix_len"],
            max_prefix_len=max_len if prefixed else 0,
            state_idx=v["state_idx"],
            padded=True,
        )
        return v["input_ids"][:bucket], state


class PrefillGraphs:
    """Captured one-request prefills by ``(bucket, prefixed)``; :meth:`prefill` replays the one that fits, or
    returns None (run eagerly). ``forward(input_ids, state)`` is the model's; ``prefixed`` captures the cached-prefix
    graphs too. The graphs go into ``pool`` (the decode graphs') through the graph ``api``."""

    def __init__(self, forward: Callable, buckets: Sequence[int], prefixed: bool, req_to_token: torch.Tensor,
                 max_len: int, staging: PrefillStaging, api=None, pool=None):  # fmt: skip
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] > staging.rows:
            raise ValueError(f"PrefillGraphs: buckets expected ascending, distinct and at most the staging's "
                             f"{staging.rows} rows, got {list(buckets)}")  # fmt: skip
        self.forward, self.buckets, self.prefixed = forward, list(buckets), prefixed
        self.req_to_token, self.max_len, self.staging = req_to_token, max_len, staging
        keys = [(b, False) for b in buckets] + ([(b, True) for b in buckets] if prefixed else [])
        self.graphs = GraphSet(keys, api, pool)

    def capture(self) -> "PrefillGraphs":
        """Per key, largest first: one eager forward (outside any autotune scope: the GENERAL warm-up tuned these
        keys; this one compiles and settles the plans), then the capture."""
        self.graphs.capture_each(self.run_key, contextlib.nullcontext, "prefill", _describe,
                                 "--prefill_graph_max_tokens 0")  # fmt: skip
        return self

    def run_key(self, key: Tuple[int, bool]) -> torch.Tensor:
        """The forward a graph captures: the first ``bucket`` rows of the static inputs."""
        bucket, prefixed = key
        input_ids, state = self.staging.state(bucket, prefixed, self.req_to_token, self.max_len)
        return self.forward(input_ids, state)

    def pick(self, new_tokens: int, prefix_len: int) -> Optional[Tuple[int, bool]]:
        """The captured key that serves ``new_tokens`` after ``prefix_len`` cached ones, or None."""
        key = (bucket_for(self.buckets, new_tokens), prefix_len > 0)
        return key if key in self.graphs.graphs else None

    def prefill(self, slot: int, prefix_len: int, token_ids: Sequence[int], token_idx: torch.Tensor,
                on_launch: Optional[Callable[[], None]] = None) -> Optional[torch.Tensor]:  # fmt: skip
        """Float32 logits ``[1, vocab]`` of the request's last new token from a graph replay (the graph's output
        tensor: valid until the next replay), or None when no graph serves it. ``token_idx``: its new tokens' KV
        slots, already in its row of ``req_to_token``. ``on_launch``: called between the staging and the replay."""
        key = self.pick(len(token_ids), prefix_len)
        if key is None:
            return None
        self.staging.stage(slot, prefix_len, token_ids, token_idx)
        if on_launch is not None:
            on_launch()
        return self.graphs.replay(key)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs.graphs)

    @property
    def memory_bytes(self) -> int:
        return self.graphs.memory_bytes


def _describe(key: Tuple[int, bool]) -> str:
    bucket, prefixed = key
    return f"{bucket}-token{' prefixed' if prefixed else ''}"
