"""Every hook a prime plugin can implement.

A plugin is a module (or object) registered under the entry-point group ``prime.plugins``
that defines functions named like the specs below, decorated with ``prime_core.hookimpl``.
An implementation may take any subset of a spec's arguments; calls are keyword-only.

Two kinds of hooks:

- **Registries** (``prime_<plural noun>``) return an iterable of typed specs from
  ``prime_core.specs``. The core gathers them, refuses duplicate names (naming both
  providers), and selects one *by the name in the config*. They are called once per process,
  lazily, when something first needs that registry.
- **Lifecycle hooks** (``prime_configure``, ``prime_validate_config``, ``prime_on_*``) run
  per run, per step or per event: never per layer or per token.

The full guide with examples is ``docs/plugins.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prime_core import hookspec
from prime_core.specs import (
    Algorithm,
    CliCommand,
    ConfigSection,
    Environment,
    EPBackend,
    InferenceBackend,
    Kernel,
    Launcher,
    ModelImpl,
    Monitor,
    ParallelStrategy,
    Router,
    ToolParser,
    WeightTransport,
)

# --------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------


@hookspec
def prime_config_sections() -> Iterable[ConfigSection]:
    """Add the plugin's own keys and tables to the config schema.

    Called when a config is loaded or validated (``prime run``, ``prime config ...``, every
    role). Returns ``ConfigSection`` objects; the core mounts each model at its dotted path
    (or, with ``merge=True``, adds its keys and validators to the section there) and validates
    the user's keys against it (unknown keys refused as everywhere else). Give the model as a
    lazy ``"module:Class"`` reference so importing the plugin stays cheap.

    Example::

        @hookimpl
        def prime_config_sections():
            return [ConfigSection(name="slurm", model="prime_plugin_slurm.config:SlurmConfig",
                                  roots=("rl", "sft")),
                    ConfigSection(name="trainer.model", model="prime_plugin_ep.config:EPKeys",
                                  merge=True, roots=("rl", "sft"))]
    """


@hookspec
def prime_model_impls() -> Iterable[ModelImpl]:
    """Provide model implementations selected by ``trainer.model.impl``.

    Called when the trainer builds its model, and by ``prime plugins list``.

    Example::

        @hookimpl
        def prime_model_impls():
            return [ModelImpl(name="hf", build=build_hf_model, supports=lambda cfg: True)]
    """


@hookspec
def prime_parallel_strategies() -> Iterable[ParallelStrategy]:
    """Provide steps of the trainer's build order (``fsdp``, ``ep``, ``cp``, LoRA, ...).

    Called when the trainer builds its model (every rank) and when a config is checked. Each
    strategy names its slot of ``prime_core.specs.SLOTS`` and decides from its own keys
    whether this run enables it; the core applies the enabled one of each slot in order.

    Example::

        @hookimpl
        def prime_parallel_strategies():
            return [ParallelStrategy(name="ep", slot="expert_parallel",
                                     apply="prime_plugin_ep.strategy:apply",
                                     enabled=lambda config, world: config.ep > 1,
                                     mesh_dims=("dp_mod_ep", "ep"),
                                     degrees=lambda config: {"ep": config.ep})]
    """


@hookspec
def prime_ep_backends() -> Iterable[EPBackend]:
    """Provide token dispatch/combine backends for expert parallelism.

    Selected by ``trainer.model.ep_comm_backend``; called when the EP strategy is applied.

    Example::

        @hookimpl
        def prime_ep_backends():
            return [EPBackend(name="deepep", make=make_deepep, available=deep_ep_missing)]
    """


@hookspec
def prime_kernels() -> Iterable[Kernel]:
    """Provide op implementations, registered as ``op:name``.

    Called when the trainer builds its model: the model implementation looks kernels up by op
    (``lm_head``, ``rmsnorm``, ``attention``, ``fp8_linear``). ``available()`` explains why a
    kernel cannot run here (no GPU, missing package); an explicit choice then fails with that
    reason and ``auto`` falls back.

    Example::

        @hookimpl
        def prime_kernels():
            return [Kernel(op="lm_head", name="fused", impl=FusedLMHead, available=needs_cuda)]
    """


@hookspec
def prime_inference_backends() -> Iterable[InferenceBackend]:
    """Provide inference engines: a server and the client the orchestrator samples through.

    Selected by ``inference.backend`` and ``orchestrator.client.backend`` (``auto``: the
    available backend with the highest ``priority``). Called by the ``inference`` role (to
    start the server), by the orchestrator (one client per replica URL: ``sample``,
    ``health``, ``load_weights``, ``close``) and by ``prime config validate``. The full call
    contract is the docstring of ``prime_core.specs.InferenceBackend``.

    Example::

        @hookimpl
        def prime_inference_backends():
            return [InferenceBackend(name="vllm", server="prime_plugin_vllm.server:VLLMServer",
                                     client="prime_plugin_vllm.client:VLLMClient", priority=10)]
    """


@hookspec
def prime_routers() -> Iterable[Router]:
    """Provide request routers across inference replicas (``round_robin``, ...).

    Selected by ``orchestrator.client.router``; called by the orchestrator when it starts.
    ``make(urls)`` returns an object whose ``pick(request, exclude) -> url`` chooses a replica
    for a ``SampleRequest`` (never one in ``exclude``: down, or already failed for this
    request) and whose ``done(url, ok=..., latency=...)`` is called after every request,
    successful or not (``prime_core.specs.Router``).

    Example::

        @hookimpl
        def prime_routers():
            return [Router(name="round_robin", make=RoundRobin)]
    """


@hookspec
def prime_launchers() -> Iterable[Launcher]:
    """Provide launchers that turn a resolved config into processes (or a script).

    Called by ``prime run``, ``prime sft`` and ``prime inference`` (typed by a user; in a
    process a launcher started they run the role): the selected launcher's ``plan`` (it gets
    ``root`` = ``rl`` / ``sft`` / ``inference``) is written by ``--dry-run``, and its
    ``launch`` starts the roles otherwise.

    Example::

        @hookimpl
        def prime_launchers():
            return [Launcher(name="local", plan=plan_local, launch=run_local)]
    """


@hookspec
def prime_environments() -> Iterable[Environment]:
    """Provide RL environments (tasks and a rubric), selected by ``orchestrator.env[].id``.

    Called when the orchestrator starts, and by ``prime config validate``.

    Example::

        @hookimpl
        def prime_environments():
            return [Environment(name="reverse_text", load=load_reverse_text)]
    """


@hookspec
def prime_tool_parsers() -> Iterable[ToolParser]:
    """Provide tool-call parsers, selected by ``orchestrator.rollout.tool_parser`` (``hermes``).

    Called when the orchestrator (or ``prime eval``) starts; the parser reads the tool calls
    of every model turn of environments with tools, in training and eval alike. The call
    contract is the docstring of ``prime_core.specs.ToolParser``.

    Example::

        @hookimpl
        def prime_tool_parsers():
            return [ToolParser(name="hermes", parse="prime_core.orchestrator.hermes:parse",
                               format="prime_core.orchestrator.hermes:format_calls")]
    """


@hookspec
def prime_weight_transports() -> Iterable[WeightTransport]:
    """Provide ways to publish trainer weights and load them for inference.

    Selected by ``weight_broadcast.type`` (``filesystem``, the core's; ``nccl``,
    prime-plugin-vllm's broadcast over a process group); called when the trainer and the
    orchestrator start. A transport whose trainer waits for inference to take each version
    sets ``loads_every_version``.

    Example::

        @hookimpl
        def prime_weight_transports():
            return [WeightTransport(name="filesystem", publisher=FsPublisher, loader=FsLoader)]
    """


@hookspec
def prime_algorithms() -> Iterable[Algorithm]:
    """Provide advantage estimators and losses, registered as ``kind:name``.

    Selected by ``orchestrator.advantage.type`` and ``trainer.loss.type``; called when the
    orchestrator and the trainer start.

    Example::

        @hookimpl
        def prime_algorithms():
            return [Algorithm(name="grpo", kind="advantage", fn=grpo_advantages)]
    """


@hookspec
def prime_monitors() -> Iterable[Monitor]:
    """Provide metric sinks (``jsonl``, ``wandb``, ...).

    Called by each role that logs metrics (trainer rank 0, orchestrator, sft rank 0) when it
    starts. A monitor runs when the config lists it (``monitors = ["jsonl", "NAME"]``) or when
    its plugin's top-level table ``[NAME]`` is present; ``jsonl`` always runs.

    Example::

        @hookimpl
        def prime_monitors():
            return [Monitor(name="wandb", make="prime_plugin_wandb.monitor:WandbMonitor",
                            available=wandb_missing)]
    """


@hookspec
def prime_cli_commands() -> Iterable[CliCommand]:
    """Add subcommands to ``prime``.

    Called once when the CLI is built. A command whose path clashes with a built-in or
    another plugin's is skipped and reported by ``prime plugins list``.

    Example::

        import typer
        logs = typer.Typer(help="SLURM helpers")

        @hookimpl
        def prime_cli_commands():
            return [CliCommand(name="slurm", app=logs)]
    """


# --------------------------------------------------------------------------------------
# Resolvers (the first non-None answer wins)
# --------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def prime_select_launcher(config: Any) -> str | None:
    """Choose the launcher when the config says ``launcher = "auto"`` (the default).

    Called by ``prime run``, ``prime sft`` and ``prime inference`` with the validated root
    config (an ``RLConfig``, ``SFTConfig`` or ``InferenceConfig``). Return a launcher name,
    or ``None`` to let another plugin decide. The local launcher answers last.

    Example::

        @hookimpl
        def prime_select_launcher(config):
            return "slurm" if getattr(config, "slurm", None) is not None else None
    """


@hookspec
def prime_trainer_defaults(model_config: Any, context: Any) -> Iterable[Any] | None:
    """Decide this plugin's ``trainer.model`` keys that the user left undecided (``auto``, or
    unset), for the device the trainer computes on: fast by default.

    Called once per trainer process when the policy is built (and by ``prime plan``), before
    any strategy is enabled, with the validated ``trainer.model`` section (``impl`` resolved)
    and a ``prime_core.trainer.defaults.Context`` (``device``, ``role``, ``impl``, ``dtype``,
    ``processes``, ``fast``). Return ``prime_core.trainer.defaults.Choice(key, value, reason)``
    items for keys this plugin owns; the trainer applies them and prints them with their
    reasons. Never choose a key the user set, and choose only what computes the same numbers
    (or what the user would expect of a default); two plugins choosing one key is refused.

    Example::

        @hookimpl
        def prime_trainer_defaults(model_config, context):
            if context.fast and model_config.widget == "auto":
                yield Choice("widget", "fused", "a GPU in bf16: the fused widget kernel")
    """


# --------------------------------------------------------------------------------------
# Lifecycle
# --------------------------------------------------------------------------------------


@hookspec
def prime_validate_config(config: Any, root: str, here: bool) -> Iterable[str] | None:
    """Check a validated config for problems the schema cannot express.

    Called after schema validation, for every root (``rl``, ``sft``, ``trainer``, ...).
    ``here``: the roles run on this machine (``False`` when the launcher is ``remote``, e.g. a
    cluster scheduler's): only then do checks of this machine's hardware apply. An
    implementation may leave out parameters it does not use.
    Return messages of the form ``"key.path: what is wrong and how to fix it"``; the core
    reports all of them at once (from every plugin) and exits with code 2, each dotted key a
    message names followed by the file that set it (``key.path (from rl.toml): ...``).

    Example::

        @hookimpl
        def prime_validate_config(config, root):
            m = config.trainer.model
            if m.ep > 1 and m.num_experts % m.ep:
                yield f"trainer.model.ep: {m.ep} must divide num_experts ({m.num_experts})"
    """


@hookspec
def prime_services(config: Any, root: str, configs: dict[str, Any]) -> Iterable[Any] | None:
    """Add long-running processes to a launch, beside the roles (a router in front of the
    inference replicas).

    Called by the launchers that start processes on this machine (``local``, ``torchrun`` on
    node 0) when they plan, with the validated root config, the root (``rl``, ``inference``)
    and the resolved config files by role (``configs["inference"]``: the file of every
    replica, ``prime_core.inference.replicas``). Return ``prime_core.launch.plan.RoleProcess``
    objects with ``service=True``: started after the inference replicas and before the
    orchestrator, logged under ``output_dir/logs``, stopped with the run; one that exits ends
    the run. A launcher that cannot start them refuses the run, naming them.

    Example::

        @hookimpl
        def prime_services(config, root, configs):
            if root == "rl" and getattr(config.inference, "router", None) is not None:
                return [RoleProcess(role="router", command=[...], config=configs["inference"],
                                    log=config.output_dir / "logs" / "router.log", service=True)]
    """


@hookspec
def prime_configure(config: Any, role: str) -> None:
    """Called once per process when a role starts, with its validated config.

    ``role`` is ``run``, ``trainer``, ``orchestrator``, ``inference`` or ``sft``. Use it to
    set process-wide state (environment variables, logging) before any work happens.

    Example::

        @hookimpl
        def prime_configure(config, role):
            if role == "trainer":
                os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    """


@hookspec
def prime_on_step_end(step: int, metrics: dict[str, float | int | str], role: str) -> None:
    """Called after each training (``trainer``, ``sft``) or orchestration step, in the process
    that logged it (trainer and sft: rank 0), after the monitors.

    ``metrics`` is flat: numbers and strings only; nested values are flattened to
    ``"outer/inner"`` keys (``env_rewards/reverse_text``). An exception stops the role.

    Example::

        @hookimpl
        def prime_on_step_end(step, metrics, role):
            if metrics.get("loss") != metrics.get("loss"):
                raise RuntimeError(f"loss is NaN at step {step}")
    """


@hookspec
def prime_on_weights_published(step: int, path: str) -> None:
    """Called by the trainer after the weights of ``step`` are complete under ``path``.

    Example::

        @hookimpl
        def prime_on_weights_published(step, path):
            print(f"policy v{step} ready at {path}")
    """


@hookspec
def prime_on_checkpoint(step: int, path: str) -> None:
    """Called after a checkpoint of ``step`` has been written completely to ``path``.

    Example::

        @hookimpl
        def prime_on_checkpoint(step, path):
            upload_async(path)
    """
