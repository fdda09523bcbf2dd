"""The plugin manager, against real entry points of fake installed distributions."""

import json
import textwrap

import pytest

from prime_core import hookimpl
from prime_core.errors import PluginError
from prime_core.specs import Launcher, Router

GOOD = textwrap.dedent("""
    from prime_core import hookimpl
    from prime_core.specs import Router

    PRIME_PLUGIN_API = 1

    class Picker:
        def __init__(self, urls):
            self.urls = list(urls)

        def pick(self, request=None):
            return self.urls[0]

    @hookimpl
    def prime_routers():
        return [Router(name="first", make=Picker, description="always the first replica")]
""")


def test_discovers_an_installed_distribution(fake_distribution):
    discover = fake_distribution("prime-plugin-first", entry_points={"first": "first_router"},
                                 files={"first_router.py": GOOD}, version="2.3.4")
    manager = discover()
    record = manager.records["first"]
    assert (record.status, record.dist, record.version) == ("active", "prime-plugin-first", "2.3.4")
    router = manager.select("routers", "first").make(["http://a", "http://b"])
    assert router.pick() == "http://a"


def test_import_failure_is_isolated_and_reported(fake_distribution, prime_cli):
    fake_distribution("prime-plugin-first", entry_points={"first": "first_router"}, files={"first_router.py": GOOD})
    discover = fake_distribution("prime-plugin-broken", entry_points={"broken": "broken_mod"},
                                 files={"broken_mod.py": "raise RuntimeError('needs CUDA 13')\n"})
    manager = discover()
    assert manager.records["broken"].status == "failed"
    assert "RuntimeError: needs CUDA 13" in manager.records["broken"].reason
    assert manager.records["first"].status == "active", "one broken plugin must not take the others down"
    listed = json.loads(prime_cli("plugins", "list", "--json").stdout)
    row = next(p for p in listed["plugins"] if p["name"] == "broken")
    assert row["status"] == "failed" and "needs CUDA 13" in row["reason"]


def test_config_needing_a_failed_plugin_names_it(fake_distribution, prime_cli):
    discover = fake_distribution("prime-plugin-affinity", entry_points={"affinity": "affinity_mod"},
                                 files={"affinity_mod.py": "import does_not_exist\n"})
    discover()
    result = prime_cli("config", "validate", "--orchestrator.client.router", "affinity")
    assert result.exit_code == 2
    assert "plugin 'affinity' (prime-plugin-affinity 1.0.0) failed to load" in result.output
    assert "No module named 'does_not_exist'" in result.output
    assert "Traceback" not in result.output


def test_incompatible_plugin_api_is_refused(fake_distribution):
    discover = fake_distribution("prime-plugin-future", entry_points={"future": "future_mod"},
                                 files={"future_mod.py": GOOD.replace("PRIME_PLUGIN_API = 1", "PRIME_PLUGIN_API = 2")})
    record = discover().records["future"]
    assert record.status == "failed"
    assert "built for plugin API 2" in record.reason and "speaks API 1" in record.reason


def test_missing_plugin_api_is_refused(fake_distribution):
    discover = fake_distribution("prime-plugin-old", entry_points={"old": "old_mod"},
                                 files={"old_mod.py": GOOD.replace("PRIME_PLUGIN_API = 1", "")})
    record = discover().records["old"]
    assert record.status == "failed" and "does not declare PRIME_PLUGIN_API" in record.reason


def test_unknown_hook_is_refused_with_a_suggestion(fake_distribution):
    code = GOOD + "\n@hookimpl\ndef prime_router():\n    return []\n"
    record = fake_distribution("prime-plugin-typo", entry_points={"typo": "typo_mod"},
                               files={"typo_mod.py": code})().records["typo"]
    assert record.status == "failed"
    assert "prime_router" in record.reason and "did you mean 'prime_routers'" in record.reason


def test_hook_with_arguments_the_spec_lacks_is_refused(fake_distribution):
    code = GOOD + "\n@hookimpl\ndef prime_on_checkpoint(step, path, bogus):\n    pass\n"
    record = fake_distribution("prime-plugin-args", entry_points={"args": "args_mod"},
                               files={"args_mod.py": code})().records["args"]
    assert record.status == "failed" and "bogus" in record.reason


