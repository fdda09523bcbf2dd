"""Small math datasets written by the tests: as a local JSONL file, and as the local Hugging Face
cache of two Hub datasets (``PrimeIntellect/INTELLECT-3-RL`` subset ``math``, math-env's default,
and ``PrimeIntellect/Hendrycks-Math`` subset ``default``, the seeds' one).

The cache is what ``datasets.load_dataset(id, subset, split=...)`` leaves on a connected
machine: ``<cache>/<Namespace>___<name>/<subset>/0.0.0/<hash>/`` with ``dataset_info.json`` and
``<name>-<split>.arrow``, written here by datasets' own builder from local rows. (The builder
refuses a Hub repository id for local data files, so it writes without the namespace and the
folder is then renamed to the Hub id's.) Offline, ``datasets`` finds it by the Hub id and loads
it through its cache module, exactly as it would a downloaded dataset.
"""

from __future__ import annotations

import json

import pytest

PROBLEMS = [
    {"question": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}", "difficulty": 0.9},
    {"question": "Solve $2x + 3 = 7$ for $x$.", "answer": "We subtract 3 and halve: $x = \\boxed{2}$.",
     "difficulty": 0.8},
    {"question": "Write $\\sqrt{8}$ in simplest form.", "answer": "2\\sqrt{2}", "difficulty": 0.4},
    {"question": "Evaluate $3^4$.", "answer": "81", "difficulty": 1.0},
    {"question": "Two fair coins are tossed. What is the probability of two heads?", "answer": "\\dfrac{1}{4}",
     "difficulty": 0.3},
    {"question": "For which real $x$ is $x^2 < 1$? Give an interval.", "answer": "(-1, 1)", "difficulty": 0.1},
]
"""Problems and their reference answers; a worked solution's reference is its last box."""

RIGHT = {"\\frac{3}{4}": ["0.75", "\\frac{6}{8}", "3/4"], "2": ["2", "2.0", "x = 2"],
         "2\\sqrt{2}": ["\\sqrt{8}", "2 \\sqrt 2"], "81": ["81", "3^4"], "\\dfrac{1}{4}": ["0.25", "\\frac14", "1/4"],
         "(-1, 1)": ["(-1,1)"]}
"""Other ways to write each right answer, worked out by hand."""
WRONG = {"\\frac{3}{4}": ["0.76", "\\frac{4}{3}"], "2": ["3", "-2"], "2\\sqrt{2}": ["\\sqrt{2}", "2.83"],
         "81": ["80", "27"], "\\dfrac{1}{4}": ["\\frac{1}{2}", "4"], "(-1, 1)": ["[-1, 1]", "(0, 1)"]}

HUB_DATASETS = {("PrimeIntellect/INTELLECT-3-RL", "math"): "train",
                ("PrimeIntellect/Hendrycks-Math", "default"): "train"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def problems():
    return PROBLEMS


@pytest.fixture(scope="session")
def answers():
    """``(RIGHT, WRONG)``: answers to each problem's reference, right and wrong."""
    return RIGHT, WRONG


@pytest.fixture(scope="session")
def jsonl():
    return write_jsonl


@pytest.fixture(scope="session")
def problems_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("math") / "problems.jsonl", PROBLEMS)


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory, problems_file):
    """An ``HF_HOME`` whose dataset cache holds ``HUB_DATASETS`` (the problems above)."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "datasets"
    for (repo, subset), split in HUB_DATASETS.items():
        namespace, name = repo.split("/")
        name = camelcase_to_snakecase(name)
        builder = Json(cache_dir=str(cache), dataset_name=name, config_name=subset, config_id=subset,
                       data_files={split: str(problems_file)}, hash="0123456789abcdef")
        builder.download_and_prepare()
        (cache / name).rename(cache / f"{namespace}___{name}")
    return home


@pytest.fixture
def offline_cache(hf_home, monkeypatch):
    """This process as an offline machine whose cache is ``hf_home`` (datasets reads both settings
    when it is imported, so they are set on its config here)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return hf_home
