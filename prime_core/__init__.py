"""prime-core: hook specifications, plugin manager, config and CLI of the prime framework.

Plugins import the two markers from here::

    from prime_core import hookimpl

    PRIME_PLUGIN_API = 1

    @hookimpl
    def prime_launchers():
        ...

Importing this package is cheap on purpose (pluggy only): the ``prime`` CLI and every
plugin import it, and ``prime --help`` must stay fast.
"""

from importlib.metadata import PackageNotFoundError, version

import pluggy

PROJECT = "prime"
ENTRY_POINT_GROUP = "prime.plugins"

# The plugin API this core speaks. A plugin declares the one it was built for in a module
# attribute ``PRIME_PLUGIN_API``; the core refuses plugins whose major version differs.
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

try:
    __version__ = version("prime-core")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["ENTRY_POINT_GROUP", "PLUGIN_API_VERSION", "PROJECT", "__version__", "hookimpl", "hookspec"]
