"""Qwen3 (dense GQA): config parsing and weight loading from Hugging Face folders."""
