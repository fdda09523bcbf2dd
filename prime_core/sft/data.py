"""The SFT data file: JSONL, one chat sample per line (``{"messages": [...]}``, the last
message the assistant's)."""

from __future__ import annotations

import json
from pathlib import Path

SHOWN = 5
"""Bad lines named in a report; the rest are counted."""


def line_problem(line: str) -> tuple[list | None, str | None]:
    """A line's messages, or why it is not a sample."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        return None, f"not JSON ({exc})"
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None, "no 'messages' list of {\"role\": ..., \"content\": ...} turns"
    if not messages or messages[-1].get("role") != "assistant":
        return None, "the last message must be the assistant's"
    return messages, None


def file_problems(path: Path) -> list[str]:
    """Every way the file at ``path`` is not SFT data (the first ``SHOWN`` bad lines, a count of
    the others), read once without tokenizing."""
    bad, samples = [], 0
    try:
        with Path(path).open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                messages, why = line_problem(line)
                if why:
                    bad.append((number, why))
                else:
                    samples += 1
    except (OSError, UnicodeDecodeError) as exc:
        return [f"data.path: {path} cannot be read ({exc})"]
    problems = [f"data.path: {path}, line {n}: {why}" for n, why in bad[:SHOWN]]
    if len(bad) > SHOWN:
        problems.append(f"data.path: {path}: {len(bad) - SHOWN} more bad lines")
    if not samples and not bad:
        problems.append(f"data.path: {path} has no samples")
    return problems
