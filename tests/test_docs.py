"""The docs state facts the code holds; each is checked against the code, so the two cannot drift: the README's
commands are the ones CI runs, the generated blocks (option tables, limits, presets) are rendered from the code,
the import rules in docs/internals.md are the test's, docs/benchmarks.md (and the README's comparison table) are
the recorded tables rendered, and the presets, methods and defaults the docs name exist."""

from __future__ import annotations

import re

from helpers.paths import REPO
from test_import_rules import ALLOWED, FOUNDATION

from quantkit.format.presets import PRESETS
from quantkit.quantization.methods.composition import method_spellings
from quantkit.server.smoke import SMOKE_MAX_TOKENS

README = (REPO / "README.md").read_text()
DOCS = REPO / "docs"


def _between(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands() -> None:
    assert len(README.splitlines()) <= 150
    install_run, install_test = _bash_blocks(README)[:2]
    assert "quantkit quantize smollm2-135m" in install_run and install_run.startswith("pip install torch==2.13.0")
    ci = (REPO / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")  # quiet in CI
    for step in install_test.split(" && "):
        if step.startswith("python -m pytest"):  # .ci/run runs the same pytest command, one marker at a time
            marker = re.search(r'-p no:cacheprovider -m "([^"]+)"', step) or re.search(r"cacheprovider -m (\w+)", step)
            assert marker is not None and f'test_step "{marker.group(1)}"' in ci, step
            assert "python -m pytest -q -p no:cacheprovider -m" in ci
        else:
            assert step in ci, step


def test_every_doc_the_readme_links_exists() -> None:
    for target in re.findall(r"\]\((docs/[\w.]+\.md)", README):
        assert (REPO / target).is_file(), target


def test_every_section_a_comment_or_doc_points_to_is_a_heading_of_that_doc() -> None:
    # References read `docs/benchmarks.md, "Mixed precision"`: the quoted words start one of the doc's headings.
    reference = re.compile(r'(docs/[\w-]+\.md), "([^"]+)"')
    sources = [
        *REPO.glob("quantkit/**/*.py"),
        *REPO.glob("recipes/*.yaml"),
        *REPO.glob("benchmarks/*.py"),
        *DOCS.glob("*.md"),
    ]
    found = 0
    for source in sources:
        for doc, wrapped in reference.findall(source.read_text()):
            section = re.sub(r"\s*\n\s*#?\s*", " ", wrapped)  # a reference may wrap across comment lines
            headings = re.findall(r"^#+ (.+)$", (REPO / doc).read_text(), flags=re.MULTILINE)
            assert any(heading.startswith(section) for heading in headings), f"{source}: {doc} has no {section!r}"
            found += 1
    assert found >= 5  # the pattern still matches how the references are written


def test_the_import_rules_in_internals_are_the_tests() -> None:
    table = _between((DOCS / "internals.md").read_text(), "import-rules")
    documented = {}
    for line in table.splitlines()[2:]:
        area, allowed = (cell.strip() for cell in line.strip("|").split("|"))
        documented[area.strip("`")] = set(re.findall(r"`([\w.]+)`", allowed))
    enforced = {area: rules for area, rules in ALLOWED.items() if area not in FOUNDATION}
    assert documented == enforced


def test_the_benchmark_page_and_the_readme_table_are_the_recorded_tables() -> None:
    from benchmarks.render import PAGE, render, render_readme

    assert PAGE.read_text() == render()
    assert render_readme(README) == README


def test_presets_methods_and_defaults_the_docs_name_exist() -> None:
    cli, recipes = (DOCS / "cli.md").read_text(), (DOCS / "recipes.md").read_text()
    for name in PRESETS:
        assert name in cli
    for spelling in method_spellings():
        assert f"`{spelling}`" in cli
    assert f"max_tokens: {SMOKE_MAX_TOKENS}" in (REPO / "quantkit" / "recipes" / "starter.py").read_text()
    assert "`solvers`" in recipes and "{gptq: {}}" in recipes


def test_every_generated_block_of_the_docs_is_current() -> None:
    """The option tables (quantize, serve, engine), the request limits, the unsupported parameters and the preset
    table, each rendered from its home in the code; `python -m tools.render_docs` rewrites a stale one."""
    from tools.render_docs import stale_blocks

    assert stale_blocks(write=False) == []


def test_the_serving_prose_names_the_codes_metrics_and_numbers_the_server_has() -> None:
    from benchmarks.abuse_patterns import PATTERNS
    from quantkit.server.config import ServeConfig
    from quantkit.server.connection import SEND_BUFFER_BYTES
    from quantkit.server.engine_thread import UNHEALTHY_AFTER
    from quantkit.server.openapi import ERROR_RESPONSES

    serving = (DOCS / "serving.md").read_text()
    server = REPO / "quantkit" / "server"
    sources = "".join(path.read_text() for path in sorted(server.rglob("*.py")))
    # every error code a client can get is in the error table, and the table names no code the server lacks
    codes = set(re.findall(r'code="(\w+)"', sources))
    errors = serving.split("## Errors", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in errors.splitlines() if line.startswith("| ")][1:]
    assert {code for row in rows for code in re.findall(r"`(\w+)`", row[2])} == codes
    statuses = {int(status) for row in rows for status in re.findall(r"\d+", row[0])}
    assert set(ERROR_RESPONSES) <= statuses
    # every metric the docs name exists
    metrics = (server / "metrics.py").read_text() + (server / "routes" / "metrics.py").read_text()
    for name in re.findall(r"`((?:quantkit_|vllm:|process_)[\w:]+)", serving):
        assert f'"{name}' in metrics or f"{name} " in metrics, name
    # numbers the prose states
    assert f"2048-token context\n  accepts {ServeConfig().resolved_max_body_bytes(2048)} bytes" in serving
    assert f"fixed at {SEND_BUFFER_BYTES // 1024} KiB" in serving
    assert f"last {UNHEALTHY_AFTER} steps all failed" in serving
    # the abuse benchmark: its patterns, and options it has
    abuse = serving.split("## Abuse benchmark", 1)[1]
    for name in PATTERNS:
        assert name in abuse.replace("\n", " "), name
    options = (REPO / "benchmarks" / "abuse.py").read_text()
    for flag in set(re.findall(r"(--[a-z][\w-]+)", abuse)):
        assert f'"{flag}"' in options, flag


def test_the_supported_architectures_section_names_every_model_type_of_the_table() -> None:
    from quantkit.model.architectures import supported_model_types

    text = (DOCS / "formats.md").read_text()
    section = text.split("## Supported architectures", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9_]+)`", section))
    assert set(supported_model_types()) <= named, sorted(set(supported_model_types()) - named)


def test_the_recipe_page_names_every_gate_the_report_checks() -> None:
    from quantkit.recipes.report import GATES

    gates_item = (DOCS / "recipes.md").read_text().split("- `gates`:", 1)[1].split("\n- `", 1)[0]
    missing = [name for name in GATES if name not in gates_item]
    assert not missing, f"docs/recipes.md's gates item does not name {missing}"


def test_the_recipe_page_states_the_mixed_keys_and_the_outer_default_of_the_schema() -> None:
    from quantkit.recipes.schema import MixedSection

    item = (DOCS / "recipes.md").read_text().split("instead of one scheme, `mixed`", 1)[1].split("\n- `", 1)[0]
    missing = [key for key in MixedSection.model_fields if f"`{key}" not in item]
    assert not missing, f"docs/recipes.md's mixed item does not name {missing}"
    default = MixedSection.model_fields["outer_candidates"].default_factory()  # type: ignore[misc]
    assert f"default `[{', '.join(default)}]`" in " ".join(item.split())
