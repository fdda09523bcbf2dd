"""The typed objects that registry hooks return.

Every registry hook (``prime_launchers``, ``prime_kernels``, ...) returns an iterable of one
of the frozen dataclasses below. The core collects them per registry, refuses two providers
of one key (naming both), and selects by the name the config asks for. Plugins never see
each other's specs and registration order never changes which one is used.

Callables (and objects such as a state-dict adapter) may be given as a lazy reference,
``"package.module:attribute"``: the core imports it the first time the field is read, so a
plugin's registration module stays cheap to import and needs no wrapper functions::

    ParallelStrategy(name="ep", apply="prime_plugin_ep.strategy:apply", ...)

All specs share four fields:

- ``name``: what the config selects (``launcher = "slurm"``), lower-case.
- ``description``: one line, shown by ``prime plugins list``.
- ``available``: optional zero-argument callable returning ``None`` when the capability can
  run here, or a human-readable reason when it cannot ("deep_ep is not installed:
  pip install ..."). It must be cheap and must not initialise CUDA eagerly. An explicit
  selection of an unavailable spec fails with that reason; ``auto`` selections skip it.
- ``aliases``: other names the config may select it by (another project's spelling, such as
  prime-rl's ``reverse-text`` for ``reverse_text``). The core resolves an alias to the name
  wherever it selects, and refuses an alias that is also a name or another spec's alias, as it
  refuses two providers of one name.

This module imports nothing heavy: the CLI and every plugin import it.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.:\-]*$")
Ref = Callable[..., Any] | str
"""A callable, or a lazy ``"module:attribute"`` reference to one."""

_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def ref(default: Any = ..., **kwargs: Any) -> Any:
    """A spec field that takes a value or a lazy ``"module:attribute"`` reference."""
    if default is not ...:
        kwargs["default"] = default
    return field(metadata={"ref": True}, **kwargs)


def import_ref(reference: str) -> Any:
    """The object ``"package.module:attr.sub"`` names (imported now)."""
    from prime_core.errors import PluginError

    module_name, _, attr = reference.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"cannot load {reference!r}: {type(exc).__name__}: {exc}",
                          hint="the plugin registers a reference to something that does not exist; "
                               "reinstall or fix the plugin") from None
    return obj


@functools.cache
def _ref_fields(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls) if f.metadata.get("ref"))


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str
    description: str = ""
    available: Callable[[], str | None] | str | None = ref(None, compare=False, repr=False)
    aliases: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not (_NAME.match(self.name) or self._root_name()):
            raise ValueError(
                f"{type(self).__name__} name {self.name!r} is invalid: use lower-case letters, "
                "digits, '_', '-', '.' or ':'"
            )
        if isinstance(self.aliases, str) or any(not isinstance(a, str) or not _NAME.match(a) for a in self.aliases):
            raise ValueError(f"{type(self).__name__} '{self.name}': aliases must be a tuple of names (lower-case "
                             f"letters, digits, '_', '-', '.' or ':'), got {self.aliases!r}")
        for name in _ref_fields(type(self)):
            value = object.__getattribute__(self, name)
            if isinstance(value, str) and not _REF.match(value):
                raise ValueError(f"{type(self).__name__} '{self.name}': {name} = {value!r} is not a reference "
                                 "of the form 'package.module:attribute'")

    def _root_name(self) -> bool:
        return False

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if isinstance(value, str) and name in _ref_fields(type(self)):
            value = import_ref(value)
            object.__setattr__(self, name, value)  # resolved once; frozen for everyone else
        return value

    @property
    def key(self) -> str:
        """The name this spec is registered and selected under."""
        return self.name

    @property
    def alias_keys(self) -> tuple[str, ...]:
        """The keys its ``aliases`` select it by (formed like ``key``)."""
        return tuple(self.aliases)

    @property
    def checks_availability(self) -> bool:
        """Whether the spec has an ``available`` check (without importing a lazy one)."""
        return object.__getattribute__(self, "available") is not None

    def unavailable_reason(self) -> str | None:
        """``None`` when usable here, else why not (errors in the check count as reasons)."""
        try:
            check = self.available
            return None if check is None else check()
        except Exception as exc:  # a broken check must not take the CLI down
            return f"availability check raised {type(exc).__name__}: {exc}"


@dataclass(frozen=True, kw_only=True)
class ConfigSection(Spec):
    """A pydantic model a plugin adds to the config schema (derive it from
    ``prime_core.config.base.Section``; ``model`` may be a lazy ``"module:Class"`` reference).

    - ``name`` is the dotted path where the model mounts, relative to each root in ``roots``
      (``"slurm"``, ``"trainer.model.lora"``). Roots: ``rl`` (``prime run``), ``sft``,
      ``trainer``, ``orchestrator``, ``inference``.
    - A path under a role (``trainer.``, ``orchestrator.``, ``inference.``) of the ``rl`` root
      also applies to that role's standalone config; under ``trainer.`` it applies to ``sft``
      too when ``sft`` is in ``roots`` (an SFT config has the trainer's ``model``, ``optim``,
      ... at its top level).
    - ``merge=True`` adds the model's fields *and validators* to the existing section at
      ``name`` instead (``name="trainer.model"`` adds keys such as ``ep`` next to the core's
      own; a validator sees the whole section). ``name=""`` merges into the root config itself
      (validators that relate several sections).
    - ``roles``: for a top-level section, the role configs that get it too (``("trainer",
      "orchestrator")`` for a monitor's table). In an RL config the top-level table is copied
      into each of those roles' configs, where a role's own table wins key by key.
    """

    model: Any = ref()
    roots: tuple[str, ...] = ("rl",)
    merge: bool = False
    roles: tuple[str, ...] = ()

    def _root_name(self) -> bool:
        return self.name == "" and self.merge

    @property
    def key(self) -> str:
        # Several plugins may add fields to one section; clashing fields are refused per key.
        return f"{self.name}+{self.model.__module__}.{self.model.__qualname__}" if self.merge else self.name


@dataclass(frozen=True, kw_only=True)
class ModelImpl(Spec):
    """Builds a model for the trainer.

    ``build(model_config, *, device)`` (``trainer.model``; ``"cpu"`` with the weights of
    ``model_config.name``, or ``"meta"``) returns an ``nn.Module``; ``supports(hf_config)``
    tells whether ``impl = "auto"`` may pick this implementation for a checkpoint;
    ``state_dict_adapter`` converts the state dict to and from Hugging Face tensor names
    (``to_hf`` / ``from_hf``; ``None`` when the module uses them, or its ``save_pretrained``
    converts them as transformers models do). The contract: ``contracts.model_impl``.
    """

    build: Ref = ref()
    supports: Callable[[Any], bool] | str | None = ref(None, compare=False)
    state_dict_adapter: Any = ref(None, compare=False)
    priority: int = 0  # among implementations that support a checkpoint, "auto" takes the highest
    memory: Callable[..., Any] | str | None = ref(None, compare=False)
    """``memory(model, model_config) -> list[prime_core.memory.BlockProfile]``: what each
    transformer block of ``model`` (built on the meta device) keeps for its backward pass per
    token (``prime plan``); without it the plan counts every block as a transformers decoder
    block."""


SLOTS = ("lm_head", "adapters", "quantization", "expert_parallel", "context_parallel", "checkpointing",
         "activation_offloading", "compilation", "data_parallel")
"""The trainer's build order: after the model implementation builds the model, the enabled
strategy of each slot is applied in this order; then the weights are loaded (or broadcast
from rank 0) and the optimizer is built."""


@dataclass(frozen=True, kw_only=True)
class ParallelStrategy(Spec):
    """One step of the trainer's build order (``SLOTS``), owned by its plugin.

    - ``slot``: where it runs. At most one enabled strategy per slot.
    - ``enabled(config, world) -> bool``: whether this run uses it, decided from the
      strategy's own keys of ``trainer.model`` (``config``) and the ``World`` (rank, size,
      device). Called once per build, on every rank.
    - ``apply(model, *, mesh, config, world)``: returns the model, or an ``Applied`` when the
      strategy also decides what is published or acts on the gradients before each optimizer
      step. Runs on every rank, in the trainer process.
    - ``mesh_dims``: the device-mesh dimensions it needs; the core passes that mesh as
      ``mesh`` (``None`` when empty): ``("dp_replicate", "dp_shard")`` the data-parallel mesh
      (1-D ``("dp_shard",)`` without replicas), ``("D",)`` the 1-D mesh of a degree ``D``,
      ``("dp_mod_D", "D")`` the 2-D mesh of ``D`` groups and their replicas.
    - ``degrees(config) -> {dim: size}``: the mesh dimensions it adds, each a key of
      ``trainer.model`` named like the dimension (``{"ep": config.ep}``); sizes must divide the
      trainer processes. ``ParallelDims`` builds every mesh once from all of them.
    - ``splits_rows``: the ranks of its last mesh dimension split each packed row's tokens
      (context parallelism): the core hands every rank its part of every row.
    - ``reference``: the strategy changes what the model computes (LoRA, FP8, the LM head
      implementation), so single-process parity references apply it too.
    - ``memory``: its terms of the predicted peak memory (``prime plan``; below).

    The ``data_parallel`` slot is special in three ways: it is required with more than one
    trainer process; when it is enabled the model is built in ``optimization_dtype`` (the
    strategy computes in ``dtype``: mixed precision) and placed on the devices by the
    strategy; otherwise the core moves the model to the device. Parameters an earlier
    strategy turned into DTensors on the 1-D mesh of its degree ``D`` (EP's experts on
    ``ep``) are sharded by the data-parallel strategy over ``dp_mod_D`` (the other ranks);
    their gradients must then hold the contributions of the whole ``D`` group (EP's dispatch
    brings them back), and data parallelism sums them over ``dp_mod_D`` and divides by the
    world size, as it averages every other gradient.
    """

    slot: str
    apply: Ref = ref()
    enabled: Ref = ref()
    mesh_dims: tuple[str, ...] = ()
    degrees: Callable[[Any], dict[str, int]] | str | None = ref(None, compare=False)
    splits_rows: bool = False
    reference: bool = False
    memory: Callable[..., Any] | str | None = ref(None, compare=False)
    """``memory(estimate, config)``: what the strategy changes in a run's predicted GPU memory
    (``prime plan``), on a ``prime_core.memory.Estimate`` of the model built on the meta
    device, called in build order (shard the states, split the tokens, replace the
    activations by rules, add buffers). Without it the plan says the strategy is not
    counted."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slot not in SLOTS:
            raise ValueError(f"ParallelStrategy '{self.name}': slot {self.slot!r} is not one of {', '.join(SLOTS)}")


