"""lightllm: an LLM inference server built around a phase-aware kernel autotuner."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import lightllm` stays light (no torch/transformers until used)
    if name == "LLM":
        from lightllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from lightllm.engine.sampler import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lightllm' has no attribute {name!r}")
