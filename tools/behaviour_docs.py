"""docs/cli.md's behaviour block: what `eval --behaviour` measures and the recipe gate on each figure, its numbers
(prompts, token limit, n-gram, agreement span, tags) read from the constants quantkit/eval/behaviour.py measures with,
and the gate names from the recipe schema."""

from __future__ import annotations


def behaviour_markdown() -> str:
    from quantkit.eval import behaviour as b
    from quantkit.recipes.schema import BEHAVIOUR_GATES

    tags = ", ".join(f"`{opener}`...`{closer}`" for opener, closer in b.REASONING_TAGS)
    rows = [
        (
            "end rate",
            "share of replies that emit a stop token (the tokenizer's EOS or the generation config's) within "
            f"`--max-new-tokens` (default {b.DEFAULT_MAX_NEW_TOKENS})",
            "`min_end_rate`",
        ),
        (
            "repetition",
            f"per reply, the share of its {b.REPEAT_NGRAM}-grams that repeat an earlier {b.REPEAT_NGRAM}-gram of the "
            "same reply; averaged over replies",
            "`max_repetition_increase` (the checkpoint's minus the reference's)",
        ),
        (
            f"first-{b.AGREEMENT_TOKENS} agreement",
            f"per prompt, the share of the first {b.AGREEMENT_TOKENS} reply positions holding the reference's token "
            "(the stop counts as a position); averaged over prompts",
            f"`min_first{b.AGREEMENT_TOKENS}_agreement`",
        ),
        (
            "tag close rate",
            f"templates or vocabularies with reasoning tags ({tags}) only: the share of replies that open the tag "
            "(or whose prompt opens it) and close it; the open rate is shown beside it",
            "`min_tag_close_rate` (not checked without reasoning tags)",
        ),
    ]
    named = {gate.split("`")[1] for _, _, gate in rows}
    if named != set(BEHAVIOUR_GATES):
        raise ValueError(f"the behaviour block names gates {sorted(named)}, the schema has {list(BEHAVIOUR_GATES)}")
    lines = ["| figure | what it counts | recipe gate |", "|---|---|---|"]
    lines += [f"| {figure} | {what} | {gate} |" for figure, what, gate in rows]
    lines += [
        "",
        f"Prompts: the first `--behaviour-prompts` (default {b.DEFAULT_BEHAVIOUR_PROMPTS}) of "
        f"`quantkit/eval/{b.PROMPTS_FILE.name}`, each one user turn in the model's chat template, replies greedy "
        f"in batches of {b.GENERATION_BATCH} (left-padded). End rate, repetition and agreement carry a standard "
        "error over prompts (`±`).",
    ]
    return "\n".join(lines)