def test_registry_hook_returning_the_wrong_type_fails_that_plugin(fake_distribution):
    code = GOOD.replace('return [Router(name="first", make=Picker, description="always the first replica")]',
                        'return [{"name": "first"}]')
    manager = fake_distribution("prime-plugin-loose", entry_points={"loose": "loose_mod"},
                                files={"loose_mod.py": code})()
    assert "first" not in manager.registry("routers")
    assert manager.records["loose"].status == "failed"
    assert "must return Router objects, got dict" in manager.records["loose"].reason


def test_duplicate_provider_names_both(fake_distribution):
    fake_distribution("prime-plugin-a", entry_points={"a": "mod_a"}, files={"mod_a.py": GOOD})
    manager = fake_distribution("prime-plugin-b", entry_points={"b": "mod_b"}, files={"mod_b.py": GOOD})()
    with pytest.raises(PluginError) as err:
        manager.registry("routers")
    message = str(err.value)
    assert "router 'first' is provided by two plugins" in message
    assert "'a' (prime-plugin-a 1.0.0)" in message and "'b' (prime-plugin-b 1.0.0)" in message


def test_two_distributions_claiming_one_plugin_name(fake_distribution):
    fake_distribution("prime-plugin-a", entry_points={"same": "mod_a"}, files={"mod_a.py": GOOD})
    manager = fake_distribution("prime-plugin-b", entry_points={"same": "mod_b"},
                                files={"mod_b.py": GOOD.replace('"first"', '"second"')})()
    failed = [r for r in manager.records.values() if r.status == "failed"]
    assert len(failed) == 1 and "also registered by" in failed[0].reason


def test_disabled_by_env_and_needed_by_config(fake_distribution, prime_cli, monkeypatch):
    discover = fake_distribution("prime-plugin-first", entry_points={"first": "first_router"},
                                 files={"first_router.py": GOOD})
    monkeypatch.setenv("PRIME_DISABLED_PLUGINS", "first")
    manager = discover()
    assert manager.records["first"].status == "disabled"
    result = prime_cli("config", "validate", "--orchestrator.client.router", "first")
    assert result.exit_code == 2
    assert "plugin 'first' (prime-plugin-first 1.0.0) is disabled" in result.output


def test_disabled_by_cli_flag(fake_distribution, monkeypatch, capsys):
    from prime_core.cli.app import main

    fake_distribution("prime-plugin-first", entry_points={"first": "first_router"}, files={"first_router.py": GOOD})
    monkeypatch.setenv("PRIME_DISABLED_PLUGINS", "")  # main() sets it: restored after the test
    with pytest.raises(SystemExit) as exit_info:
        main(["--disable-plugin", "first", "plugins", "list", "--json"])
    assert exit_info.value.code == 0
    rows = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert rows["first"]["status"] == "disabled"
    import os

    assert "first" in os.environ["PRIME_DISABLED_PLUGINS"], "role processes inherit the choice"


class _Named:
    def __init__(self, plugin_name, routers):
        self.routers = routers
        self.__name__ = plugin_name

    @hookimpl
    def prime_routers(self):
        return [Router(name=n, make=lambda urls, n=n: n) for n in self.routers]


def test_selection_does_not_depend_on_registration_order(plugin_manager):
    from prime_core.testing import fresh_manager

    results = []
    for order in (("x", "y"), ("y", "x")):
        manager = fresh_manager()
        plugins = {"x": _Named("x", ["alpha"]), "y": _Named("y", ["beta"])}
        for name in order:
            manager.register(plugins[name], name=name)
        results.append({k: (p.plugin, p.spec.make([])) for k, p in manager.registry("routers").items()
                        if p.plugin != "core"})
        assert [k for k, p in manager.registry("routers").items() if p.plugin != "core"] == ["alpha", "beta"]
    assert results[0] == results[1]