@dataclass(frozen=True)
class Applied:
    """What ``ParallelStrategy.apply`` returns when more than the model comes back."""

    model: Any
    exporter: Callable[..., Any] | None = None
    """``exporter(model, world)``: what rank 0 publishes instead of the full weights (LoRA's
    ``prime_core.weights.Adapter``); ``None`` elsewhere. Collective."""
    before_step: Callable[..., Any] | None = None
    """``before_step(model)``: called on every rank after the step's backward passes and
    before gradient clipping (EP: reduce expert gradients across data-parallel replicas)."""
    before_backward: Callable[..., Any] | None = None
    """``before_backward(model, last)``: called on every rank before each backward pass of a
    step; ``last`` is true for the step's last one, after which the gradients are final (as
    FSDP2's ``set_is_last_backward``): work on them can start while that pass still runs."""
    update: Callable[..., Any] | None = None
    """``update(model, optimizer, max_norm)``: called on every rank after the ``before_step``
    hooks, in place of the trainer's gradient clipping and ``optimizer.step()``. It clips and
    steps itself and returns the norm before clipping (a tensor), or returns ``None`` once the
    gradients are in ``param.grad``, for the trainer to clip and step. For a strategy that
    holds the gradients elsewhere and can fuse the update (one-process mixed precision)."""
    param_device: str | None = None
    """Where the strategy keeps the parameters when that is not the compute device (``"cpu"``
    for CPU offloading): ranks that built the model on the meta device get their shards there."""


