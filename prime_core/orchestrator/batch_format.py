"""How a step batch is laid out on disk: ``binary`` (the default) or ``json``
(``orchestrator.batch_format``).

``binary`` is one safetensors file, ``rollouts/step_N/batch.safetensors``. Each per-token field
is one flat typed array, every packed row's tokens back to back (``input_ids`` int32,
``loss_mask`` uint8, ``advantages`` and ``inference_logprobs`` float32), and ``row_lengths``
(int64) says where each row ends. Position ids as ``pack`` makes them (0, 1, ... in each
sample) are stored as ``sample_lengths`` (int64, one per sample) and rebuilt on reading; any
other position ids are stored as they are (``position_ids``, int32). The teacher's log-probabilities
(on-policy distillation) are stored only for the rows that carry them (``teacher_logprobs``,
float32, with ``teacher_logprobs_rows`` marking those rows). The safetensors header's
metadata holds a small JSON object: ``step``, ``temperature``, ``info``, ``training_mode`` and a
CRC-32 of each array, so a damaged file is refused rather than trained on. float32 is what the trainer
computes in, so the trainer sees the same numbers as from JSON. At 512 samples of 16k tokens
this is several times smaller and over ten times faster to write and read than JSON text
(``benchmarks/batch_format_bench.py``).

``json`` is ``rollouts/step_N/batch.json``: ``{"step", "temperature", "info",
"micro_batches": [{"input_ids": [...], ...}, ...]}``, readable with any tool, for debugging.

Each format has its own file name, so the reader needs no setting: it reads whichever file
the orchestrator wrote, and returns the same thing for both, every row's fields as numpy arrays
of the dtypes above. Both files are written atomically (a temporary name, fsync, rename).

A format, not a transport: the batch still travels as a file under ``output_dir`` (what
prime-rl calls its ``filesystem`` rollout transport), so the choice is a core setting with two
codecs beside each other here, not a plugin hook.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ARRAYS: dict[str, Any] = {
    "input_ids": np.int32,  # vocabularies are far below 2**31
    "position_ids": np.int32,
    "loss_mask": np.uint8,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
}
"""The per-token fields of a packed row (``MicroBatch``) and the dtype each is stored and read as."""
OPTIONAL: dict[str, Any] = {"teacher_logprobs": np.float32}
"""Per-token fields a row may lack (``None`` in ``MicroBatch``): stored for the rows that have
them, with ``<name>_rows`` (uint8, one per row) saying which rows those are."""
HEADER = ("step", "temperature", "info", "training_mode")
"""The batch's fields besides its rows (``training_mode`` is absent from batches of older prime)."""

MAGIC = "prime-step-batch"
VERSION = 1


class BatchFileError(ValueError):
    """A step file that cannot be read (``batch.read_batch`` adds the file's name)."""


@dataclass(frozen=True)
class BatchFormat:
    name: str
    filename: str
    encode: Callable[[dict, list], bytes]
    """``encode(header, rows)``: ``header`` holds the ``HEADER`` fields, ``rows`` the
    packed ``MicroBatch``es (or dicts with their fields)."""
    decode: Callable[[bytes], dict]
    """The file's bytes -> ``{**header, "micro_batches": [{field: array}, ...]}``; raises
    ``BatchFileError`` for anything that is not a whole, well-formed batch."""


def _fields(row) -> dict:
    return row if isinstance(row, dict) else row.as_dict()


# -- binary -----------------------------------------------------------------------------------

def _flat(rows: list, key: str, dtype) -> np.ndarray:
    # One conversion of the Python lists straight into the typed array (no per-row arrays).
    out = np.empty(sum(len(r[key]) for r in rows), dtype=dtype)
    start = 0
    for r in rows:
        values = r[key]
        out[start:start + len(values)] = values
        start += len(values)
    return out


def _positions(sample_lengths: np.ndarray) -> np.ndarray:
    """Position ids that count from 0 in each sample of ``sample_lengths``, back to back."""
    total = int(sample_lengths.sum())
    starts = np.cumsum(sample_lengths) - sample_lengths
    return (np.arange(total, dtype=np.int64) - np.repeat(starts, sample_lengths)).astype(np.int32)


