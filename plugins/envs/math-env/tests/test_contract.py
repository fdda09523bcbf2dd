"""math-env meets prime's environment contract (prime_core.testing.contracts.environment): on
its default dataset, read offline from the local Hugging Face cache, and on a local JSONL file."""

from typing import ClassVar

import pytest

from prime_core.testing.contracts.environment import EnvironmentContract

PLUGIN = "prime_plugin_math_env.plugin"


class TestDefaultDatasetFromTheCache(EnvironmentContract):
    name = "math-env"
    args: ClassVar = {"math_verify_max_workers": 2}
    plugin = PLUGIN

    @pytest.fixture(autouse=True)
    def _offline(self, offline_cache):
        """load() with the defaults reads PrimeIntellect/INTELLECT-3-RL (math) from the cache."""


class TestLocalFile(EnvironmentContract):
    name = "math-env"
    plugin = PLUGIN

    @pytest.fixture(autouse=True)
    def _dataset(self, problems_file, offline_cache):
        self.args = {"dataset_name": str(problems_file), "dataset_subset": None, "math_verify_max_workers": 2,
                     "system_prompt": "Think, then box the answer."}
