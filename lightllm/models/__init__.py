"""Model families served by lightllm; each folder holds config parsing, weights and the layer forward."""
