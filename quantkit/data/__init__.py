"""Text to token windows: sources (local files, HF datasets), tokenization, calibration sets."""
