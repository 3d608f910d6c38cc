"""n-gram (prompt lookup) drafting: find the latest earlier occurrence of the sequence's last n tokens in its own
prompt and output, and propose the tokens that followed it. No extra model; costs one substring search."""

from __future__ import annotations

from array import array

MAX_NGRAM = 4  # the longest suffix tried first: longer matches predict better
MIN_NGRAM = 2  # a single-token match proposes noise too often


def propose_ngram(token_ids: list[int], k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens continuing the latest earlier match of the longest suffix (``max_n``..``min_n``)."""
    if len(token_ids) <= min_n:
        return []
    data = array("q", token_ids).tobytes()
    width = array("q").itemsize
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        pattern = data[-n * width :]
        end = len(data) - width  # a match must end before the sequence does, so a token follows it
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:  # aligned on a token boundary
                start = at // width + n
                return token_ids[start : start + k]
            end = at + len(pattern) - 1
    return []
