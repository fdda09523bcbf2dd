"""The built-in ``filesystem`` weight transport meets the weight-transport contract, and the
suite fails on transports that break it."""

import shutil

import pytest

from prime_core.specs import WeightTransport
from prime_core.testing.contracts import ContractError
from prime_core.testing.contracts import weight_transport as contract
from prime_core.testing.contracts.weight_transport import WeightTransportContract
from prime_core.weights import MARKER, FilesystemLoader, FilesystemPublisher, versions


class TestFilesystem(WeightTransportContract):
    name = "filesystem"
    plugin = "prime_core.builtin"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return contract.tiny_model(tmp_path_factory.mktemp("tiny"))


def transport(publisher=FilesystemPublisher, loader=FilesystemLoader):
    return WeightTransport(name="broken", publisher=publisher, loader=loader)


class NoMarkerNeeded(FilesystemLoader):
    """Takes any step_N folder, finished or not."""

    def latest(self):
        found = versions(self.root)
        return max(found) if found else None


class InPlace(FilesystemPublisher):
    """Writes straight into step_N and marks it first."""

    marker_first = True

    def publish(self, model, step, state_dict=None):
        final = self.root / f"step_{step}"
        shutil.rmtree(final, ignore_errors=True)
        final.mkdir(parents=True)
        if self.marker_first:
            (final / MARKER).touch()
        model.save_pretrained(final, state_dict=state_dict, safe_serialization=True)
        (final / MARKER).touch()
        return final


class InPlaceMarkedLast(InPlace):
    marker_first = False


@pytest.mark.parametrize("spec", [transport(publisher=InPlace),  # the marker lies
                                  transport(publisher=InPlaceMarkedLast, loader=NoMarkerNeeded)])  # nobody reads it
def test_half_written_versions_are_caught(spec, tmp_path):
    model = contract.tiny_model(tmp_path / "tiny")  # slow_saves patches this instance
    with pytest.raises(ContractError, match="saw a half-written version"):
        contract.check_never_half_written(spec, model, tmp_path / "run", tmp_path / "scratch", pause=0.2)


def test_a_correct_transport_is_polled_many_times(model, tmp_path):
    looks = contract.check_never_half_written(transport(), contract.tiny_model(tmp_path / "tiny"), tmp_path / "run",
                                              tmp_path / "scratch", pause=0.2)
    assert looks > 20, "the poller must look often enough to see a half-written version"


class Oldest(FilesystemLoader):
    def latest(self):
        ready = [(s, p) for s, p in versions(self.root) if (p / MARKER).exists()]
        return min(ready) if ready else None


class Remembers(FilesystemLoader):
    """Keeps the first answer: never sees newer versions."""

    def latest(self):
        if getattr(self, "first", None) is None:
            self.first = super().latest()
        return self.first


class OwnWeights(FilesystemPublisher):
    """Publishes the model's own tensors instead of the full ones it is handed."""

    def publish(self, model, step, state_dict=None):
        return super().publish(model, step, None)


@pytest.mark.parametrize(("spec", "message"), [
    (transport(loader=Oldest), "latest\\(\\) is step 1, expected 2"),
    (transport(loader=Remembers), "latest\\(\\) is step 1, expected 2"),
    (transport(publisher=OwnWeights), "step 1 at .*: other values in"),
])
def test_version_violations(model, tmp_path, spec, message):
    with pytest.raises(ContractError, match=message):
        contract.check_versions(spec, model, tmp_path / "run", tmp_path / "scratch", other_process=False)


IN_MEMORY = """
from prime_core import hookimpl
from prime_core.specs import WeightTransport
from prime_core.weights import FilesystemLoader, FilesystemPublisher

PRIME_PLUGIN_API = 1
SHARED = {}


class Publisher(FilesystemPublisher):
    def publish(self, model, step, state_dict=None):
        path = self.root / f"unmarked_{step}"
        model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        SHARED[str(self.root)] = (step, path)


class Loader(FilesystemLoader):
    # Hears of new versions from a publisher in its own process only.
    def latest(self):
        return SHARED.get(str(self.root))


@hookimpl
def prime_weight_transports():
    return [WeightTransport(name="in_memory", publisher=Publisher, loader=Loader)]
"""


def test_a_loader_that_only_works_in_the_publishing_process_fails(model, tmp_path, monkeypatch):
    import importlib
    import os

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "in_memory_transport.py").write_text(IN_MEMORY)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "mods"), os.environ.get("PYTHONPATH", "")]))
    module = importlib.import_module("in_memory_transport")
    spec = module.prime_weight_transports()[0]
    with pytest.raises(ContractError, match="latest\\(\\) returned None, not \\(step, path\\)"):
        contract.check_versions(spec, model, tmp_path / "run", tmp_path / "scratch", plugin="in_memory_transport")


def test_adapters_must_be_published_as_adapters(model, tmp_path):
    class FullWeightsOnly(FilesystemPublisher):
        def publish(self, model, step, state_dict=None):
            return super().publish(model, step, None)

    with pytest.raises(ContractError, match="is not an adapter folder"):
        contract.check_adapter(transport(publisher=FullWeightsOnly), model, tmp_path / "run")
