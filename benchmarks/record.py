"""One table of benchmark results as JSON: what the benchmarks write with ``--record NAME`` (into
``benchmarks/results/NAME.json``) and what ``python -m benchmarks.render`` turns into docs/benchmarks.md. A table
carries its own protocol and baseline, so each table in the docs states one of each."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("title", "order", "command", "protocol", "baseline", "machine", "measured", "columns", "rows", "notes")


def machine() -> str:
    """The machine in words: CPU cores, torch build, accelerator."""
    import os

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, torch {torch.__version__}, {gpu}"


def record_table(
    name: str,
    *,
    title: str,
    order: int,
    protocol: str,
    baseline: str,
    columns: list[str],
    rows: list[list[str]],
    notes: list[str] | None = None,
    command: str | None = None,
    machine_name: str | None = None,
    measured: str | None = None,
) -> Path:
    """Write ``benchmarks/results/<name>.json``; the command defaults to this process's command line, the machine
    and the date to this one's (a table recorded from another machine's files names that machine and its date)."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"{name}: a row has {len(row)} cells for {len(columns)} columns: {row}")
    table: dict[str, Any] = {
        "title": title,
        "order": order,
        "command": command or " ".join(["python -m", _module(), *sys.argv[1:]]),
        "protocol": protocol,
        "baseline": baseline,
        "machine": machine_name or machine(),
        "measured": measured or time.strftime("%Y-%m-%d"),
        "columns": columns,
        "rows": rows,
        "notes": notes or [],
    }
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    return path


def _module() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else Path(sys.argv[0]).stem


def load_tables(directory: Path = RESULTS) -> list[dict[str, Any]]:
    """Every recorded table, in order; each checked for its keys and its rows' widths."""
    tables = []
    for path in sorted(directory.glob("*.json")):
        table = json.loads(path.read_text()) | {"name": path.stem}
        missing = [k for k in KEYS if k not in table]
        if missing:
            raise ValueError(f"{path.name}: missing {', '.join(missing)}")
        for row in table["rows"]:
            if len(row) != len(table["columns"]):
                raise ValueError(f"{path.name}: a row has {len(row)} cells for {len(table['columns'])} columns")
        tables.append(table)
    return sorted(tables, key=lambda t: t["order"])