@dataclass(frozen=True, kw_only=True)
class EPBackend(Spec):
    """Token dispatch/combine for expert parallelism (``trainer.model.ep_comm_backend``).

    ``make(group, *, num_experts, config)`` (``group``: the EP process group, whose rank r
    owns experts ``[r * E_local, (r + 1) * E_local)``; ``config``: ``trainer.model``) returns a
    dispatcher with

    - ``dispatch(x [T, H], topk_idx [T, k] int64, topk_weight [T, k] float32)`` ->
      ``(x_local [N, H], counts [E_local] int64, handle)``: the token copies routed to this
      rank's experts, grouped by local expert in ascending order, and how many each got;
    - ``combine(y_local [N, H], handle)`` -> ``[T, H]``: for every token, the sum over its k
      choices of ``topk_weight`` times that expert's output.

    Both are differentiable (in ``x``, ``y_local`` and ``topk_weight``) and collective over
    ``group``. The contract tests in ``prime_plugin_ep.contract`` check any backend.
    """

    make: Ref = ref()


@dataclass(frozen=True, kw_only=True)
class Kernel(Spec):
    """An implementation of an op the model looks up by name (``lm_head``, ``rmsnorm``, ...).

    Registered under ``op:name`` (``lm_head:fused``); ``impl`` is the callable or module
    class; ``reference`` names the eager implementation it is checked against.
    """

    op: str
    impl: Ref = ref()
    reference: str = ""

    @property
    def key(self) -> str:
        return f"{self.op}:{self.name}"

    @property
    def alias_keys(self) -> tuple[str, ...]:
        return tuple(f"{self.op}:{alias}" for alias in self.aliases)