def _sample_lengths(positions: np.ndarray, row_lengths: np.ndarray) -> np.ndarray | None:
    """The samples' lengths when ``positions`` are what ``pack`` makes (every sample counts
    from 0 and every row begins with a sample), ``None`` for any other position ids."""
    starts = np.flatnonzero(positions == 0)
    row_starts = np.cumsum(row_lengths) - row_lengths
    if len(positions) and not np.isin(row_starts[row_lengths > 0], starts).all():
        return None
    lengths = np.diff(np.append(starts, len(positions))).astype(np.int64)
    return lengths if np.array_equal(_positions(lengths), positions) else None


def encode_binary(header: dict, rows: list) -> bytes:
    from safetensors.numpy import save

    rows = [_fields(r) for r in rows]
    arrays = {key: _flat(rows, key, dtype) for key, dtype in ARRAYS.items()}
    arrays["row_lengths"] = np.array([len(r["input_ids"]) for r in rows], dtype=np.int64)
    for key, values in arrays.items():
        if len(values) != (len(rows) if key == "row_lengths" else int(arrays["row_lengths"].sum())):
            raise ValueError(f"a packed row's {key} is not as long as its input_ids")
    for key, dtype in OPTIONAL.items():
        present = np.array([r.get(key) is not None for r in rows], dtype=np.uint8)
        if present.any():
            having = [r for r in rows if r.get(key) is not None]
            if any(len(r[key]) != len(r["input_ids"]) for r in having):
                raise ValueError(f"a packed row's {key} is not as long as its input_ids")
            arrays[key], arrays[f"{key}_rows"] = _flat(having, key, dtype), present
    # Packed rows' position ids only count up from 0 in each sample: the samples' lengths say
    # the same in a few bytes per sample instead of four per token.
    lengths = _sample_lengths(arrays["position_ids"], arrays["row_lengths"])
    if lengths is not None:
        del arrays["position_ids"]
        arrays["sample_lengths"] = lengths
    meta = {**header, "format": MAGIC, "version": VERSION,
            "crc32": {key: zlib.crc32(values) for key, values in arrays.items()}}
    return save(arrays, metadata={"prime": json.dumps(meta)})


