"""Rotations folded into the float weights (QuaRot / SpinQuant-style incoherence processing), as pure functions:
Hadamard and random orthogonal matrices (:mod:`.hadamard`), the rotation config (:mod:`.config`), the RMSNorm
check (:mod:`.norms`) and the folding itself, block by block or for a whole in-memory model (:mod:`.fold`)."""
