"""prime-plugin-verifiers: verifiers (``verifiers.v1``) tasksets as prime environments."""
