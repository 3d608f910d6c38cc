"""Quantizing on several processes (GPUs, nodes) with torch.distributed, launched by ``torchrun``.

:mod:`.context` starts and ends the process group and knows this process's rank; :mod:`.watchdog` stops every rank
when one fails; :mod:`.reduce` sums per-mini-batch statistics in an order that does not depend on the number of
processes; :mod:`.plan` spreads a stage's solves over the ranks by cost; :mod:`.share` moves tensors between ranks
(a rank's calibration rows, the solved weights). Nothing here knows an algorithm.
"""