def test_unavailable_capability_says_why(register_plugin, plugin_manager):
    class GpuOnly:
        @hookimpl
        def prime_launchers(self):
            return [Launcher(name="gpu-only", plan=print, launch=print, available=lambda: "no CUDA device visible")]

    register_plugin(GpuOnly(), name="gpu_only")
    statuses = {r.name: r for r in plugin_manager.status()}
    assert (statuses["gpu_only"].status, statuses["gpu_only"].reason) == ("unavailable", "no CUDA device visible")
    with pytest.raises(PluginError, match="cannot run here: no CUDA device visible"):
        plugin_manager.select("launchers", "gpu-only", key="launcher")


def test_unknown_name_lists_what_exists(plugin_manager):
    with pytest.raises(PluginError) as err:
        plugin_manager.select("monitors", "jsonn", key="monitor")
    assert "did you mean 'jsonl'" in str(err.value) and "Available: jsonl" in str(err.value)


class _Aliased:
    def __init__(self, plugin_name, routers):
        self.routers = routers
        self.__name__ = plugin_name

    @hookimpl
    def prime_routers(self):
        return [Router(name=n, make=lambda urls, n=n: n, aliases=aliases) for n, aliases in self.routers.items()]


def test_an_alias_selects_the_named_spec(register_plugin, plugin_manager, prime_cli):
    register_plugin(_Aliased("spread", {"spread_out": ("spread-out", "spreadout")}), name="spread")
    assert plugin_manager.resolve("routers", "spread-out") == "spread_out"
    assert plugin_manager.select("routers", "spreadout").make([]) == "spread_out"
    assert "spread-out" not in plugin_manager.registry("routers"), "an alias is no second entry"
    with pytest.raises(PluginError, match="did you mean 'spread-out'"):
        plugin_manager.select("routers", "spread-ot")
    listed = json.loads(prime_cli("plugins", "list", "--json").stdout)
    row = next(p for p in listed["plugins"] if p["name"] == "spread")
    assert row["provides"]["routers"][0]["aliases"] == ["spread-out", "spreadout"]
    assert prime_cli("config", "validate", "--orchestrator.client.router", "spread-out").output.count(
        "orchestrator.client.router") == 0


@pytest.mark.parametrize(("first", "second", "claimed"), [
    ({"alpha": ("a",)}, {"beta": ("a",)}, "'a' is claimed twice: as an alias of 'beta' by 'y' and as an alias of "
                                          "'alpha' by 'x'"),
    ({"alpha": ()}, {"beta": ("alpha",)}, "'alpha' is claimed twice: as an alias of 'beta' by 'y' and as the name "
                                          "of 'alpha' by 'x'"),
])
def test_an_alias_claimed_twice_is_refused_naming_both(plugin_manager, first, second, claimed):
    plugin_manager.register(_Aliased("x", first), name="x")
    plugin_manager.register(_Aliased("y", second), name="y")
    with pytest.raises(PluginError) as err:
        plugin_manager.select("routers", "alpha")
    assert f"router name {claimed}" in str(err.value)


def test_aliases_must_be_names():
    with pytest.raises(ValueError, match="aliases must be a tuple of names"):
        Router(name="ok", make=print, aliases="single-string")
    with pytest.raises(ValueError, match="aliases must be a tuple of names"):
        Router(name="ok", make=print, aliases=("Not A Name",))


def test_autoload_can_be_switched_off(fake_distribution, monkeypatch):
    from prime_core.plugins import PluginManager

    fake_distribution("prime-plugin-first", entry_points={"first": "first_router"}, files={"first_router.py": GOOD})
    monkeypatch.setenv("PRIME_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert PluginManager().load().records == {}


def test_cli_warns_once_about_a_failed_plugin_and_goes_on(fake_distribution, capsys):
    from prime_core.cli.app import main

    fake_distribution("prime-plugin-broken", entry_points={"broken": "broken_mod"},
                      files={"broken_mod.py": "raise ImportError('libcuda.so.1 not found')\n"})
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show", "--format", "json", "--max-steps", "2"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0
    assert json.loads(captured.out)["max_steps"] == 2
    assert captured.err.count("plugin 'broken' (prime-plugin-broken 1.0.0) failed to load") == 1
    assert "libcuda.so.1 not found" in captured.err
