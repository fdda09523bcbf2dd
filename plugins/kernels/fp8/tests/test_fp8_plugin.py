"""prime-plugin-fp8 loads through its entry point and claims nothing it cannot do yet."""

from prime_core import PLUGIN_API_VERSION
from prime_core.plugins import PluginManager

import prime_plugin_fp8.plugin as plugin


def test_declares_the_plugin_api():
    assert plugin.PRIME_PLUGIN_API == PLUGIN_API_VERSION


def test_loads_as_active_and_provides_nothing_yet():
    manager = PluginManager(autoload=True, disabled=()).load()
    record = manager.records["fp8"]
    assert (record.status, record.dist) == ("active", "prime-plugin-fp8")
    assert manager.provided_by(record) == {}