@dataclass(frozen=True, kw_only=True)
class InferenceBackend(Spec):
    """An inference engine: the server the ``inference`` role runs, and the client the
    orchestrator samples and loads weights through. Selected by ``inference.backend`` and
    ``orchestrator.client.backend``; ``"auto"`` (the default of both) takes the backend with
    the highest ``priority`` among those whose ``available()`` passes (ties by name).

    ``server(config)`` is called in the ``inference`` role process (main thread) with that
    role's config, which describes ONE replica: ``parallel.dp`` is 1 there, because launchers
    start one ``prime inference`` process per replica (``prime_core.inference.replicas``). It
    returns the process manager the role drives: ``start()``; ``wait_healthy(timeout: float)``,
    raising ``PrimeError`` when the server dies or is not healthy in time; ``wait() -> int``,
    the server's exit code (negative: killed by that signal); ``stop()``, idempotent, also
    after a failed start; ``base_url: str`` and optionally ``log_path``.

    ``client(base_url: str, *, api_key: str | None, timeout: float)`` is called by the
    orchestrator once per replica URL of ``orchestrator.client.base_url``
    (``http://host:port/v1``, as the server's ``base_url``); ``api_key`` is the value of the
    variable ``orchestrator.client.api_key_var`` names (``None`` when unset) and ``timeout`` the
    seconds one request may take. Creating it must not contact the server. It returns an
    object with (``prime_core.inference.client.InferenceClient``):

    - ``health() -> bool``: a plain call from the orchestrator's main thread, polled about
      once a second before sampling starts; ``False`` while the server is unreachable or not
      ready (it does not raise for that), answered within a few seconds.
    - ``async sample(request: SampleRequest) -> list[Sample]``: ``request.n`` samples of the
      prompt (``prime_core.inference.client``: token ids in; token ids, their sampling
      log-probabilities, finish reason and text out), from the weights of the newest
      ``load_weights`` that returned (before any: those the server started with). Transient
      connection failures are the client's to retry; what remains is raised.
    - ``async load_weights(step: int, path: str) -> str | None``: serve the policy the trainer
      published for ``step`` in the folder ``path`` (on a filesystem the server shares): full
      Hugging Face weights, a PEFT LoRA adapter (``adapter_config.json`` in the folder), or
      what a weight transport the backend also provides leaves there instead (the ``nccl``
      transport's ``BROADCAST.json``: receive the tensors from the trainer's process group).
      How is the backend's business (a live reload; a new adapter name per step and unloading
      old adapters); requests already running may finish on the previous weights. A run from
      scratch calls it first with step 0 and the base model's folder (the server may serve an
      earlier run's policy): full weights, after which no adapter is served. Returns a
      few words for the log (``"LoRA adapter <name>"``), or ``None``.
    - ``async close()``: release connections; called once, last (also after errors).
    - optionally ``async prompt_logprobs(token_ids: list[int]) -> list[float]``: the
      log-probability of each of ``token_ids`` given the ones before it, under the served model
      at temperature 1 (no sampling: a prefill), one per token, ``0.0`` for the first (it has no
      context). A teacher's server is asked this for the student's tokens (on-policy
      distillation, ``orchestrator.training_mode = "opd"``); a backend without it cannot serve a
      teacher.
    - optionally ``async requests_served() -> float | None``: how many sampling requests the
      server answered since it started (``None``: unknown); with a router in front of the
      engines (``orchestrator.client.admin_base_url``), the orchestrator counts requests per
      engine with it.

    The coroutines are awaited on the orchestrator's one event loop (one thread):
    ``sample`` calls overlap each other and ``load_weights``; ``load_weights`` calls on one
    client never overlap. Blocking work belongs in a thread (``asyncio.to_thread``). Every
    failure is raised as ``prime_core.errors.PrimeError`` whose message names the server
    (its URL) and what failed, with a ``hint`` when the user can fix it; the orchestrator
    stops with that message. The orchestrator never sees request bodies, endpoints, model
    names or adapter names.
    """

    server: Ref = ref()
    client: Ref = ref()
    priority: int = 0
    """Rank for ``"auto"``: the highest available wins."""


