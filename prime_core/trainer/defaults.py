"""Fast by default: ``trainer.model`` keys left at ``auto`` (or unset) are decided when the
trainer starts, by the plugins that own them (``prime_trainer_defaults``), for the device the
run computes on.

A plugin answers for its own keys only, and only while the user left them undecided; a value
the user wrote always wins. On a GPU in bf16/fp16 the first-party plugins pick the fast paths
that compute the same numbers (the native model, torch's fused attention kernels, the chunked
LM head for RL, ``torch.compile`` where it is verified); on a CPU, or in float32, they leave
everything as it was. The trainer prints what was picked, and why, in its first lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prime_core.errors import PluginError


@dataclass(frozen=True)
class Choice:
    """``trainer.model.<key> = value``, picked because of ``reason`` (a few words)."""

    key: str
    value: Any
    reason: str
    plugin: str = ""

    def shown(self) -> str:
        value = self.value
        if hasattr(value, "model_dump"):
            value = value.model_dump() or "on"
        return f"{self.key} = {value!r} ({self.reason})"


@dataclass(frozen=True)
class Context:
    """What a plugin decides from, besides ``trainer.model``."""

    device: str
    """``cuda`` or ``cpu``: where the trainer computes."""
    role: str
    """``trainer`` (RL) or ``sft``."""
    impl: str
    """The model implementation ``trainer.model.impl`` resolved to."""
    dtype: str = "bfloat16"
    """``trainer.model.dtype``: the compute dtype."""
    processes: int = 1
    hf_config: Any = None
    """The checkpoint's Hugging Face config (a kernel may take only some head dims, say)."""
    planning: bool = False
    """``prime plan`` (and ``prime run`` before it launches): decide without touching the GPU,
    which would leave a CUDA context in the launching process; assume what a current GPU has."""

    @property
    def fast(self) -> bool:
        """Where the fast paths apply: a GPU computing in bf16 or fp16 (float32 runs are for
        checking numbers; they keep the reference paths)."""
        return self.device == "cuda" and self.dtype in ("bfloat16", "float16")


def resolve(model_config, manager, context: Context) -> tuple[Any, list[Choice]]:
    """``model_config`` with every plugin's choices applied, and the choices (in plugin
    order). Two plugins choosing one key is refused, naming both."""
    choices: dict[str, Choice] = {}
    for impl in manager.pm.hook.prime_trainer_defaults.get_hookimpls():
        kwargs = {"model_config": model_config, "context": context}
        for choice in impl.function(*[kwargs[a] for a in impl.argnames]) or ():
            choice = Choice(choice.key, choice.value, choice.reason, impl.plugin_name)
            if choice.key in choices:
                raise PluginError(f"plugins '{choices[choice.key].plugin}' and '{choice.plugin}' both choose "
                                  f"trainer.model.{choice.key}",
                                  hint="disable one of them (--disable-plugin NAME) or set the key yourself")
            choices[choice.key] = choice
    if not choices:
        return model_config, []
    return model_config.model_copy(update={key: c.value for key, c in choices.items()}), list(choices.values())


def impl_choice(model_config, impl_name: str) -> Choice | None:
    """The core's own ``auto``: the model implementation (``resolve_impl``)."""
    if model_config.impl != "auto":
        return None
    return Choice("impl", impl_name, "auto: the highest-priority implementation that supports the checkpoint",
                  "prime-core")


def announce(choices: list[Choice], context: Context) -> str:
    """The line the trainer prints first."""
    where = f"{context.device}, {context.processes} process(es)"
    if not choices:
        return f"trainer defaults ({where}): nothing to decide (every performance key is set or has no fast path here)"
    return (f"trainer defaults ({where}; set a key in trainer.model to override): "
            + "; ".join(choice.shown() for choice in choices))
