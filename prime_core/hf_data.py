"""Rows of a ``datasets`` dataset, loaded exactly as on a connected machine, with an error a
user can act on when they cannot be had here (SFT's ``[data] name``, math-env's ``dataset_name``).

A dataset id goes through ``datasets.load_dataset(name, subset, split=split)``. With
``HF_HUB_OFFLINE=1`` (or ``HF_DATASETS_OFFLINE=1``; prime's roles set the first unless the
environment says otherwise) that reads the local cache only and fails at once when the dataset is
not there; without it, ``datasets`` asks the Hub first (and retries for a while when the Hub
cannot be reached) before it falls back to the cache. A local folder or data file is read
without any network.
"""

from __future__ import annotations

from pathlib import Path

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class DatasetUnavailable(ValueError):
    """The dataset cannot be loaded here; the message names it and the fix."""


def load_rows(name: str, subset: str | None, split: str, *, who: str = "math-env", key: str = "dataset_name"):
    """The ``datasets.Dataset`` of one split; errors start with ``who`` and name ``key`` (the
    config key that holds ``name``) in their fix."""
    try:
        import datasets
    except ImportError:
        raise DatasetUnavailable(f"{who}: reading dataset '{name}' needs the datasets package: pip install "
                                 "'prime-core[datasets]' (or pip install datasets)") from None

    shown = f"dataset '{name}' (subset {subset!r}, split {split!r})"
    path = Path(name).expanduser()
    try:
        if path.is_file():
            if path.suffix not in FILE_BUILDERS:
                raise DatasetUnavailable(f"{who}: {shown}: cannot read a '{path.suffix}' file; use one of "
                                         f"{', '.join(FILE_BUILDERS)}")
            return datasets.load_dataset(FILE_BUILDERS[path.suffix], data_files={split: str(path)}, split=split)
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return _split_of(datasets.load_from_disk(str(path)), split, shown, who)
        if path.is_dir():  # a folder of data files (a clone of a Hub repository)
            return datasets.load_dataset(str(path), None if subset in (None, "default") else subset, split=split)
        return datasets.load_dataset(name, subset, split=split)
    except DatasetUnavailable:
        raise
    except (OSError, ValueError) as exc:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, bad split
        raise DatasetUnavailable(_explain(shown, name, subset, split, exc, local=path.exists(), who=who,
                                          key=key)) from None


def cache_problem(name: str, subset: str | None, split: str, *, who: str, key: str) -> str | None:
    """Why roles running offline here would fail to load this split of ``name`` (a dataset id
    not in the local cache, or a subset or split the cache lacks), with ``load_rows``'s message;
    ``None`` when they will find it, when ``name`` is a local path (read when the role starts), or
    when the roles may download (``HF_HUB_OFFLINE=0``). Only the cache's metadata is read
    (``load_dataset_builder``), so a run's checks stay fast on a large cached dataset."""
    from prime_core.hub import offline

    if Path(name).expanduser().exists() or not offline():
        return None
    try:
        import datasets
    except ImportError:
        return None  # the role's load says which package to install
    if not datasets.config.HF_HUB_OFFLINE:
        return None  # imported before prime set HF_HUB_OFFLINE: looking would wait on the network
    shown = f"dataset '{name}' (subset {subset!r}, split {split!r})"
    try:
        splits = datasets.load_dataset_builder(name, subset).info.splits
    except (OSError, ValueError) as exc:
        return _explain(shown, name, subset, split, exc, local=False, who=who, key=key)
    if splits and split not in splits:
        return f"{who}: {shown}: the cached dataset has no split '{split}'; it has {', '.join(splits)}"
    return None


def _split_of(loaded, split: str, shown: str, who: str):
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DatasetUnavailable(f"{who}: {shown}: the saved dataset has no split '{split}'; it has "
                                     f"{', '.join(loaded)}")
        return loaded[split]
    return loaded


def _explain(shown: str, name: str, subset: str | None, split: str, exc: Exception, *, local: bool, who: str,
             key: str) -> str:
    import datasets

    reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
    if local:
        return f"{who}: cannot load {shown} from the local path: {reason}"
    offline = datasets.config.HF_HUB_OFFLINE
    where = f"the local cache ({datasets.config.HF_DATASETS_CACHE})"
    fix = (f"on a machine that reaches the Hub, run `python -c \"import datasets; datasets.load_dataset("
           f"{name!r}, {subset!r}, split={split!r})\"` and copy its HF_HOME cache here (HF_HOME or "
           "HF_DATASETS_CACHE points at it), or save the rows with `.save_to_disk(DIR)` or as a .jsonl/.parquet "
           f"file and set {key} to that path")
    if offline:
        fix += "; where the Hub is reachable, HF_HUB_OFFLINE=0 lets datasets download it"
    mode = "offline (HF_HUB_OFFLINE=1), from " if offline else "from the Hub or "
    return f"{who}: cannot load {shown} {mode}{where}: {reason}. Fix: {fix}"
