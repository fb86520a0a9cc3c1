"""Decode steps stage their inputs in one host buffer and send it with one copy; rows past the batch are the
padding request's."""

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.staging import FIELDS, DecodeStaging
from lightllm.tools.make_tiny_model import make_tiny_qwen3

PAD = {"input_ids": 0, "positions": 0, "out_token_idx": 99, "b_req_idx": 7, "b_seq_len": 1}


def test_stage_writes_the_batch_and_pads_the_rest():
    staging = DecodeStaging(4, torch.device("cpu"), PAD)
    views = staging.device_views
    assert [views[name].dtype for name, _ in FIELDS] == [dtype for _, dtype in FIELDS]
    assert all(views[name].tolist() == [PAD[name]] * 4 for name in PAD)
    staging.stage(input_ids=[5, 6, 8], positions=[3, 4, 5], out_token_idx=torch.tensor([10, 11, 12]),
                  b_req_idx=[0, 1, 2], b_seq_len=[4, 5, 6])  # fmt: skip
    assert views["input_ids"].tolist() == [5, 6, 8, 0] and views["out_token_idx"].tolist() == [10, 11, 12, 99]
    assert views["b_req_idx"].tolist() == [0, 1, 2, 7] and views["b_seq_len"].tolist() == [4, 5, 6, 1]
    staging.stage(input_ids=[9], positions=[6], out_token_idx=[13], b_req_idx=[2], b_seq_len=[7])
    assert views["b_req_idx"].tolist() == [2, 7, 7, 7] and views["positions"].tolist() == [6, 0, 0, 0]
    with pytest.raises(ValueError, match="batch expected at most 4 rows, got 5"):
        staging.stage(**{name: [0] * 5 for name in PAD})
    with pytest.raises(ValueError, match=r"DecodeStaging.stage: expected \[.*\] of one length, got"):
        staging.stage(input_ids=[1], positions=[1])
    with pytest.raises(ValueError, match="pad expected a value for each of"):
        DecodeStaging(4, torch.device("cpu"), {"input_ids": 0})


def test_write_table_puts_the_staged_slots_into_the_table():
    staging = DecodeStaging(4, torch.device("cpu"), PAD)
    table = torch.full((8, 6), -1, dtype=torch.int32)
    staging.stage(input_ids=[5, 6], positions=[3, 0], out_token_idx=[10, 11], b_req_idx=[2, 5], b_seq_len=[4, 1])
    staging.write_table(table, 2)
    want = torch.full((8, 6), -1, dtype=torch.int32)
    want[2, 3], want[5, 0] = 10, 11  # the padding rows (request 7) are not written
    assert torch.equal(table, want)


class ReplayingGraphs:
    """CPU stand-in for CUDA graphs: a graph re-runs the decode forward it captured over the static inputs and
    writes the captured output in place, as a replay does."""

    def __init__(self):
        self.capturing, self.replaying = None, False

    def new_graph(self):
        return {}

    @contextmanager
    def _capture(self, graph):
        self.capturing = graph
        try:
            yield
        finally:
            self.capturing = None

    def capture(self, graph, pool):
        return self._capture(graph)

    def pool(self, graph):
        return None

    def replay(self, graph):
        self.replaying = True
        try:
            graph["out"].copy_(graph["run"]())
        finally:
            self.replaying = False

    def memory_used(self):
        return 0


class StaticInputWrites(TorchDispatchMode):
    """Counts ops that write into the given storages (the decode graphs' static inputs), except during replay."""

    def __init__(self, storages, graphs):
        super().__init__()
        self.storages, self.graphs, self.writes = storages, graphs, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema.arguments
        written = schema and schema[0].alias_info is not None and schema[0].alias_info.is_write
        if written and not self.graphs.replaying and isinstance(args[0], torch.Tensor):
            if args[0].untyped_storage().data_ptr() in self.storages:
                self.writes.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_decode_steps_send_one_copy_and_match_eager(tmp_path, monkeypatch):
    """Graph decode steps (a CPU stand-in replaying the captured forward) of 3, 1 and 3 requests, and an eager step
    past graph_max_len_in_batch, each equal to a runner without graphs: padded rows never write live KV. Each
    step writes the static inputs once (one copy of the staging buffer; before: 5 copies and 5 fills)."""
    model_dir = make_tiny_qwen3(tmp_path / "tiny", num_hidden_layers=2, seed=1)
    opts = dict(model_dir=str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=64,
                running_max_req_size=4, graph_max_batch_size=4, graph_max_len_in_batch=12)  # fmt: skip
    graphs = ReplayingGraphs()
    real_graph_decode = ModelRunner._graph_decode

    def graph_decode(self, bs, graph_len):
        out = real_graph_decode(self, bs, graph_len)
        if graphs.capturing is not None:
            graphs.capturing.update(out=out, run=lambda: real_graph_decode(self, bs, graph_len))
        return out

    monkeypatch.setattr(ModelRunner, "_graph_decode", graph_decode)
    staged = ModelRunner(EngineArgs(**opts), graph_api=graphs)
    plain = ModelRunner(EngineArgs(**opts, disable_cudagraph=True))
    assert staged.graphs is not None and plain.graphs is None
    prompts = [[5, 17, 42], [11, 12, 13, 14, 15], [20, 21]]
    slots = {}
    for runner in (staged, plain):
        slots[runner] = [runner.add_request() for _ in prompts]
        runner.prefill(slots[runner], prompts)
    storages = {view.untyped_storage().data_ptr() for view in staged._buf.values()}
    steps = [([0, 1, 2], [1, 2, 3]), ([1], [4]), ([0, 1, 2], [5, 6, 7])] + [([1], [8 + i]) for i in range(6)]
    for rows, tokens in steps:  # request 1 reaches 12 tokens: its last steps run eagerly
        outs = []
        for runner in (staged, plain):
            counter = StaticInputWrites(storages if runner is staged else set(), graphs)
            with counter:
                outs.append(runner.decode([slots[runner][r] for r in rows], tokens).clone())
            if runner is staged:
                assert counter.writes == ["copy_"], (rows, counter.writes)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_staging_buffer_is_pinned_and_each_step_arrives():
    staging = DecodeStaging(8, torch.device("cuda"), PAD)
    assert staging.host.is_pinned() and staging.device_buffer.is_cuda
    for step in range(3):  # the host buffer is rewritten only after the previous copy read it
        batch = 3 - step
        staging.stage(**{name: [step * 10 + i for i in range(batch)] for name in PAD})
        for name in PAD:
            assert staging.device_views[name].tolist() == [step * 10 + i for i in range(batch)] + [PAD[name]] * (
                8 - batch
            ), (step, name)
