"""Temporary files and directories that runs killed on the way leave beside an output, found and removed by the
next run on the same output (with a message): the checkpoint writer's ``<out>.tmp-<pid>``, the swap's
``.<out>.old-<pid>``, retired work directories ``.<out>.partial.retired-<pid>``, and a GGUF run's file and work
directory ``.<out>.tmp-<pid>`` and ``.<out>.work-<pid>``.

Called with the output's lock held (:mod:`quantkit.quantization.output_lock`): no other run is writing beside the
output then, so every such temporary but this process's own is a dead run's."""

from __future__ import annotations

import os
import re
from pathlib import Path

from quantkit.atomic import remove_path
from quantkit.progress import console


def leftovers(output: Path) -> list[Path]:
    """The temporaries of earlier runs beside ``output`` (call it holding the output's lock)."""
    output = Path(output)
    name = re.escape(output.name)
    pattern = re.compile(rf"(?:{name}\.tmp|\.{name}\.(?:old|tmp|work)|\.{name}\.partial\.retired)-(\d+)")
    if not output.parent.is_dir():
        return []
    found = []
    for path in sorted(output.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and int(match.group(1)) != os.getpid():
            found.append(path)
    return found


def remove_leftovers(output: Path) -> None:
    for path in leftovers(output):
        console.print(f"removing {path}, left by an interrupted run", highlight=False)
        remove_path(path)
