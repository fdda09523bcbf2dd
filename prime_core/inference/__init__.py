"""The inference role (the server itself comes from an inference-backend plugin)."""
