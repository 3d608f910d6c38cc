"""llama.cpp's own tensor types (GGML block formats): their sizes, the grid each decodes to, and the byte layouts.

Knows no algorithm: the solver (``quantization/solvers/ggml_*``) chooses parameters and codes; this package says
what they mean when llama.cpp decodes them, and writes them as the bytes a GGUF tensor holds.
"""
