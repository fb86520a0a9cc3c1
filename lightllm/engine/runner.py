"""The runner interface the engine drives: ``ModelRunner`` (one process) and ``server.tp.TPRunner`` (rank 0 of
tensor parallelism) implement it.

Every call that changes KV or model state is in ``STATE_CHANGING`` (``mtp.*``: a call on ``runner.mtp``): a
tensor-parallel runner broadcasts exactly these to the other ranks, so their KV bookkeeping stays identical. The
rest is read-only.
"""

from typing import Callable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

STATE_CHANGING = ("prefill", "decode", "decode_ahead", "inputs_known", "add_request", "free", "mtp.draft", "mtp.verify",
                  "mtp.accept")  # fmt: skip


@runtime_checkable
class KVQueries(Protocol):
    """The questions the scheduling policy asks the KV cache; it never changes the cache through this."""

    @property
    def caching(self) -> bool: ...  # the prefix cache is on

    @property
    def stateful(self) -> bool: ...  # a cached prefix is usable only up to a state checkpoint (Qwen3.5's)

    def can_allocate(self, num_tokens: int) -> bool: ...

    def has_free_slot(self) -> bool: ...

    # the prefix cache's key of a context: one entry per slot a hit could cover (all but the last token's)
    def context_key(self, context: Sequence[int]) -> List[int]: ...

    # of a ``context_key``: (cached, of them evictable now, the branch: with state checkpoints, how far the KV hit
    # goes past the last checkpoint on it; 0 when it does not)
    def match_prefix_with_branch(self, tokens: Sequence[int]) -> Tuple[int, int, int]: ...

    def usage(self) -> float: ...


@runtime_checkable
class MTPSteps(Protocol):
    """MTP speculative decoding's steps the engine drives (``engine/mtp_runner.py``, ``engine/spec_decode.py``)."""

    @property
    def step(self) -> int: ...  # draft tokens per request per step (--mtp_step)

    def draft(self, slots: Sequence[int], last_tokens: Sequence[int], choose) -> torch.Tensor: ...  # [B, N] on device

    def verify(self, slots: Sequence[int], last_tokens: Sequence[int], drafts=None) -> torch.Tensor: ...

    def accept(self, slots: Sequence[int], accepted: Sequence[int]) -> None: ...


@runtime_checkable
class Runner(Protocol):
    @property
    def args(self): ...  # EngineArgs

    @property
    def config(self): ...  # the model config: eos_token_ids, vocab_size

    @property
    def device(self) -> torch.device: ...

    @property
    def model_dir(self) -> str: ...  # where the tokenizer is (the server and LLM load it)

    @property
    def kv(self) -> KVQueries: ...

    @property
    def mtp(self) -> Optional[MTPSteps]: ...  # with --mtp_mode: its draft / verify / accept steps, else None

    # ``publish``: ``(slot, lasting)`` of the rows whose computed tokens (and state) the prefix cache takes right
    # after this forward, while they run: every prompt chunk; ``lasting`` where the prompt is now all in or the chunk
    # stopped at its branch (KVQueries), so the checkpoint there outlives those of chunks inside a prompt
    # ``following`` (with MTP, one per row): the token after each chunk, None after a prompt's last
    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        publish: Sequence[Tuple[int, bool]] = (),
        following: Sequence[Optional[int]] = (),
    ) -> torch.Tensor: ...

    def decode(self, slots: Sequence[int], last_tokens: Sequence[int]) -> torch.Tensor: ...

    # its row starts with the cached ``prefix``: the first ``cached`` entries of ``kv.context_key``
    def add_request(self, prefix: Sequence[int] = ()) -> int: ...

    # ``last_token``: the request's newest token, not in its KV (MTP completes the head's KV with it)
    def free(self, slot: int, last_token: Optional[int] = None) -> None: ...

    # Rank 0 only, not broadcast: ``hook()`` right before each forward is launched (the engine's step GPU timer)
    def set_launch_hook(self, hook: Optional[Callable[[], None]]) -> None: ...


@runtime_checkable
class AheadDecoder(Protocol):
    """Optional, for overlapped decode: a runner that launches a decode step from the previous step's draws while
    they are still on the device, and books them once the host has read them (``ModelRunner``, and the
    tensor-parallel runner, which broadcasts rank 0's draws to the other ranks on the device)."""

    def decode_ahead(self, slots: Sequence[int], rows: Sequence[int], drawn: torch.Tensor) -> torch.Tensor: ...

    def inputs_known(self, slots: Sequence[int], tokens: Sequence[int]) -> None: ...
