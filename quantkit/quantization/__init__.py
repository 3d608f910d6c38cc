"""The offline pass, one decoder block in memory at a time: job config, methods, the block loop, staged blocks,
statistics, solver dispatch, the resumable work directory and the checkpoint output."""
