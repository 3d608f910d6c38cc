"""Code the tests share: tiny models and tokenizers, the in-process CLI runner, runtime checkpoints."""
