"""Run every shipped recipe (or the ones named) and tabulate their reports: time, peak RSS, size, quality, gates.

    python -m benchmarks.bench_recipes --record recipes          # every recipe under recipes/, one after the other
    python -m benchmarks.bench_recipes --only w4-gptq,w8           # some of them

Each recipe runs as `quantkit run recipes/NAME.yaml` in its own process with a fresh recipe cache (nothing reused),
its outputs under a temporary directory; the figures are read from the report.json it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.record import record_table

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
COLUMNS = ["recipe", "quantize s", "peak RSS MB", "size MB", "ppl", "ppl +%", "KL mean", "top-1", "gates"]


def run_recipe(path: Path, work: Path) -> dict:
    report = work / f"report-{path.stem}"
    env = {**os.environ, "QUANTKIT_OUT": str(work / "out"), "QUANTKIT_CACHE": str(work / "cache")}
    models = Path(os.environ.get("QUANTKIT_CACHE") or Path.home() / ".cache" / "quantkit") / "models"
    if models.is_dir():  # the converted default model is reused; recipe results are not
        (work / "cache").mkdir(exist_ok=True)
        link = work / "cache" / "models"
        if not link.exists():
            link.symlink_to(models)
    command = [sys.executable, "-m", "quantkit", "run", str(path), "--report", str(report)]
    subprocess.run(command, env=env, check=False, stdout=subprocess.DEVNULL)
    return json.loads((report / "report.json").read_text())


def row(name: str, report: dict) -> list[str]:
    figures = report["figures"]
    quantize = next((s for s in report["stages"] if s["name"] == "quantize"), {})
    rss = next((v for k, v in figures.items() if "RSS" in k), None)
    return [
        name,
        f"{quantize.get('seconds', 0):.0f}",
        "-" if rss is None else f"{rss:.0f}",
        f"{figures['checkpoint MB']:.1f}",
        f"{figures['perplexity']:.2f}",
        f"{figures['perplexity increase %']:+.1f}%",
        f"{figures['kl mean']:.4f}",
        f"{figures['top-1 agreement']:.3f}",
        "pass" if report["passed"] else "FAIL",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma list of recipe names (default: every shipped recipe)")
    parser.add_argument("--record", default=None, help="record the table as benchmarks/results/NAME.json")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else sorted(p.stem for p in RECIPES.glob("*.yaml"))
    rows = []
    console = Console(width=max(Console().width, 140))
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            console.print(f"[bold]{name}[/]")
            rows.append(row(name, run_recipe(RECIPES / f"{name}.yaml", Path(tmp))))
            console.print("  " + ", ".join(f"{c} {v}" for c, v in zip(COLUMNS[1:], rows[-1][1:], strict=True)))
    table = Table(title="Shipped recipes")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for cells in rows:
        table.add_row(*cells)
    console.print(table)
    if args.record:
        record_table(
            args.record,
            title="Shipped recipes",
            order=45,
            protocol="Each recipe under recipes/ as shipped (its own calibration and evaluation sections: 128 x 512 "
            "calibration windows, 40 held-out windows, except ci.yaml's smaller ones), run with `quantkit run` in its "
            "own process with an empty recipe cache, one after the other; quantize time from the report's stage "
            "record, peak RSS the whole process's (a mixed recipe's includes its sensitivity stage).",
            baseline="each recipe's own evaluation of the original model (43.33 on 40 windows)",
            columns=COLUMNS,
            rows=rows,
        )


if __name__ == "__main__":
    main()
