"""Config of the orchestrator role (``prime orchestrator``), with prime-rl's key names."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from prime_core.config.base import Noted, Section, Selects
from prime_core.config.shared import CkptConfig, LogConfig, Monitors, TokenizerRef, WeightBroadcastConfig
from prime_core.inference.config import ApiKeyRef


class ClientConfig(ApiKeyRef):
    """How the orchestrator reaches the inference servers (through the backend's client)."""

    base_url: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000/v1"], min_length=1)
    """One URL per inference replica; a single string is accepted."""
    api_key_var: str = "OPENAI_API_KEY"
    """Environment variable holding the API key, if the servers need one (in ``prime run``: the
    inference server's ``api_key_var`` / ``api_key_file`` unless set here)."""
    timeout: float = Field(default=600.0, gt=0)
    """Seconds one request may take."""
    backend: Annotated[str, Selects("inference_backends", skip=("auto",))] = "auto"
    """What serves ``base_url``: its client samples and loads weights. ``auto``: the available
    backend with the highest priority (in ``prime run``: ``inference.backend`` when set)."""
    health_timeout: float = Field(default=600.0, gt=0,
                                  validation_alias=AliasChoices("health_timeout", "wait_for_ready_timeout"))
    """Seconds to wait for the servers to become healthy at start-up (prime-rl 0.6's
    ``wait_for_ready_timeout``)."""
    router: Annotated[str, Selects("routers")] = "round_robin"
    """Which replica each request goes to: ``round_robin``, ``least_outstanding``,
    ``consistent_hash`` (a rollout's turns on one replica), or a router plugin's."""
    admin_base_url: list[str] | None = Field(default=None, min_length=1)
    """One URL per inference engine for weight updates and health checks, when ``base_url`` is
    a router in front of them (admin calls bypass the router); unset: ``base_url``. A single
    string is accepted."""
    on_replica_failure: Literal["continue", "stop"] = "continue"
    """When a replica stops answering its health check: ``continue`` with the others (the
    orchestrator says so in its log, the metrics count the replicas up; with none left the run
    stops), or ``stop`` the run naming it. In ``prime run`` the launcher follows this too: a
    replica's process that dies ends the run only with ``stop``."""
    max_retries: int = Field(default=4, ge=0)
    """Tries after a failed request, each on another replica when one is up (behind a single
    URL, a router: the same URL after a pause of 1, 2, 4, 8 s, while it notices the dead
    engine); then the run stops with the error."""
    health_interval: float = Field(default=5.0, gt=0)
    """Seconds between health checks of every engine while the run goes on (one found down is
    checked again, and takes the current weights before it serves again)."""

    # prime-rl's client keys for parts prime does its own way.
    admin_base_url: Annotated[Any, Noted("prime sends weight updates to the servers of base_url")] = None
    router_url: Annotated[Any, Noted("prime's router is a plugin chosen by client.router, in front of base_url")
                          ] = None
    connect_timeout: Annotated[float | None, Noted("prime's requests wait as client.timeout says")] = None
    dp_rank_count: Annotated[int | None, Noted("prime counts replicas by their base_url entries")] = None
    elastic: Annotated[dict[str, Any] | None, Noted(
        "prime's inference servers are the fixed list of base_url (no elastic pool discovery)")] = None
    headers: Annotated[dict[str, str] | None, Noted("prime's client sends only the API key header")] = None
    headers_from_env: Annotated[dict[str, str] | None, Noted("prime's client sends only the API key header")] = None
    extra_headers_from_state: Annotated[Any, Noted("prime's client sends only the API key header")] = None
    skip_model_check: Annotated[bool, Noted("prime's client checks the servers' health at start")] = False

    @model_validator(mode="before")
    @classmethod
    def _one_url(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("base_url", "admin_base_url"):
                if isinstance(data.get(key), str):
                    data = {**data, key: [data[key]]}
        return data


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1,
                                   validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    """Most tokens per completion; unset = up to ``seq_len``."""
    seed: int | None = None

    extra_body: Annotated[dict[str, Any] | None, Noted(
        "prime's sampling client sends token ids with temperature, top_p, max_tokens and seed only")] = None
    min_tokens: Annotated[int | None, Noted("prime's sampling client sets no minimum length")] = None
    repetition_penalty: Annotated[float | None, Noted("prime samples without a repetition penalty")] = None
    temp_scheduler: Annotated[dict[str, Any] | None, Noted(
        "prime samples at one temperature (sampling.temperature) for the whole run")] = None


class EnvConfig(Section):
    """One environment (tasks + rubric) to train on."""

    id: Annotated[str, Selects("environments")]
    """An environment provided by a plugin (``prime plugins list``)."""
    name: str | None = None
    """Label used in metrics; defaults to ``id``."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's loader."""
    ratio: float | None = Field(default=None, gt=0)
    """Share of the groups drawn from this environment (set on every environment or none; none:
    the environments take turns)."""

    # prime-rl's per-environment keys for its environment servers.
    address: Annotated[str | None, Noted("prime runs environments inside the orchestrator (no env servers)")
                       ] = None
    num_workers: Annotated[Any, Noted("prime runs environments inside the orchestrator (no env servers)")] = None
    max_retries: Annotated[int | None, Noted(
        "a failing rollout fails its group in prime (counted, the group dropped); orchestrator.rollout."
        "max_failed_groups bounds failures in a row")] = None
    extra_env_kwargs: Annotated[dict[str, Any] | None, Noted("prime passes args alone to the environment")] = None
    state_columns: Annotated[list[str] | None, Noted("prime's rollouts keep token ids, logprobs and rewards")] = None
    timeout: Annotated[float | None, Noted("prime bounds tool calls (rollout.tool_timeout) and requests (client."
                                           "timeout), not whole rollouts")] = None
    max_total_completion_tokens: Annotated[int, Noted(
        "prime bounds a rollout's tokens with orchestrator.rollout.max_tokens", when=lambda v: v != -1)] = -1
    sampling: Annotated[dict[str, Any] | None, Noted(
        "prime samples every environment with orchestrator.sampling (no per-environment overrides)")] = None
    advantage: Annotated[dict[str, Any] | None, Noted(
        "prime computes every environment's advantages with orchestrator.advantage")] = None
    group_size: Annotated[int | None, Noted(
        "prime samples orchestrator.rollouts_per_example rollouts per example for every training environment")
    ] = None


class EvalEnvConfig(EnvConfig):
    """One environment to evaluate, with prime-rl's per-environment overrides."""

    num_examples: Annotated[int | None, Noted(
        "-1 (all examples): prime evaluates a fixed sample of eval.num_examples examples; set a number",
        when=lambda v: v == -1)] = Field(default=None, ge=-1)
    """Examples of this environment; unset: ``eval.num_examples``."""
    rollouts_per_example: int | None = Field(default=None, ge=1,
                                             validation_alias=AliasChoices("rollouts_per_example", "group_size"))
    """Rollouts per example (k); unset: ``eval.rollouts_per_example``."""
    interval: Annotated[int | None, Noted("prime evaluates every environment every eval.interval steps")] = None
    skip_first: Annotated[Any, Noted("prime evaluates every environment at the same steps")] = None


class RolloutConfig(Section):
    """Limits and tools of every episode (training and eval)."""

    max_turns: int = Field(default=8, ge=1)
    """Model turns per episode (a single-turn environment stops after one anyway)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one rollout: the policy's context (prompt, every turn so far and the
    next one) never grows past it; unset = ``seq_len``."""
    tool_timeout: float = Field(default=30.0, gt=0)
    """Seconds one tool call may take; a slower one is answered with an error turn."""
    tool_parser: Annotated[str, Selects("tool_parsers")] = "hermes"
    """How tool calls are read from the model's text (a ``prime_tool_parsers`` plugin)."""
    max_failed_groups: int = Field(default=50, ge=1)
    """Groups in a row whose rollouts raised before the orchestrator gives up (a broken
    environment fails every rollout; a flaky one only some, which are dropped and counted)."""


class EvalSamplingConfig(Section):
    """prime-rl's ``[orchestrator.eval.sampling]``."""

    temperature: float | None = Field(default=None, ge=0)
    """The eval temperature (``eval.temperature``)."""
    max_completion_tokens: Annotated[int | None, Noted(
        "eval turns are bounded as training's are (sampling.max_tokens, rollout.max_tokens)")] = Field(
        default=None, validation_alias=AliasChoices("max_completion_tokens", "max_tokens"))
    top_p: Annotated[float | None, Noted("eval samples with sampling.top_p")] = None
    top_k: Annotated[int | None, Noted("prime samples without top-k")] = None
    min_p: Annotated[float | None, Noted("prime samples without min-p")] = None
    reasoning_effort: Annotated[str | None, Noted("prime sends no reasoning-effort hint")] = None
    min_tokens: Annotated[int | None, Noted("prime's sampling client sets no minimum length")] = None
    repetition_penalty: Annotated[float | None, Noted("prime samples without a repetition penalty")] = None
    seed: Annotated[int | None, Noted("eval rollouts are drawn with eval.seed")] = None
    extra_body: Annotated[dict[str, Any] | None, Noted("prime's sampling client sends token ids and sampling "
                                                       "parameters only")] = None


class EvalConfig(Section):
    """Evaluation on a fixed set of examples, at step 0 and every ``interval`` steps."""

    interval: int = Field(default=100, ge=1)
    """Evaluate the policy of every step that is a multiple of this (and the first)."""
    env: list[EvalEnvConfig] = Field(default_factory=list)
    """The environments to evaluate; empty: those of ``orchestrator.env``."""
    num_examples: Annotated[int, Noted(
        "-1 (all examples): prime evaluates a fixed sample of 32 examples per environment; set a number",
        when=lambda v: v == -1)] = Field(default=32, ge=-1)
    """Examples per environment: the first ``num_examples`` tasks drawn with ``seed``."""
    rollouts_per_example: int = Field(default=4, ge=1,
                                      validation_alias=AliasChoices("rollouts_per_example", "k", "group_size"))
    """Rollouts per example (k of pass@k and avg@k)."""
    seed: int = 1234
    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature of eval rollouts; unset: ``sampling.temperature``."""
    max_concurrent: int = Field(default=32, ge=1)
    """Eval rollouts in flight at once, so that training's requests keep getting served."""
    skip_first_step: bool = False
    """Do not evaluate the initial policy (step 0)."""
    sampling: EvalSamplingConfig | None = None
    """prime-rl's eval sampling table: its ``temperature`` sets ``temperature``."""

    cancel_inflight_rollouts_on_eval: Annotated[bool, Noted(
        "prime keeps training rollouts in flight while it evaluates")] = False
    eval_base_model: Annotated[bool, Noted("prime evaluates the policy being trained (step 0 is the base model)")
                               ] = True
    skip_eval_on_resume: Annotated[bool, Noted("prime evaluates at the steps eval.interval names, resumed or not")
                                   ] = False
    max_retries: Annotated[int | None, Noted("a failing eval rollout scores 0 in prime, counted as env_errors")
                           ] = None
    num_workers: Annotated[Any, Noted("prime runs environments inside the orchestrator (no env servers)")] = None

    @model_validator(mode="after")
    def _sampling_temperature(self) -> EvalConfig:
        if self.sampling is not None and self.sampling.temperature is not None and self.temperature is None:
            self.temperature = self.sampling.temperature
        return self


class AdvantageConfig(Section):
    type: Annotated[str, Selects("algorithms", prefix="advantage:")] = "grpo"
    """An advantage estimator from a plugin; prime-rl's ``default`` is ``grpo`` (reward minus the group's mean)."""

    length_penalty: Annotated[dict[str, Any] | None, Noted(
        "prime's grpo advantage is the reward minus the group's mean, without a length penalty")] = None
    length_weighted_baseline: Annotated[bool, Noted(
        "prime's grpo baseline is the group's plain mean reward")] = False
    length_shaping_alpha: Annotated[float | None, Noted("prime's grpo advantage applies no length shaping")] = None
    import_path: Annotated[str | None, Noted(
        "custom advantages are plugins in prime (prime_algorithms, kind 'advantage'), selected by type")] = None
    kwargs: Annotated[dict[str, Any] | None, Noted("custom advantages are plugins in prime")] = None

    @field_validator("type", mode="before")
    @classmethod
    def _default_is_grpo(cls, value: Any) -> Any:
        return "grpo" if value == "default" else value


class BatchFilterConfig(Section):
    """A rollout filter of prime-rl (``[[orchestrator.pre_batch_filters]]``, ``post_batch_filters``,
    0.5's ``filters``): detected rollouts are counted (``filtered/<type>`` in the metrics) and,
    with ``enforce``, left out of the batch."""

    type: Literal["gibberish", "repetition", "zero_advantage"]
    """``gibberish``: a sampled token id above ``token_id_threshold`` at a log-probability below
    ``-ln(vocab) - logprob_offset``; ``repetition``: ``window`` tokens in a row sampled at a
    probability above ``prob_threshold``; ``zero_advantage``: a rollout whose advantage is 0 (its
    whole group scored alike)."""
    enforce: bool = False
    """Leave detected rollouts out of the batch; ``false``: only count them."""
    token_id_threshold: int = 100_000
    logprob_offset: float = 2.0
    window: int = Field(default=3000, ge=1)
    prob_threshold: float = Field(default=0.99, gt=0, le=1)


class BufferConfig(Section):
    """prime-rl's ``[orchestrator.buffer]``."""

    online_difficulty_filtering: bool = False
    """Leave out groups whose rollouts all scored the same (all 0 or all 1): they carry no
    advantage. The same as a ``zero_advantage`` filter with ``enforce``."""
    env_ratios: list[float] | None = None
    """Share of the groups per environment, in ``orchestrator.env`` order (``env[].ratio``)."""
    seed: Annotated[int | None, Noted("prime draws examples with orchestrator.seed")] = None
    easy_threshold: Annotated[float | None, Noted("prime keeps no per-example difficulty buffer")] = None
    hard_threshold: Annotated[float | None, Noted("prime keeps no per-example difficulty buffer")] = None
    easy_fraction: Annotated[float, Noted("prime keeps no per-example difficulty buffer")] = 0.0
    hard_fraction: Annotated[float, Noted("prime keeps no per-example difficulty buffer")] = 0.0
    hash_keys: Annotated[list[str] | None, Noted("prime keeps no sample buffer to match on resume")] = None


class TrainRest(Section):
    """What remains of prime-rl 0.6's ``[orchestrator.train]`` once its ``env`` list and
    ``sampling`` table are read as ``orchestrator.env`` and ``orchestrator.sampling``."""

    max_retries: Annotated[int | None, Noted(
        "a failing rollout fails its group in prime (counted, the group dropped)")] = None
    num_workers: Annotated[Any, Noted("prime runs environments inside the orchestrator (no env servers)")] = None


TRAINING_MODES = ("rl", "opd", "sft")


class TeacherModelRef(TokenizerRef):
    """The teacher model: the one its server serves."""

    name: str | None = None  # type: ignore[assignment]
    """The teacher's model (a Hugging Face id or a local folder); required."""

    @field_validator("name")
    @classmethod
    def _local_folder_exists(cls, name: str | None) -> str | None:
        return None if name is None else super()._local_folder_exists(name)

    @model_validator(mode="after")
    def _local_folder_loads(self) -> TeacherModelRef:
        return self if self.name is None else super()._local_folder_loads()


class TeacherClientConfig(ClientConfig):
    """How the orchestrator reaches the teacher's server (through the backend's client)."""

    base_url: list[str] | None = Field(default=None, min_length=1)  # type: ignore[assignment]
    """The teacher server's URL(s); set for you when ``teacher_inference`` makes ``prime run``
    start it."""


class TeacherConfig(Section):
    """prime-rl's teacher (0.6's ``[orchestrator.teacher]``, 0.5's ``teacher_model`` and
    ``teacher_rollout_model``): a frozen model on its own server. ``training_mode = "opd"`` (or
    ``trainer.loss.teacher_tau > 0``): it scores the tokens the student sampled; ``"sft"``: it
    samples the rollouts the student learns to imitate. It must share the student's tokenizer:
    it reads and writes the student's token ids."""

    model: TeacherModelRef = Field(default_factory=TeacherModelRef)
    client: TeacherClientConfig = Field(default_factory=TeacherClientConfig)

    @model_validator(mode="after")
    def _model_and_server(self) -> TeacherConfig:
        if self.model.name is None:
            raise ValueError("the teacher has no model: set orchestrator.teacher.model.name (or "
                             "teacher_inference.model.name, and prime run starts its server)")
        if self.client.base_url is None:
            raise ValueError("the teacher has no server: set teacher_inference (prime run starts one, "
                             "[teacher_inference.model] name = ...), or orchestrator.teacher.client.base_url = "
                             "[\"http://HOST:PORT/v1\"] for a server you run")
        return self


class OrchestratorConfig(Section):
    """The orchestrator role: samples, scores and packs batches for the trainer."""

    output_dir: Path = Path("outputs")
    model: TokenizerRef = Field(default_factory=TokenizerRef)
    client: ClientConfig = Field(default_factory=ClientConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: list[EnvConfig] = Field(default_factory=list)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig | None = None
    """``[orchestrator.eval]``: evaluate at step 0 and every ``interval`` steps."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    batch_size: int = Field(default=128, ge=1)
    """Samples per training step."""
    rollouts_per_example: int = Field(default=8, ge=1,
                                      validation_alias=AliasChoices("rollouts_per_example", "group_size"))
    """Completions sampled per prompt (a GRPO group); ``group_size`` is accepted too."""
    max_off_policy_steps: int = Field(default=8, ge=0)
    """Samples from a policy older than this many steps are dropped."""
    async_level: int = Field(default=1, ge=0, validation_alias=AliasChoices("async_level", "max_async_level"))
    """How many steps the orchestrator may run ahead of the trainer: the batch of step N is
    only handed over once the policy of step N-1-async_level is loaded for inference
    (prime-rl's ``max_async_level``)."""
    resume: bool = False
    """Continue after the newest complete trainer checkpoint."""
    weights_timeout: float | None = Field(default=3600.0, gt=0)
    """Seconds to wait for the trainer's next policy when nothing else can be done (the
    ``async_level`` bound); then the run stops, naming the weights it waited for. ``None``: wait
    for ever."""
    seq_len: int = Field(default=2048, ge=1)
    max_steps: int | None = Field(default=None, ge=1)
    batch_format: Literal["binary", "json"] = "binary"
    """How each step's batch is written for the trainer: ``binary`` (typed arrays in
    ``rollouts/step_N/batch.safetensors``) or ``json`` (``batch.json``, readable text for
    debugging, several times larger and slower). The trainer reads either."""
    seed: int = 0
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    weight_broadcast: WeightBroadcastConfig = Field(default_factory=WeightBroadcastConfig)
    monitors: Monitors = Field(default_factory=lambda: ["jsonl"])
    """Metric sinks (``prime plugins list``); ``jsonl`` is always written."""
    log: LogConfig = Field(default_factory=LogConfig)

    max_inflight_rollouts: int | None = Field(default=None, ge=1,
                                              validation_alias=AliasChoices("max_inflight_rollouts", "max_concurrent"))
    """Rollouts sampled at once at most (whole groups; 0.5's ``max_concurrent`` too); unset:
    ``batch_size × oversampling_factor``, or the groups of ``async_level + 1`` steps."""
    oversampling_factor: float | None = Field(default=None, ge=1)
    """``max_inflight_rollouts = batch_size × oversampling_factor`` when that is unset."""
    pre_batch_filters: list[BatchFilterConfig] = Field(default_factory=list,
                                                       validation_alias=AliasChoices("pre_batch_filters", "filters"))
    """Rollout filters applied as each group completes (0.5's ``filters`` too)."""
    post_batch_filters: list[BatchFilterConfig] = Field(default_factory=list)
    """Rollout filters applied to a step's batch once it is assembled."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    token_batch_size: int | None = Field(default=None, ge=1)
    """prime-rl's token-based batching: refused, prime batches by samples (``batch_size``)."""
    train: TrainRest | None = None
    """prime-rl 0.6's ``[orchestrator.train]``: its ``env`` and ``sampling`` become ``env`` and ``sampling``."""
    training_mode: Literal["rl", "opd", "sft"] = "rl"
    """prime-rl 0.6's training modes. ``rl``: the student samples, rewards make the advantages
    (with a teacher and ``trainer.loss.teacher_tau > 0``: plus ``teacher_tau`` times the
    teacher's log-probability minus the student's, per token: 0.5's distillation). ``opd``:
    on-policy distillation: the student samples, the teacher scores its tokens, and the per-token
    advantage is the teacher's log-probability minus the student's (rewards are logged, not
    trained on). ``sft``: the teacher samples the rollouts and the student learns them by
    negative log-likelihood (without a teacher: its own samples)."""
    teacher: TeacherConfig | None = Field(default=None, validation_alias=AliasChoices("teacher", "teacher_model"))
    """The teacher (``[orchestrator.teacher]``; 0.5's ``teacher_model``): its model and server."""

    prime_rl_keys: ClassVar[tuple[str, ...]] = ("train.env", "train.sampling", "student", "teacher_rollout_model")

    # prime-rl's orchestrator keys for parts prime does its own way.
    strict_async_level: Annotated[bool, Noted(
        "prime's async_level is a bound: a batch may come from a newer policy")] = False
    bench: Annotated[bool, Noted("`prime run --bench` benchmarks the trainer on fake data")] = False
    val: Annotated[dict[str, Any] | None, Noted("prime evaluates with [orchestrator.eval]")] = None
    verification: Annotated[dict[str, Any] | None, Noted(
        "prime's environments always score their rollouts")] = None
    renderer: Annotated[dict[str, Any] | None, Noted(
        "prime renders chats with the tokenizer's chat template (model.chat_template to replace it), token-exact "
        "turn to turn; tool calls are read by orchestrator.rollout.tool_parser")] = None
    tokenizer: Annotated[dict[str, Any] | None, Noted(
        "the orchestrator's tokenizer is model.tokenizer (model.chat_template for a template)")] = None
    rollout_transport: Annotated[dict[str, Any] | None, Noted(
        "batches reach the trainer as files under output_dir/rollouts (orchestrator.batch_format)")] = None
    prime_monitor: Annotated[dict[str, Any] | None, Noted(
        "Prime Intellect's hosted monitor is not part of prime; use a monitor plugin's table (`prime plugins list`)")
    ] = None
    heartbeat: Annotated[dict[str, Any] | None, Noted(
        "prime sends no heartbeats; metrics.jsonl and the role logs show progress")] = None
    collect_inference_metrics: Annotated[bool, Noted("prime's metrics show requests per replica")] = True
    inference_metrics_roles: Annotated[Any, Noted("prime serves without prefill/decode disaggregation")] = None
    env_install_prerelease: Annotated[bool, Noted("prime installs no environments at run time (pip install the "
                                                  "plugin)")] = False
    tasks_per_minute: Annotated[int | None, Noted("prime sends no rate-limited tasks")] = None
    num_train_workers: Annotated[int, Noted("prime runs environments inside the orchestrator")] = 1
    pool_size: Annotated[int | None, Noted("prime renders chats in the orchestrator's process")] = None
    use_token_client: Annotated[bool | None, Noted("prime's sampling client is always token in, token out")] = None
    optim: Annotated[dict[str, Any] | None, Noted(
        "prime trains one run per trainer; the learning rate is trainer.optim.lr")] = None
    experimental: Annotated[dict[str, Any] | None, Noted("prime has no experimental orchestrator keys")] = None

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_layout(cls, data: Any) -> Any:
        """prime-rl 0.6's ``[orchestrator.train]`` (``env`` list, ``sampling``) into prime's places."""
        if not isinstance(data, dict) or not isinstance(data.get("train"), dict):
            return data
        data = dict(data)
        train = dict(data["train"])
        for key in ("env", "sampling"):
            if key in train:
                if key in data:
                    raise ValueError(f"orchestrator.train.{key} and orchestrator.{key} are the same setting "
                                     f"(prime-rl 0.6's place and 0.5's): give one of them")
                data[key] = train.pop(key)
        data["train"] = train
        return data

    @model_validator(mode="before")
    @classmethod
    def _prime_rl_roles(cls, data: Any) -> Any:
        """prime-rl 0.6's ``[orchestrator.student]`` (``model`` and ``client``: the policy, prime's
        ``model`` and ``client``) and 0.5's ``teacher_rollout_model`` (hard distillation: the teacher
        samples, the student trains by NLL: prime's ``training_mode = "sft"`` with that teacher)."""
        if not isinstance(data, dict) or not {"student", "teacher_rollout_model"} & data.keys():
            return data
        data = dict(data)
        student = data.pop("student", None)
        if isinstance(student, dict):
            unknown = sorted(set(student) - {"model", "client"})
            if unknown:
                raise ValueError(f"orchestrator.student: unknown key(s) {', '.join(unknown)} (model, client)")
            for key in ("model", "client"):
                if key in student:  # its keys win over the shortcut's (and what prime run filled in)
                    here = data.get(key)
                    data[key] = ({**here, **student[key]} if isinstance(here, dict) and isinstance(student[key], dict)
                                 else student[key])
        rollout = data.pop("teacher_rollout_model", None)
        if rollout is not None:
            if data.get("teacher") is not None or data.get("teacher_model") is not None:
                raise ValueError("orchestrator.teacher_rollout_model and orchestrator.teacher: prime has one teacher; "
                                 "give one of them")
            if data.get("training_mode", "sft") != "sft":
                raise ValueError("orchestrator.teacher_rollout_model samples the rollouts (training_mode = 'sft'), "
                                 f"but training_mode = {data['training_mode']!r}")
            data["teacher"], data["training_mode"] = rollout, "sft"
        return data

    @model_validator(mode="after")
    def _teacher_for_the_mode(self) -> OrchestratorConfig:
        if self.training_mode == "opd" and self.teacher is None:
            raise ValueError("training_mode = 'opd' (on-policy distillation) needs a teacher: set "
                             "[orchestrator.teacher.model] name = ... and its server (teacher_inference, or "
                             "orchestrator.teacher.client.base_url)")
        return self

    def scores_with_teacher(self) -> bool:
        """Whether the teacher scores the student's samples (``opd``, and ``rl`` with a teacher)."""
        return self.teacher is not None and self.training_mode != "sft"

    @field_validator("token_batch_size")
    @classmethod
    def _no_token_batches(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("prime batches by samples: set batch_size (rollouts per step) instead of token_batch_size")
        return value

    @model_validator(mode="after")
    def _prime_rl_settings(self) -> OrchestratorConfig:
        if self.ckpt.resume_step is not None:
            self.resume = True
        ratios = self.buffer.env_ratios
        if ratios is not None:
            if len(ratios) != len(self.env):
                raise ValueError(f"buffer.env_ratios has {len(ratios)} entries for {len(self.env)} environments")
            for env, ratio in zip(self.env, ratios, strict=True):
                env.ratio = env.ratio if env.ratio is not None else ratio
        given = [env.ratio is not None for env in self.env]
        if any(given) and not all(given):
            raise ValueError("env[].ratio: set it on every environment or on none")
        return self

    def inflight_limit(self) -> int | None:
        """Rollouts in flight at most (``max_inflight_rollouts`` or ``batch_size × oversampling_factor``)."""
        if self.max_inflight_rollouts is not None:
            return self.max_inflight_rollouts
        if self.oversampling_factor is not None:
            return int(self.batch_size * self.oversampling_factor)
        return None

    @model_validator(mode="after")
    def _groups_fit(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of rollouts_per_example "
                f"({self.rollouts_per_example}): a batch holds whole groups"
            )
        return self
