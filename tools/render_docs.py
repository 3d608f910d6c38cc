"""Every generated block of the docs (between ``<!-- name:start -->`` and ``<!-- name:end -->``), rendered from its
one home in the code; tests/test_docs.py checks each block is current. After changing an option, a preset or a
limit: ``python -m tools.render_docs`` rewrites the blocks in place (``--check`` only reports stale ones)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _blocks() -> dict[str, dict[str, Callable[[], str]]]:
    from quantkit.format.outer_engines import outer_markdown
    from quantkit.format.preset_table import moe_markdown, presets_markdown
    from quantkit.quantization.gguf.mixes import default_model_markdown, mixes_markdown
    from quantkit.quantization.options import options_markdown
    from tools.behaviour_docs import behaviour_markdown
    from tools.serving_docs import serving_blocks

    serving = serving_blocks()
    return {
        "docs/cli.md": {"quantize-options": options_markdown, "behaviour": behaviour_markdown},
        "docs/formats.md": {
            "presets": presets_markdown,
            "moe-experts": moe_markdown,
            "outer-modules": outer_markdown,
            "gguf-mixes": mixes_markdown,
            "gguf-default-model": default_model_markdown,
        },
        "docs/serving.md": {name: (lambda text=text: text) for name, text in serving.items()},
    }


def between(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]


def replaced(text: str, name: str, rendered: str) -> str:
    head, rest = text.split(f"<!-- {name}:start -->\n", 1)
    _, tail = rest.split(f"\n<!-- {name}:end -->", 1)
    return f"{head}<!-- {name}:start -->\n{rendered}\n<!-- {name}:end -->{tail}"


def stale_blocks(write: bool) -> list[str]:
    """The blocks whose text differs from their rendering (rewritten in place when ``write``)."""
    stale = []
    for doc, blocks in _blocks().items():
        path = REPO / doc
        text = original = path.read_text()
        for name, render in blocks.items():
            rendered = render()
            if between(text, name) != rendered:
                stale.append(f"{doc}: {name}")
                text = replaced(text, name, rendered)
        if write and text != original:
            path.write_text(text)
    return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only list stale blocks; exit 1 if any")
    args = parser.parse_args()
    stale = stale_blocks(write=not args.check)
    for block in stale:
        print(("stale: " if args.check else "rewrote: ") + block)
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
