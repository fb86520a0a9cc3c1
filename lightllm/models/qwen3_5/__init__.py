"""Qwen3.5 (hybrid gated DeltaNet + gated attention): config parsing, weight loading and the forward."""
