"""Exports of a quantized checkpoint to other stacks' formats (GPTQ v1, GGUF), from its integer codes."""