@dataclass(frozen=True, kw_only=True)
class Router(Spec):
    """Spreads sampling requests over the inference replicas (``orchestrator.client.router``).

    ``make(urls: list[str])`` is called once by the orchestrator with the replica URLs of
    ``orchestrator.client.base_url``. The object it returns has

    - ``pick(request: SampleRequest, exclude: Collection[str] = ()) -> str``: one of ``urls``
      for this request, never one in ``exclude`` (``prime_core.inference.client.SampleRequest``;
      ``request.session_id`` names its trajectory, so that a router can keep a session on one
      replica). ``exclude`` holds the replicas the orchestrator found down and those this
      request already failed on (a failed request is retried on another replica); it never
      holds every URL.
    - ``done(url: str, *, ok: bool, latency: float) -> None``: called exactly once after every
      ``pick``, when that request finished: ``ok`` is ``False`` when it raised (or was
      cancelled), ``latency`` its wall-clock seconds.

    Both are plain calls on the orchestrator's event loop thread, so they must not block;
    requests are in flight between ``pick`` and ``done``, many at once. The contract suite is
    ``prime_core.testing.contracts.router``.
    """

    make: Ref = ref()


@dataclass(frozen=True, kw_only=True)
class Launcher(Spec):
    """Turns a resolved config into processes or a script.

    ``plan(config, *, output_dir, configs, root)`` returns a ``prime_core.launch.plan.LaunchPlan``:
    ``config`` is the validated root config, ``root`` is ``"rl"`` (``prime run``), ``"sft"`` or
    ``"inference"``, and ``configs`` maps ``root`` (and, for ``rl``, each role) to its resolved
    JSON file under ``output_dir/configs``. ``launch(plan)`` runs it and returns the exit code.
    """

    plan: Ref = ref()
    launch: Ref = ref()
    remote: bool = False
    """Its roles run on other machines (a cluster scheduler's): checks of this machine (its model
    cache, its hardware) do not apply (``prime_validate_config`` gets ``here = False``)."""


