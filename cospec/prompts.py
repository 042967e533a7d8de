"""Reading prompts from a file, for every command that takes ``--prompts-file``."""

from __future__ import annotations

import json
from pathlib import Path

from cospec.errors import CoSpecError


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: JSONL lines with a ``prompt`` field, or one plain prompt a line."""
    file = Path(path)
    if not file.is_file():
        raise CoSpecError(f"prompts file {path!r} does not exist")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise CoSpecError(f"{path}:{number}: not valid JSON: {err.msg}") from err
            if not isinstance(record.get("prompt"), str):
                raise CoSpecError(f"{path}:{number}: a JSONL line needs a string 'prompt'")
            prompts.append(record["prompt"])
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise CoSpecError(f"prompts file {path!r} holds no prompts")
    return prompts
