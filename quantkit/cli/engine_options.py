"""Engine options shared by `quantkit serve` and `quantkit bench` (one definition of each flag and default)."""

from __future__ import annotations

from typing import Annotated

import typer

from quantkit.runtime.config import KV_CACHE_DTYPES, MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

KvCacheDtypeOption = Annotated[
    str,
    typer.Option(
        help=f"KV-cache storage: {', '.join(KV_CACHE_DTYPES)} (auto: the compute dtype; int8/fp8: 8 bits with a "
        "scale per token and head, about 2x the tokens of bf16 in the same memory)."
    ),
]
SpeculativeOption = Annotated[
    str | None,
    typer.Option(
        help=f"Speculative decoding: {' or '.join(SPECULATIVE_METHODS)} (n-gram prompt lookup, or --draft-model). "
        "Greedy output is unchanged; sampled output keeps its distribution."
    ),
]
NumSpeculativeTokensOption = Annotated[
    int, typer.Option(help=f"Tokens drafted per step (1..{MAX_SPECULATIVE_TOKENS}).")
]
DraftModelOption = Annotated[
    str | None, typer.Option(help="With --speculative draft: a smaller model with the same tokenizer.")
]