@dataclass(frozen=True, kw_only=True)
class Environment(Spec):
    """An RL environment: ``load(**args)`` returns an object with tasks and a rubric.

    ``args``: a pydantic model of ``load``'s keyword arguments, with which ``prime config
    validate`` checks ``orchestrator.env[i].args`` before anything starts (without it,
    ``load``'s signature is checked). A model that allows extra keys (``extra="allow"``)
    checks those itself, in its validators (arguments passed through to a library).
    ``aliases``: other ids ``orchestrator.env[i].id`` may use (prime-rl's spellings)."""

    load: Ref = ref()
    args: type | str | None = ref(None, compare=False)


@dataclass(frozen=True, kw_only=True)
class ToolParser(Spec):
    """Finds tool calls in the text of an assistant turn (``orchestrator.rollout.tool_parser``;
    the same parser in training and in eval).

    - ``parse(text: str) -> prime_core.orchestrator.tools.ParsedTurn``: the text outside the
      calls and the calls in order. Called on the orchestrator's event loop once per model turn
      of an environment that has tools: pure and quick, never raising; a call it cannot read
      is a ``ToolCall`` with ``error`` set (answered with an error turn).
    - ``format(calls: list[ToolCall]) -> str``: the text a model writes for ``calls`` (SFT data
      and tests); ``parse(format(calls))`` gives the calls back.
    """

    parse: Ref = ref()
    format: Ref = ref()


@dataclass(frozen=True, kw_only=True)
class WeightTransport(Spec):
    """Moves trainer weights to inference (``weight_broadcast.type``).

    ``publisher(config, output_dir=...)`` is used by the trainer (rank 0): its
    ``publish(model, step, state_dict)`` gets the model (for its config) and the full,
    unsharded tensors to publish (``None`` when the model itself holds them, a
    ``prime_core.weights.Adapter`` in LoRA runs). ``loader(config)`` is used by the
    orchestrator to find the newest published version.

    ``loads_every_version``: the trainer waits for inference to take each version it
    publishes (a broadcast over a process group): the orchestrator then loads the last
    version too (``max_steps``) before it exits, so that the trainer's last publish is met.

    ``publishes_in_background``: ``publish`` may run in a thread of its own while the trainer
    takes its next step (it reads only the tensors it is given and the model's config; the
    trainer hands it its own copy of them). The trainer then waits for one publish to finish
    before it starts the next, and for the last one before it exits.

    ``device_tensors``: ``publish`` gets the full tensors where the trainer holds them (its GPU),
    cast to the model's dtype, rather than host copies; it must copy what it keeps before it
    returns (some are the live parameters). For a transport that hands device memory to
    inference on the same machine.

    ``path`` in ``latest()`` is a Hugging Face folder for ``filesystem``; a transport may instead
    publish a folder that only its receivers read (a descriptor of where the tensors are).
    ``backends``: then the inference backends that read it (checked when a config is loaded);
    empty: any backend (the folder holds the weights as files).
    """

    publisher: Ref = ref()
    loader: Ref = ref()
    loads_every_version: bool = False
    publishes_in_background: bool = False
    device_tensors: bool = False
    backends: Sequence[str] = ()


@dataclass(frozen=True, kw_only=True)
class Algorithm(Spec):
    """An advantage estimator or a loss, selected by name (``orchestrator.advantage.type``,
    ``trainer.loss.type``)."""

    kind: Literal["advantage", "loss"]
    fn: Ref = ref()

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def alias_keys(self) -> tuple[str, ...]:
        return tuple(f"{self.kind}:{alias}" for alias in self.aliases)


@dataclass(frozen=True, kw_only=True)
class Monitor(Spec):
    """A metric sink. ``make(config, *, output_dir, role)`` returns an object with
    ``log(metrics: dict, step: int)`` and ``close()``."""

    make: Ref = ref()


@dataclass(frozen=True, kw_only=True)
class CliCommand(Spec):
    """An extra ``prime`` subcommand: a ``typer.Typer`` app (a group) or a plain function
    (one command). ``parent`` nests it under an existing group, e.g. ``("slurm",)``."""

    app: Any = ref()
    parent: Sequence[str] = ()
