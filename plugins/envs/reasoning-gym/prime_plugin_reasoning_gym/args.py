"""The arguments of ``reasoning-gym``: which dataset, its seed and system prompt, and the
dataset's own settings, passed through. ``prime config validate`` checks all of them against
reasoning-gym itself (the dataset exists, each setting is a field of its config dataclass
with a value of the field's type, and the config's own ``validate()`` passes), importing
reasoning-gym only when an environment of this kind is configured."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import PrivateAttr, model_validator

from prime_core.config.base import Section
from prime_core.errors import did_you_mean


class ReasoningGymArgs(Section):
    """Every key other than these three is a setting of the chosen dataset's config
    (``min_numbers`` for ``countdown``, ``datasets`` for ``composite``, ``size``, ...)."""

    model_config = {**Section.model_config, "extra": "allow"}

    dataset: str = "countdown"
    """A dataset name of reasoning-gym (``reasoning_gym.factory.DATASETS``)."""
    seed: int = 0
    """The dataset's seed: which problems its indices hold. Fixed, so that every process and a
    resumed run see the same tasks."""
    system_prompt: str | None = "default"
    """A key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` (``default``, ``DeepSeekZero``, ``simple``,
    ``direct``, ``chain_of_draft``), another text to use as is, or ``""`` for no system turn.
    reasoning-gym's prompts ask for the answer in ``<answer>...</answer>``, which is where its
    scoring looks."""

    _built: tuple[type, Any] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _dataset_settings(self) -> ReasoningGymArgs:
        self._built = dataset_config(self.dataset, {"seed": self.seed, **(self.model_extra or {})})
        return self

    def build(self):
        """The dataset these arguments describe (a ``reasoning_gym`` ``ProceduralDataset``)."""
        dataset_cls, config = self._built
        return dataset_cls(config=config)


def dataset_config(name: str, settings: dict[str, Any]) -> tuple[type, Any]:
    """``(dataset class, validated config)`` for a reasoning-gym dataset, or a ``ValueError``
    naming the setting and what the dataset takes."""
    from pydantic import TypeAdapter, ValidationError
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"dataset: reasoning-gym has no dataset '{name}'{did_you_mean(name, DATASETS)}; "
                         f"available: {', '.join(sorted(DATASETS))}")
    dataset_cls, config_cls = DATASETS[name]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.init]
    unknown = [key for key in settings if key not in fields]
    if unknown:
        raise ValueError(f"{unknown[0]}: dataset '{name}' has no setting '{unknown[0]}'"
                         f"{did_you_mean(unknown[0], fields)}; it takes {', '.join(fields)}")
    try:
        config = TypeAdapter(config_cls).validate_python(settings)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r}) for dataset "
                                   f"'{name}'" for e in exc.errors())) from None
    for spec in getattr(config, "datasets", None) or [] if name == "composite" else []:
        # A composite's parts are datasets with settings of their own: check those too.
        dataset_config(spec.name, dict(spec.config))
    try:
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, ValueError, TypeError) as exc:
        raise ValueError(f"dataset '{name}' refuses its settings: {exc}") from None
    return dataset_cls, config
