"""Where float weights come from: resolving a model argument (directory, hub id, alias), the GGUF import,
architectures as data, lazy safetensors weights, and driving a decoder block by block."""
