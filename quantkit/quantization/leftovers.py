"""Temporary files and directories that runs killed on the way leave beside an output, found and removed by the
next run on the same output (with a message): the checkpoint writer's ``<out>.tmp-<pid>``, the swap's
``.<out>.old-<pid>``, and retired work directories ``.<out>.partial.retired-<pid>``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from quantkit.atomic import remove_path
from quantkit.progress import console


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def leftovers(output: Path) -> list[Path]:
    """The temporaries of dead runs beside ``output``."""
    output = Path(output)
    name = re.escape(output.name)
    pattern = re.compile(rf"(?:{name}\.tmp|\.{name}\.old|\.{name}\.partial\.retired)-(\d+)")
    if not output.parent.is_dir():
        return []
    found = []
    for path in sorted(output.parent.iterdir()):
        match = pattern.fullmatch(path.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            found.append(path)
    return found


def remove_leftovers(output: Path) -> None:
    for path in leftovers(output):
        console.print(f"removing {path}, left by an interrupted run", highlight=False)
        remove_path(path)
