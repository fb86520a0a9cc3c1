"""Model families served by lightllm: one folder each (config, weights, forward, family object) and the registry that
maps config.json's architectures to them."""
