"""The transformers backend meets prime's inference-backend contract against its real server
(transformers' continuous batching on a tiny random Qwen3, started once for the class)."""

from prime_core.testing.contracts.inference_backend import InferenceBackendContract


class TestTransformersBackend(InferenceBackendContract):
    name = "transformers"
    plugin = "prime_plugin_transformers.plugin"
    server_args = ["--model.dtype", "float32"]
    startup_timeout = 120.0
