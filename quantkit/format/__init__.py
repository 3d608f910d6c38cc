"""The checkpoint format, knowing no algorithm: schemes, bit packing, compressed-tensors tensors and
``quantization_config``, the atomic sharded writer, the Hugging Face-side QuantLinear loader, inspection."""
