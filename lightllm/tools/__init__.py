"""Command-line tools: the tiny-model maker and config inspection."""
