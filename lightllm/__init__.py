"""lightllm: an LLM inference server built around a phase-aware kernel autotuner."""

__version__ = "0.1.0"
