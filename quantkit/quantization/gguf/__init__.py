"""GGUF output: llama.cpp's own block types, solved by GPTQ or round-to-nearest, one block at a time."""