def decode_binary(data: bytes) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(data)
    except (SafetensorError, ValueError, TypeError, KeyError) as exc:  # a cut or garbled header
        raise BatchFileError(f"not a whole safetensors file ({type(exc).__name__}: {exc})") from None
    meta = _metadata(data)
    if meta.get("format") != MAGIC:
        raise BatchFileError(f"a safetensors file without prime's step-batch header (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise BatchFileError(f"step-batch version {meta.get('version')!r}, this prime reads version {VERSION}")
    _check_arrays(arrays, meta)
    lengths = arrays["row_lengths"]
    total = int(lengths.sum())
    if "sample_lengths" in arrays:
        if (arrays["sample_lengths"] <= 0).any() or int(arrays["sample_lengths"].sum()) != total:
            raise BatchFileError(f"the samples' lengths do not add up to the rows' {total} tokens")
        arrays["position_ids"] = _positions(arrays["sample_lengths"])
    if (lengths < 0).any() or any(len(arrays[key]) != total for key in ARRAYS):
        raise BatchFileError(f"the rows' lengths add up to {total} tokens, the arrays hold "
                             f"{sorted({len(arrays[key]) for key in ARRAYS})}")
    ends = np.cumsum(lengths)[:-1]
    split = {key: np.split(arrays[key], ends) if len(lengths) else [] for key in ARRAYS}
    rows = [{key: split[key][i] for key in ARRAYS} for i in range(len(lengths))]
    _add_optional(arrays, rows, lengths)
    return {**{key: meta[key] for key in HEADER if key in meta}, "micro_batches": rows}


def _check_arrays(arrays: dict, meta: dict) -> None:
    """Every array the header promises is there, flat, of its dtype and matches its checksum."""
    expected = {**ARRAYS, "row_lengths": np.int64}
    if "position_ids" not in arrays:
        del expected["position_ids"]
        expected["sample_lengths"] = np.int64
    for key, dtype in OPTIONAL.items():
        if f"{key}_rows" in arrays:
            expected.update({key: dtype, f"{key}_rows": np.uint8})
    for key, dtype in expected.items():
        if key not in arrays:
            raise BatchFileError(f"the array {key!r} is missing")
        if arrays[key].dtype != dtype or arrays[key].ndim != 1:
            raise BatchFileError(f"{key} is {arrays[key].dtype}{list(arrays[key].shape)}, expected a flat "
                                 f"{np.dtype(dtype)} array")
        if zlib.crc32(arrays[key]) != meta.get("crc32", {}).get(key):
            raise BatchFileError(f"{key} does not match its checksum: the file is damaged")


def _add_optional(arrays: dict, rows: list[dict], lengths: np.ndarray) -> None:
    """Give the rows marked in ``<name>_rows`` their slice of each ``OPTIONAL`` array."""
    for key in OPTIONAL:
        if f"{key}_rows" not in arrays:
            continue
        present = arrays[f"{key}_rows"].astype(bool)
        having = lengths[present] if len(present) == len(rows) else lengths[:0]
        if len(present) != len(rows) or len(arrays[key]) != int(having.sum()):
            raise BatchFileError(f"{key} does not fit the rows that say they have it")
        if not present.any():
            continue
        for i, values in zip(np.flatnonzero(present), np.split(arrays[key], np.cumsum(having)[:-1]), strict=True):
            rows[i][key] = values


def _metadata(data: bytes) -> dict:
    # safetensors: 8 bytes of little-endian header size, then the JSON header (already checked
    # whole by ``load``); prime's own fields are a JSON string under "prime" in its metadata.
    size = int.from_bytes(data[:8], "little")
    try:
        meta = json.loads(data[8:8 + size])["__metadata__"]["prime"]
        return json.loads(meta)
    except (KeyError, TypeError, ValueError):
        return {}


# -- json -------------------------------------------------------------------------------------

def encode_json(header: dict, rows: list) -> bytes:
    return json.dumps({**header, "micro_batches": [_fields(r) for r in rows]}).encode()


def row_arrays(row: dict) -> dict:
    """A packed row's fields (``MicroBatch.as_dict()``: lists) as the trainer reads them from
    either format: numpy arrays of ``ARRAYS``' dtypes, and ``OPTIONAL``'s where present."""
    arrays = {key: np.asarray(row[key], dtype=dtype) for key, dtype in ARRAYS.items()}
    arrays.update({key: np.asarray(row[key], dtype=dtype) for key, dtype in OPTIONAL.items()
                   if row.get(key) is not None})
    return arrays


def decode_json(data: bytes) -> dict:
    try:
        payload = json.loads(data)
    except ValueError as exc:  # a cut file ends mid-value
        raise BatchFileError(f"not a whole JSON document ({exc})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("micro_batches"), list):
        raise BatchFileError("no micro_batches list: not a step batch")
    rows = []
    for i, row in enumerate(payload["micro_batches"]):
        try:
            arrays = row_arrays(row)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise BatchFileError(f"micro_batches[{i}] is not a packed row ({type(exc).__name__}: {exc})") from None
        if any(a.ndim != 1 or len(a) != len(arrays["input_ids"]) for a in arrays.values()):
            raise BatchFileError(f"micro_batches[{i}]: its fields are not all as long as its input_ids")
        rows.append(arrays)
    return {"info": {}, **{key: payload[key] for key in HEADER if key in payload}, "micro_batches": rows}


FORMATS: dict[str, BatchFormat] = {
    "binary": BatchFormat("binary", "batch.safetensors", encode_binary, decode_binary),
    "json": BatchFormat("json", "batch.json", encode_json, decode_json),
}


def format_of(path: Path) -> BatchFormat | None:
    """The format whose file name ``path`` has."""
    return next((f for f in FORMATS.values() if f.filename == Path(path).name), None)
