"""Evaluation against held-out text: perplexity, KL divergence and top-1 agreement with a reference."""
