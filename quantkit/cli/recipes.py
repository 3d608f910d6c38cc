"""Recipes from the command line: run one (exit 1 when a gate fails), validate one, or start a new one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from quantkit.cli.app import app, fail, out

SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override a key, e.g. --set quantization.scheme.bits=8.")
]


@app.command("run")
def run_(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see `quantkit recipe new`).")],
    set_: SetOption = None,
    report: Annotated[Path | None, typer.Option(help="Report directory (default: <output>/report).")] = None,
) -> None:
    """Run a recipe: calibrate, quantize, evaluate, check the gates; exit 1 when a gate fails."""
    from quantkit.distributed.context import current
    from quantkit.memory import map_large_allocations
    from quantkit.quantization.distributed_run import release_workers, serve_jobs
    from quantkit.recipes.report import render_tables
    from quantkit.recipes.run import run_recipe
    from quantkit.recipes.schema import load_recipe

    loaded = load_recipe(recipe, list(set_ or []))
    map_large_allocations()  # the offline policy for this process (quantkit/memory.py), its smoke stage included
    context = current()
    if context is not None and not context.is_main:  # under torchrun: rank 0 runs the recipe, the others its quantize
        serve_jobs(context)
        return
    if context is not None:
        context.driving = True
    result = run_recipe(loaded, recipe_path=recipe, report_dir=report, console=out)
    if context is not None:  # on a failure the watchdog stops them instead (they may be inside a collective)
        release_workers(context)
    for table in render_tables(result):
        out.print(table)
    out.print(f"report: {result.report_dir}")
    if not result.passed:
        fail(result.failures(), "gate failed")
    out.print("[green]all gates passed[/]")


recipe_app = typer.Typer(help="Validate or create recipe files.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
def recipe_validate(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML to check.")],
    set_: SetOption = None,
) -> None:
    """Check a recipe against the schema (keys, types, values, regexes, ${ENV}); print the resolved recipe."""
    from quantkit.recipes.schema import dump_recipe, load_recipe, recipe_secrets
    from quantkit.redaction import redact

    loaded = load_recipe(recipe, list(set_ or []))
    out.print(escape(redact(dump_recipe(loaded), recipe_secrets(loaded))), end="")
    out.print(f"[green]{escape(str(recipe))} is valid[/]")


@recipe_app.command("new")
def recipe_new(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write (default: print).")] = None,
    force: Annotated[bool, typer.Option(help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented starting recipe (W4 GPTQ on smollm2-135m) that validates."""
    from quantkit.recipes.starter import write_starter

    text = write_starter(output, force=force)
    if output is None:
        print(text, end="")
    else:
        out.print(f"wrote {output}; run it with `quantkit run {output}`")
