"""Pure functions: a weight (and its statistics) in, integer codes and scales out: grids and round-to-nearest,
GPTQ, AWQ's scale and clip searches."""
