"""Rotations folded into the float weights (QuaRot / SpinQuant-style incoherence processing), as pure functions:
Hadamard and random orthogonal matrices (:mod:`.hadamard`), the matrices a rotation stands for (:mod:`.config`),
the RMSNorm check (:mod:`.norms`) and the folding itself, block by block (:mod:`.fold`). The rotation algorithm of a
quantization run is :mod:`quantkit.quantization.methods.rotation`."""
