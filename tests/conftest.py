pytest_plugins = ["prime_core.testing"]

