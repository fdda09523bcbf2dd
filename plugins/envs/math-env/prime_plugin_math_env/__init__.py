"""prime-plugin-math-env: prime-rl's ``math-env`` (math problems from a datasets dataset,
answers checked with math-verify)."""
