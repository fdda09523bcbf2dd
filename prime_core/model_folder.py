"""What a local Hugging Face model folder must hold, checked when a config names it.

Cheap (file names, ``config.json``, the safetensors headers and sizes; no tensor is read), so
every role checks the folder it is given before anything starts, and a damaged folder is
reported with the file at fault instead of a traceback from deep inside a loader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
HEADER_LIMIT = 100 * 1024**2
"""A safetensors header larger than this is not a header (the format caps it at 100 MB)."""


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (empty, truncated, not the format), or ``None``."""
    size = path.stat().st_size
    if size == 0:
        return f"{path} is empty (0 bytes)"
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes, not even a header)"
            (length,) = struct.unpack("<Q", head)
            if length > HEADER_LIMIT or 8 + length > size:
                return f"{path} is truncated or not a safetensors file (a {length}-byte header in {size} bytes)"
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{path} is not a safetensors file ({exc})"
    if not isinstance(header, dict):
        return f"{path} is not a safetensors file (its header is not a table)"
    ends = [t["data_offsets"][1] for name, t in header.items()
            if name != "__metadata__" and isinstance(t, dict) and len(t.get("data_offsets", ())) == 2]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"{path} is truncated: {size} bytes where its header describes {expected}"
    return None


def problems(folder: Path, *, tokenizer: bool = True, weights: bool = True) -> list[str]:
    """Why ``folder`` cannot be loaded as a Hugging Face model (``weights``) and tokenizer
    (``tokenizer``)."""
    folder = Path(folder).expanduser()
    if not any(folder.iterdir()):
        return [f"model folder {folder} is empty"]
    if not weights:
        return _tokenizer_problems(folder) if tokenizer else []
    config = folder / "config.json"
    if not config.is_file():
        return [f"{folder} has no config.json: not a Hugging Face model folder"]
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        return [f"{config} is not valid JSON ({exc})"]
    found = _tokenizer_problems(folder) if tokenizer else []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return [*found, f"{index} is not a valid safetensors index ({exc})"]
        found += [f"{folder / shard} is missing (listed in {index.name})" for shard in sorted(shards)
                  if not (folder / shard).is_file()]
    weights = [p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)]
    if not weights:
        found.append(f"{folder} has no weight files ({', '.join(WEIGHT_PATTERNS)})")
    found += [problem for p in sorted(folder.glob("*.safetensors")) if (problem := safetensors_problem(p))]
    found += [f"{p} is empty (0 bytes)" for p in sorted(folder.glob("*.bin")) if p.stat().st_size == 0]
    return found


def _tokenizer_problems(folder: Path) -> list[str]:
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return []
    return [f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): copy them from the model it "
            "was made from, or name a tokenizer with model.tokenizer"]
