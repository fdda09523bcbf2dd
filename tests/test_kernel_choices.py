"""``prime config validate`` checks ``trainer.model.kernels``: every op's choice must be a
registered kernel that can run here."""

import json

from prime_core import PLUGIN_API_VERSION, hookimpl
from prime_core.specs import Kernel


class Kernels:
    PRIME_PLUGIN_API = PLUGIN_API_VERSION

    @hookimpl
    def prime_kernels(self):
        return [Kernel(op="swiglu", name="mine", impl=lambda gate, up: gate * up),
                Kernel(op="rmsnorm", name="gpu_only", impl=lambda x, w, eps: x, available=lambda: "needs a GPU")]


def test_kernel_choices_are_checked(register_plugin):
    from prime_core.cli.common import load_config
    from prime_core.config.checks import check

    register_plugin(Kernels(), name="kernels")
    chosen = {"swiglu": "mine", "rmsnorm": "gpu_only", "rope": "mne"}
    for root, key in (("rl", "trainer.model"), ("trainer", "model"), ("sft", "model")):
        config = load_config(root, [f"--{key}.kernels", json.dumps(chosen)])
        problems = [p for p in check(config, root) if ".kernels." in p]
        assert len(problems) == 2, problems
        assert problems[0].startswith(f"{key}.kernels.rmsnorm = 'gpu_only': the kernel 'rmsnorm:gpu_only'")
        assert problems[0].endswith("cannot run here: needs a GPU")
        assert problems[1].startswith(f"{key}.kernels.rope = 'mne': no installed plugin provides a kernel named "
                                      "'rope:mne'")
