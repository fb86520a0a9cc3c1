"""The Qwen3 forward plans attention once per forward, before its first layer (layers only run the plan)."""

from lightllm import LLM, SamplingParams
from lightllm.layers.attention import AttentionBackend
from lightllm.tools.make_tiny_model import make_tiny_qwen3


def test_each_forward_plans_attention_once_before_its_first_layer(tmp_path, monkeypatch):
    events = []

    def spy(name):
        real = getattr(AttentionBackend, name)
        return lambda self, *args, **kwargs: events.append(name) or real(self, *args, **kwargs)

    for name in ("plan_prefill", "plan_decode", "write_kv", "prefill", "decode"):
        monkeypatch.setattr(AttentionBackend, name, spy(name))
    model_dir = make_tiny_qwen3(tmp_path / "tiny", num_hidden_layers=2, seed=3)
    llm = LLM(str(model_dir), data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128,
              running_max_req_size=4)  # fmt: skip
    events.clear()  # whatever start-up ran
    llm.generate([[5, 17, 42]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    layer = lambda kind: ["write_kv", kind]  # noqa: E731
    prefill = ["plan_prefill"] + layer("prefill") * 2
    decode = ["plan_decode"] + layer("decode") * 2
    assert events == prefill + decode * 2
