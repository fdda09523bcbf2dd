"""prime-rl's configs run unchanged (docs/prime-rl.md).

Every config block of the seeds, and configs in prime-rl's 0.5 / 0.6 layout written here (one per
key family: [wandb], the 0.6 layout, SFT data, vLLM options, checkpoint keys, orchestrator
scheduling, renames and optimizers, distillation: training modes and the teacher), go through
``prime config validate`` and ``--dry-run``, and the resolved configs the dry run writes are
checked value by value. prime-rl's own example configs are measured by
``scripts/prime_rl_configs.py`` (it needs a prime-rl checkout).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEEDS = Path(__file__).resolve().parents[1] / "examples" / "seeds"

pytestmark = pytest.mark.usefixtures("installed_plugins")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from prime_core.testing import config_only_model

    return config_only_model(tmp_path_factory.mktemp("models") / "moe", model_type="qwen3_moe", num_experts=16,
                             num_experts_per_tok=2, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                             vocab_size=300)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory) -> Path:
    from prime_core.testing import config_only_model

    return config_only_model(tmp_path_factory.mktemp("models") / "dense", model_type="qwen3", num_hidden_layers=2,
                             hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=300)


def run(prime_cli, *args: str) -> tuple[int, str]:
    result = prime_cli(*args)
    return result.exit_code, result.output


def validate_and_dry_run(prime_cli, out: Path, *args: str, root: str = "rl") -> tuple[dict, str]:
    """``prime config validate`` then ``prime run|sft ... --dry-run``; the resolved configs and the
    output of both."""
    code, said = run(prime_cli, "config", "validate", "--root", root, *args)
    assert code == 0 and "config is valid" in said, said
    command = "run" if root == "rl" else root
    code, dry = run(prime_cli, command, *args, "--dry-run", "--output-dir", str(out))
    assert code == 0 and "dry run: nothing started" in dry, dry
    configs = {p.stem: json.loads(p.read_text()) for p in (out / "configs").glob("*.json")}
    return configs, said + dry


# ---------------------------------------------------------------------------------- the seeds

KNOB_SEEDS = ["knobs.toml", "memory_tight.toml", "memory_tldr.toml", "optim_offload_legacy.toml"]


@pytest.mark.parametrize("seed", KNOB_SEEDS)
def test_seed_knob_blocks_validate_and_dry_run_on_a_cluster_deployment(seed, prime_cli, moe_model, tmp_path):
    """The scaling and memory guides' blocks, placed as the guides place them: with the
    multi-node [deployment] block and the SLURM overlay (`prime run @ knobs @ deployment @ slurm`)."""
    configs, _ = validate_and_dry_run(
        prime_cli, tmp_path / "out", "@", str(SEEDS / seed), "@", str(SEEDS / "multinode_rl.toml"), "@",
        str(SEEDS / "slurm_overlay.toml"), "--model.name", str(moe_model),
        "--orchestrator.env", '[{"id": "reverse-text"}]')
    model = configs["trainer"]["model"]
    assert model["optim_cpu_offload"] is True
    if seed != "optim_offload_legacy.toml":
        assert (model["impl"], model["ep"], model["cp"]) == ("custom", 8, 2)
        assert model["ac"]["freq"] == 1 or model["ac"]["mode"] == "selective"
    assert configs["rl"]["deployment"]["num_train_nodes"] == 2
    assert (tmp_path / "out" / "rl.sh").is_file(), "the SLURM launcher writes the sbatch script"


def test_seed_multinode_sft_validates_and_dry_runs(prime_cli, dense_model, tmp_path):
    configs, _ = validate_and_dry_run(prime_cli, tmp_path / "out", "@", str(SEEDS / "multinode_sft.toml"), "@",
                                      str(SEEDS / "slurm_overlay.toml"), "--model.name", str(dense_model),
                                      "--data.type", "fake", root="sft")
    assert configs["sft"]["deployment"] == {**configs["sft"]["deployment"], "type": "multi_node", "num_nodes": 2,
                                            "gpus_per_node": 8}
    script = (tmp_path / "out" / "sft.sh").read_text()
    assert "#SBATCH --job-name=my-rl-run" in script and "#SBATCH --nodes=2" in script


def test_slurm_dense_hendrycks_validates_and_writes_its_sbatch_script(prime_cli, tmp_path):
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "out", str(SEEDS / "slurm_dense_hendrycks.toml"))
    trainer, orchestrator, inference = configs["trainer"], configs["orchestrator"], configs["inference"]
    for role in (trainer, orchestrator):  # one W&B run for both roles
        assert (role["wandb"]["project"], role["wandb"]["name"]) == ("hendrycks-math", "hendrycks-math")
        assert role["model"]["name"] == "Qwen/Qwen3-4B-Instruct-2507" and role["max_steps"] == 500
    assert orchestrator["env"][0]["id"] == "math-env" and orchestrator["env"][0]["args"]["dataset_subset"] == "default"
    assert (orchestrator["batch_size"], orchestrator["rollouts_per_example"]) == (128, 16)
    assert orchestrator["sampling"]["max_tokens"] == 2048 and trainer["seq_len"] == 2048
    assert (inference["parallel"]["tp"], inference["parallel"]["dp"]) == (1, 8)
    script = (tmp_path / "out" / "rl.sh").read_text()
    assert "#SBATCH --job-name=hendrycks-math" in script and "#SBATCH --nodes=2" in script


def test_slurm_moe_hendrycks_validates_and_writes_its_sbatch_script(prime_cli, installed_plugins, tmp_path):
    """Valid with the first-party plugins; until a plugin provides the `nccl` weight transport its
    absence is the only problem named (and the dry run still writes the script)."""
    seed = str(SEEDS / "slurm_moe_hendrycks.toml")
    code, said = run(prime_cli, "config", "validate", seed)
    if "nccl" in installed_plugins.registry("weight_transports"):
        assert code == 0 and "config is valid" in said, said
    else:
        problems = [line for line in said.splitlines() if line.strip().startswith("- ")]
        assert code == 2 and problems and all("weight transport named 'nccl'" in p for p in problems), said
    code, dry = run(prime_cli, "run", seed, "--dry-run", "--output-dir", str(tmp_path / "out"))
    assert code == 0, dry
    trainer = json.loads((tmp_path / "out" / "configs" / "trainer.json").read_text())
    assert trainer["model"]["impl"] == "custom" and trainer["model"]["ac_offloading"]["max_inflight_activations"] == 5
    assert trainer["weight_broadcast"]["type"] == "nccl"
    assert "#SBATCH --job-name=hendrycks-math-moe" in (tmp_path / "out" / "rl.sh").read_text()


# ----------------------------------------------------------- prime-rl 0.5 / 0.6 configs, by key family

def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def base(model: Path) -> str:
    return f'max_steps = 10\nseq_len = 512\n\n[model]\nname = "{model}"\n\n'


def test_wandb_tables_top_level_and_per_role(prime_cli, dense_model, tmp_path):
    config = write(tmp_path / "rl.toml", base(dense_model) + """
[wandb]
project = "compat"
name = "run-a"
tags = ["grpo"]

[orchestrator.wandb]
group = "sampling"

[[orchestrator.env]]
id = "reverse-text"
""")
    configs, _ = validate_and_dry_run(prime_cli, tmp_path / "out", config)
    trainer, orchestrator = configs["trainer"]["wandb"], configs["orchestrator"]["wandb"]
    assert (trainer["project"], trainer["name"], trainer["tags"]) == ("compat", "run-a", ["grpo"])
    assert (orchestrator["project"], orchestrator["group"]) == ("compat", "sampling") and trainer["group"] is None


def test_the_0_6_layout_train_renderer_eval_val(prime_cli, dense_model, tmp_path):
    config = write(tmp_path / "rl.toml", base(dense_model) + """
[orchestrator]
batch_size = 16
group_size = 4

[orchestrator.train.sampling]
max_completion_tokens = 64
temperature = 0.8

[[orchestrator.train.env]]
id = "reverse-text"
name = "rt"
ratio = 1.0

[[orchestrator.train.env]]
id = "arithmetic"
ratio = 3.0

[orchestrator.renderer]
name = "default"

[orchestrator.eval]
interval = 5
num_examples = 8

[orchestrator.eval.sampling]
temperature = 0.2
max_completion_tokens = 64

[[orchestrator.eval.env]]
id = "reverse-text"
group_size = 2
num_examples = 4

[orchestrator.val]
interval = 5
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "out", config)
    orchestrator = configs["orchestrator"]
    assert [(e["id"], e["name"], e["ratio"]) for e in orchestrator["env"]] == [("reverse-text", "rt", 1.0),
                                                                                ("arithmetic", None, 3.0)]
    assert (orchestrator["sampling"]["max_tokens"], orchestrator["sampling"]["temperature"]) == (64, 0.8)
    assert orchestrator["rollouts_per_example"] == 4
    evaluation = orchestrator["eval"]
    assert (evaluation["interval"], evaluation["num_examples"], evaluation["temperature"]) == (5, 8, 0.2)
    assert (orchestrator["eval"]["env"][0]["rollouts_per_example"], orchestrator["eval"]["env"][0]["num_examples"]) \
        == (2, 4)
    for key in ("orchestrator.renderer", "orchestrator.val", "orchestrator.eval.sampling.max_completion_tokens"):
        assert f"warning: {key} = " in said, said


def test_sft_data_name_splits_subsets(prime_cli, dense_model, tmp_path):
    (tmp_path / "my-dataset").mkdir()  # a local dataset folder (its rows are read when the run starts)
    config = write(tmp_path / "sft.toml", f"""max_steps = 3

[model]
name = "{dense_model}"

[data]
type = "sft"
name = "{tmp_path}/my-dataset"
splits = ["train", "test"]
subsets = ["a", "b"]
seq_len = 1024
batch_size = 8
micro_batch_size = 2

[data.loss_mask]
user = true
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "out", config, root="sft")
    sft = configs["sft"]
    assert (sft["data"]["type"], sft["data"]["name"]) == ("sft", f"{tmp_path}/my-dataset")
    assert (sft["data"]["splits"], sft["data"]["subsets"], sft["seq_len"]) == (["train", "test"], ["a", "b"], 1024)
    assert sft["data"]["loss_mask"] == {"system": False, "user": True, "assistant": True, "tool": False}
    assert "warning: data.micro_batch_size = 2: prime packs samples" in said
    from prime_core.sft.config import SFTDataConfig
    from prime_core.sft.hf import subsets_and_splits

    assert subsets_and_splits(SFTDataConfig.model_validate(sft["data"])) == [("a", "train"), ("b", "test")]


def test_vllm_options(prime_cli, dense_model, tmp_path):
    pytest.importorskip("prime_plugin_vllm")
    from prime_core.config.checks import schema_for
    from prime_plugin_vllm.server import VLLMServer

    config = write(tmp_path / "rl.toml", base(dense_model) + """
[[orchestrator.env]]
id = "reverse-text"

[inference]
enable_lora = true
max_lora_rank = 32
max_loras = 4
api_server_count = 2
enable_expert_parallel = true
enable_prefix_caching = true
seed = 7

[inference.vllm_extra]
max_num_seqs = 8

[inference.model]
tool_call_parser = "hermes"
reasoning_parser = "qwen3"
max_model_len = 1024
chat_template = "{{ messages }}"

[inference.kv_cache_offload]
type = "native"
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "out", config)
    inference = configs["inference"]
    assert (inference["lora"]["max_rank"], inference["lora"]["max_loras"]) == (32, 4)
    assert inference["args"] == {"max_num_seqs": 8}
    options = VLLMServer(schema_for("inference").model_validate(inference), on_cpu=False).options()
    expected = {"api_server_count": 2, "enable_expert_parallel": True, "enable_prefix_caching": True, "seed": 7,
                "tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3",
                "enable_lora": True, "max_lora_rank": 32, "max_loras": 4, "max_num_seqs": 8,
                "max_model_len": 1024, "chat_template": "{{ messages }}"}
    assert {k: options.get(k) for k in expected} == expected
    assert "warning: inference.kv_cache_offload = " in said


def test_the_seeds_inference_command_line(prime_cli, dense_model):
    """Seed 001's multi-node inference flags (vLLM's): tensor and local data-parallel sizes are
    parallel.tp / dp of this node, the cross-node DP group's keys are named in warnings, and an
    API key on the command line is refused with where a key goes instead."""
    pytest.importorskip("prime_plugin_vllm")
    result = prime_cli("config", "show", "--root", "inference", "--format", "json", "--model.name", str(dense_model),
                       "--data-parallel-size", "4", "--tensor-parallel-size", "4", "--data-parallel-size-local", "2",
                       "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
                       "--data-parallel-start-rank", "2", "--headless")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["parallel"] == {"tp": 4, "dp": 2}
    for key in ("data_parallel_address", "data_parallel_start_rank", "headless"):
        assert f"warning: {key} = " in result.stderr and "no vLLM data-parallel group spans nodes" in result.stderr
    alone = prime_cli("config", "show", "--root", "inference", "--format", "json", "--model.name", str(dense_model),
                      "--data-parallel-size", "3")
    assert json.loads(alone.stdout)["parallel"] == {"tp": 1, "dp": 3}
    key = prime_cli("config", "validate", "--root", "inference", "--model.name", str(dense_model), "--api-key", "k")
    assert key.exit_code == 2 and "api_key" in key.output and "server.api_key_var" in key.output


def test_checkpoint_keys(prime_cli, dense_model, tmp_path):
    config = write(tmp_path / "rl.toml", base(dense_model) + """
[ckpt]
interval = 5
keep_last = 2
keep_interval = 10
resume_step = 5

[trainer.ckpt]
skip_optimizer = true
skip_scheduler = true

[trainer.ckpt.weights]
save_adapter_separately = true

[[orchestrator.env]]
id = "reverse-text"
""")
    code, said = run(prime_cli, "config", "validate", config)
    assert code == 0, said
    from prime_core.cli.common import load_config

    loaded = load_config("rl", [config])
    assert loaded.resume is True and loaded.trainer.resume is True and loaded.orchestrator.resume is True
    ckpt = loaded.trainer.ckpt
    assert (ckpt.interval, ckpt.keep_last, ckpt.keep_interval, ckpt.resume_step, ckpt.skip_optimizer) == \
        (5, 2, 10, 5, True)
    assert loaded.orchestrator.ckpt.resume_step == 5
    assert "warning: trainer.ckpt.skip_scheduler = true" in said and "warning: trainer.ckpt.weights = " in said
    # resuming a run that is not there is refused, naming the folder (a dry run says so too)
    code, dry = run(prime_cli, "run", config, "--output-dir", str(tmp_path / "none"))
    assert code != 0 and "resume" in dry


def test_orchestrator_scheduling_buffer_and_filters(prime_cli, dense_model, tmp_path):
    config = write(tmp_path / "rl.toml", base(dense_model) + """
[orchestrator]
batch_size = 32
group_size = 4
oversampling_factor = 1.5
max_off_policy_steps = 2

[orchestrator.buffer]
online_difficulty_filtering = true
easy_threshold = 1.0

[[orchestrator.pre_batch_filters]]
type = "zero_advantage"
enforce = true

[[orchestrator.post_batch_filters]]
type = "gibberish"
token_id_threshold = 250

[[orchestrator.env]]
id = "reverse-text"
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "out", config)
    orchestrator = configs["orchestrator"]
    assert orchestrator["oversampling_factor"] == 1.5 and orchestrator["max_off_policy_steps"] == 2
    assert orchestrator["pre_batch_filters"][0] == {**orchestrator["pre_batch_filters"][0], "type": "zero_advantage",
                                                    "enforce": True}
    assert orchestrator["post_batch_filters"][0]["token_id_threshold"] == 250
    assert orchestrator["buffer"]["online_difficulty_filtering"] is True
    assert "warning: orchestrator.buffer.easy_threshold = 1.0" in said
    from prime_core.config.checks import schema_for

    assert schema_for("orchestrator").model_validate(orchestrator).inflight_limit() == 48
    old = write(tmp_path / "old.toml", base(dense_model) + """
[orchestrator]
max_concurrent = 64
[[orchestrator.filters]]
type = "repetition"
window = 100
[[orchestrator.env]]
id = "reverse-text"
""")
    configs, _ = validate_and_dry_run(prime_cli, tmp_path / "old", old)
    assert configs["orchestrator"]["max_inflight_rollouts"] == 64
    assert configs["orchestrator"]["pre_batch_filters"][0]["window"] == 100


def test_renames_and_optimizers(prime_cli, dense_model, tmp_path):
    config = write(tmp_path / "rl.toml", "max_async_level = 2\nclean_output_dir = true\n" + base(dense_model) + """
[trainer]
dist_timeout_seconds = 1200

[trainer.model]
seq_len = 1024

[trainer.optim]
type = "muon"
lr = 0.02
mu = 0.9
betas1 = 0.8
betas2 = 0.95

[trainer.scheduler]
type = "linear"
warmup_steps = 2
decay_steps = 4
min_lr = 1e-3

[trainer.loss]
dppo_mask_low = 0.1
dppo_mask_high = 0.3
kl_tau = 0.01

[[orchestrator.env]]
id = "reverse-text"
""")
    configs, _ = validate_and_dry_run(prime_cli, tmp_path / "out", config)
    rl, trainer = configs["rl"], configs["trainer"]
    assert rl["clean"] is True and configs["orchestrator"]["async_level"] == 2
    assert trainer["seq_len"] == 1024 and configs["orchestrator"]["seq_len"] == 512
    assert trainer["dist_timeout_seconds"] == 1200
    assert (trainer["optim"]["type"], trainer["optim"]["mu"], trainer["optim"]["betas"]) == ("muon", 0.9, [0.8, 0.95])
    assert trainer["scheduler"] == {"type": "linear", "warmup_steps": 2, "decay_steps": 4, "min_lr": 1e-3}
    assert trainer["loss"]["kwargs"] == {"mask_low": 0.1, "mask_high": 0.3, "kl_tau": 0.01}
    sign = write(tmp_path / "sign.toml", base(dense_model) + '[trainer.optim]\ntype = "sign_sgd"\nlr = 1e-4\n'
                 '[[orchestrator.env]]\nid = "reverse-text"\n')
    configs, _ = validate_and_dry_run(prime_cli, tmp_path / "sign", sign)
    assert configs["trainer"]["optim"]["type"] == "sign_sgd"


def test_distillation_training_modes_and_teacher(prime_cli, dense_model, tmp_path):
    """0.6: training_mode and [orchestrator.teacher] (a server the user runs), [orchestrator.student];
    0.5: teacher_tau with deployment.num_teacher_gpus / [teacher_inference] (prime starts the teacher,
    placed after the trainer) and teacher_rollout_model (hard distillation)."""
    from prime_core.testing import config_only_model

    teacher = config_only_model(tmp_path / "teacher", model_type="qwen3", num_hidden_layers=2, hidden_size=64,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                vocab_size=300)
    opd = write(tmp_path / "opd.toml", base(dense_model) + f"""
[orchestrator]
training_mode = "opd"

[orchestrator.student.client]
timeout = 120

[[orchestrator.train.env]]
id = "reverse-text"

[orchestrator.teacher.model]
name = "{teacher}"

[orchestrator.teacher.client]
base_url = ["http://localhost:8101/v1"]
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "opd", opd)
    orchestrator = configs["orchestrator"]
    assert orchestrator["training_mode"] == "opd" and orchestrator["client"]["timeout"] == 120
    assert orchestrator["teacher"]["model"]["name"] == str(teacher)
    assert orchestrator["teacher"]["client"]["base_url"] == ["http://localhost:8101/v1"]
    assert "teacher_inference" not in configs, "0.6: a teacher server the user runs, none started"

    old = write(tmp_path / "old.toml", base(dense_model) + f"""
[deployment]
num_teacher_gpus = 1

[teacher_inference.model]
name = "{teacher}"

[trainer.loss]
teacher_tau = 0.5
adv_tau = 0.0

[[orchestrator.env]]
id = "reverse-text"
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "old", old)
    assert configs["trainer"]["loss"]["kwargs"] == {"teacher_tau": 0.5, "adv_tau": 0.0}
    server, student = configs["teacher_inference"], configs["inference"]
    assert server["model"]["name"] == str(teacher) and server["server"]["port"] == student["server"]["port"] + 1
    url = f"http://127.0.0.1:{student['server']['port'] + 1}/v1"
    assert configs["orchestrator"]["teacher"]["client"]["base_url"] == [url]
    assert configs["orchestrator"]["training_mode"] == "rl"
    plan = json.loads((tmp_path / "old" / "configs" / "plan.json").read_text())
    assert [row["role"] for row in plan["placement"]][-2:] == ["trainer", "teacher_inference"]
    assert any(c.startswith("prime inference") and c.endswith("teacher_inference.json") for c in plan["commands"])

    hard = write(tmp_path / "hard.toml", base(dense_model) + f"""
[trainer.loss]
type = "sft"

[orchestrator]
use_token_client = false

[orchestrator.teacher_rollout_model.client]
base_url = ["http://localhost:8102/v1"]

[orchestrator.teacher_rollout_model.model]
name = "{teacher}"

[[orchestrator.env]]
id = "reverse-text"
""")
    configs, said = validate_and_dry_run(prime_cli, tmp_path / "hard", hard)
    assert configs["orchestrator"]["training_mode"] == "sft" and configs["trainer"]["loss"]["type"] == "sft"
    assert configs["orchestrator"]["teacher"]["client"]["base_url"] == ["http://localhost:8102/v1"]


def test_distillation_mistakes_are_named(prime_cli, dense_model, tmp_path):
    for text, message in [
        ('[orchestrator]\ntraining_mode = "opd"\n', "training_mode = 'opd' (on-policy distillation) needs a teacher"),
        ('[orchestrator.teacher.client]\nbase_url = ["http://localhost:8101/v1"]\n', "the teacher has no model"),
        ('[orchestrator]\ntraining_mode = "opd"\n[orchestrator.teacher.model]\nname = "t"\n',
         "the teacher has no server"),
        ("[trainer.loss]\nteacher_tau = 0.5\n", "trainer.loss.teacher_tau (from {bad}) = 0.5 needs a teacher"),
        ('[orchestrator.teacher.model]\nname = "t"\n[orchestrator.teacher.client]\nbase_url = "http://h:1/v1"\n',
         "training_mode = 'rl' with trainer.loss.teacher_tau = 0 does not use it"),
        ('[orchestrator]\ntraining_mode = "opd"\n[teacher_inference.server]\nport = 8000\n',
         "is a port of the student's inference servers"),
    ]:
        config = write(tmp_path / "bad.toml", base(dense_model) + text + '[[orchestrator.env]]\nid = "reverse-text"\n')
        code, said = run(prime_cli, "config", "validate", config)
        message = message.format(bad=config)  # the file that set the key, as the problem names it
        assert code == 2 and message in said and "Traceback" not in said, (message, said)


def test_the_newer_layout_gets_one_message(prime_cli, tmp_path):
    config = write(tmp_path / "rl.toml", """
[monitors.wandb]
project = "x"

[[orchestrator.train.source]]
name = "math"

[orchestrator.train.source.env.taskset]
id = "math-env"

[inference.vllm]
max_model_len = 8192
""")
    code, said = run(prime_cli, "config", "validate", config)
    assert code == 2
    problems = [line for line in said.splitlines() if line.strip().startswith("- ")]
    assert len(problems) == 1, said
    assert "prime-rl's newer layout ([[orchestrator.train.source]] (v0.8.0), [monitors.*] tables" in problems[0]
    assert "[inference.vllm]" in problems[0] and "prime reads the layout of prime-rl v0.5 and v0.6" in problems[0]


def test_what_prime_cannot_do_is_refused_clearly(prime_cli, dense_model, tmp_path):
    for text, message in [
        ('[model.vlm]\nvision_encoder_attr = "model.visual"\nlanguage_model_attr = "model.language_model"\n',
         "prime trains and serves text-only models"),
        ("[orchestrator]\ntoken_batch_size = 4096\n", "prime batches by samples: set batch_size"),
        ('[inference.deployment]\ntype = "disaggregated"\n', "without P/D disaggregation"),
    ]:
        config = write(tmp_path / "bad.toml", base(dense_model) + text + '[[orchestrator.env]]\nid = "reverse-text"\n')
        code, said = run(prime_cli, "config", "validate", config)
        assert code == 2 and message in said and "Traceback" not in said, said


# -------------------------------------------------------------------------- the parts, against references

def test_notes_name_each_key_once_with_every_place(dense_model, tmp_path):
    from prime_core.cli.common import load_config
    from prime_core.config.prime_rl import notes

    config = load_config("rl", [write(tmp_path / "rl.toml", base(dense_model)
                                      + '[log]\njson_logging = true\n[[orchestrator.env]]\nid = "reverse-text"\n')])
    lines = [line for line in notes(config) if "json_logging" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("log.json_logging, trainer.log.json_logging, orchestrator.log.json_logging"), lines


def test_muon_matches_torch_muon_and_adamw():
    """prime's Muon: the hidden matrices as torch.optim.Muon updates them, everything else as
    torch.optim.AdamW does (fresh random weights and gradients, three steps)."""
    import torch

    from prime_core.trainer.muon import Muon

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(11, 6), "proj": torch.nn.Linear(6, 5),
                                 "lm_head": torch.nn.Linear(6, 11, bias=False)})
    ref = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    ours = Muon(model.named_parameters(), lr=0.02, weight_decay=0.1, momentum=0.9, betas=(0.8, 0.95))
    matrices = [ref["proj.weight"]]
    others = [p for name, p in ref.items() if name != "proj.weight"]
    torch_muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    torch_adamw = torch.optim.AdamW(others, lr=0.02, weight_decay=0.1, betas=(0.8, 0.95))
    for _ in range(3):
        for name, p in model.named_parameters():
            grad = torch.randn_like(p)
            p.grad, ref[name].grad = grad.clone(), grad.clone()
        ours.step()
        torch_muon.step()
        torch_adamw.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name].detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_sign_sgd_steps_by_the_sign():
    import torch

    from prime_core.trainer.muon import SignSGD

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, -0.1, 0.0])
    SignSGD([p], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), torch.tensor([1.0, -2.0, 3.0]) * (1 - 0.05) - 0.1 * torch.tensor([1, -1, 0]))


def test_schedules_follow_prime_rl():
    from prime_core.trainer.config import SchedulerConfig
    from prime_core.trainer.optim import lr_factor

    def lrs(steps=10, **config):
        return [round(lr_factor(SchedulerConfig(**config), 1.0, steps, s), 6) for s in range(steps)]

    assert lrs(type="constant") == [1.0] * 10
    assert lrs(type="constant", warmup_steps=2) == [0.0, 0.5] + [1.0] * 8
    # warmup-stable-decay: 2 warmup steps from min_lr, constant, then 4 decay steps to min_lr
    assert lrs(type="linear", warmup_steps=2, decay_steps=4, min_lr=0.1) == \
        [0.1, 0.55, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]
    cosine = lrs(type="cosine", warmup_steps=0, min_lr=0.2)
    assert cosine[0] == 1.0 and cosine[5] == pytest.approx(0.6) and min(cosine) > 0.2
    assert SchedulerConfig(type="linear").warmup == 10 and SchedulerConfig().warmup == 0


def test_filters_detect_and_enforce():
    import math

    from prime_core.orchestrator import filters
    from prime_core.orchestrator.batch import TrainingSample
    from prime_core.orchestrator.config import BatchFilterConfig

    def sample(tokens, logprobs, advantage=1.0):
        return TrainingSample([1], tokens, logprobs, advantage, 1.0, 0)

    rare = sample([5, 299], [-0.1, -12.0])  # 299 > 250 at logprob < -ln(300) - 2
    repeat = sample([7] * 5, [math.log(0.999)] * 5)
    plain, flat = sample([5, 6], [-1.0, -1.0]), sample([5, 6], [-1.0, -1.0], advantage=0.0)
    gibberish = BatchFilterConfig(type="gibberish", token_id_threshold=250, enforce=True)
    repetition = BatchFilterConfig(type="repetition", window=5, prob_threshold=0.99)
    zero = BatchFilterConfig(type="zero_advantage", enforce=True)
    counts: dict[str, int] = {}
    kept = filters.apply([gibberish, repetition, zero], [rare, repeat, plain, flat], 300, counts)
    assert kept == [repeat, plain] and counts == {"gibberish": 1, "repetition": 1, "zero_advantage": 1}
    masked = filters.masked([gibberish], [rare, plain], 300, {})
    assert masked[0].completion_mask == [0, 0] and masked[1] is plain


def test_checkpoints_resume_step_keep_interval_and_skip_optimizer(tmp_path):
    import torch

    from prime_core.errors import PrimeError
    from prime_core.trainer import ckpt

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(1, 5):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        ckpt.save(tmp_path, step, model, optimizer, {}, keep_last=1, keep_interval=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [2, 4]
    assert ckpt.latest_usable(tmp_path, step=-1)[0] == 4 and ckpt.latest_usable(tmp_path, step=2)[0] == 2
    with pytest.raises(PrimeError, match=r"ckpt.resume_step = 3: no complete checkpoint .* \(complete ones: 2, 4\)"):
        ckpt.latest_usable(tmp_path, step=3)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    ckpt.load(ckpt.latest_usable(tmp_path, step=2)[1], fresh, fresh_optimizer, skip_optimizer=True)
    assert not fresh_optimizer.state, "the optimizer starts afresh"
    ckpt.load(ckpt.latest_usable(tmp_path, step=4)[1], fresh, fresh_optimizer)
    torch.testing.assert_close(fresh.weight, model.weight)
    assert fresh_optimizer.state


PRIME_RL_KEYS = {
    # a sample of every family, by prime-rl 0.5 / 0.6 name (scripts/prime_rl_configs.py --keys checks them all)
    "rl": """wandb.project wandb.name wandb.tags wandb.offline trainer.wandb.project
        orchestrator.wandb.log_extras.samples orchestrator.train.env.id orchestrator.train.env.args
        orchestrator.train.env.ratio orchestrator.train.env.address
        orchestrator.train.sampling.max_completion_tokens orchestrator.train.max_retries orchestrator.renderer.name
        orchestrator.eval.env.group_size orchestrator.eval.sampling.temperature orchestrator.eval.skip_first_step
        orchestrator.val.interval inference.gpu_memory_utilization inference.enable_lora inference.max_lora_rank
        inference.api_server_count inference.enable_expert_parallel inference.enable_prefix_caching
        inference.model.tool_call_parser inference.model.reasoning_parser inference.vllm_extra inference.seed
        inference.kv_cache_offload.type ckpt.resume_step ckpt.keep_interval trainer.ckpt.skip_optimizer
        trainer.ckpt.weights.save_adapter_separately orchestrator.oversampling_factor orchestrator.max_inflight_rollouts
        orchestrator.buffer.online_difficulty_filtering orchestrator.buffer.easy_threshold
        orchestrator.pre_batch_filters.enforce orchestrator.filters.window max_async_level clean_output_dir
        trainer.model.seq_len trainer.optim.mu trainer.optim.betas1 trainer.dist_timeout_seconds
        trainer.scheduler.min_lr trainer.loss.dppo_mask_low tokenizer.name log.json_logging slurm.exclude
        orchestrator.training_mode orchestrator.teacher.model.name orchestrator.teacher.client.base_url
        orchestrator.teacher_model.client.base_url orchestrator.teacher_rollout_model.model.name
        orchestrator.student orchestrator.student.model.name orchestrator.student.client.timeout
        orchestrator.teacher.client.wait_for_ready_timeout orchestrator.teacher.client.headers_from_env
        trainer.loss.teacher_tau
        teacher_inference.model.name teacher_inference.gpu_memory_utilization deployment.num_teacher_gpus
        deployment.num_teacher_nodes""",
    "sft": """data.name data.splits data.subsets data.type data.seq_len data.micro_batch_size data.loss_mask.user
        ckpt.resume_step model.seq_len optim.betas2 deployment.nodes_per_fsdp_group wandb.project""",
}


@pytest.mark.parametrize("root", sorted(PRIME_RL_KEYS))
def test_every_key_family_has_a_home(root):
    from prime_core.config.checks import schema_for
    from prime_core.config.prime_rl import has_home

    schema = schema_for(root)
    keys = PRIME_RL_KEYS[root].split()
    assert [key for key in keys if not has_home(schema, key)] == []
    assert not has_home(schema, "orchestrator.no_such_key" if root == "rl" else "data.no_such_key")


def test_default_loss_masks_each_side_with_its_own_threshold():
    """prime-rl's dppo_mask_low / dppo_mask_high: a token is masked when its probability rose more
    than mask_high (positive advantage) or fell more than mask_low (negative advantage)."""
    import torch

    from prime_core.algorithms import default_loss

    inference = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    policy = torch.log(torch.tensor([0.8, 0.65, 0.2, 0.35]))  # +0.3, +0.15, -0.3, -0.15
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    _, parts = default_loss(policy, inference, advantages, mask_low=0.1, mask_high=0.2)
    assert parts["is_masked"].tolist() == [1.0, 0.0, 1.0, 1.0]
    _, parts = default_loss(policy, inference, advantages)  # 0.2 both ways
    assert parts["is_masked"].tolist() == [1.0, 0.0, 1.0, 0.0]


SHARDED_MUON = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from prime_core.trainer.muon import Muon
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
full, grads = torch.randn(8, 6), [torch.randn(8, 6) for _ in range(3)]
whole = torch.nn.Parameter(full.clone())
sharded = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
one = Muon([("proj.weight", whole)], lr=0.02, weight_decay=0.1, momentum=0.9)
two = Muon([("proj.weight", sharded)], lr=0.02, weight_decay=0.1, momentum=0.9)
for grad in grads:
    whole.grad = grad.clone()
    one.step()
    sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    two.step()
torch.testing.assert_close(sharded.full_tensor(), whole.detach())
print(f"rank {rank} ok", flush=True)
from prime_core.distributed import exit_process, shutdown

shutdown()
exit_process(0)  # as a trainer rank ends: gloo's threads can abort a finalising interpreter
"""


def test_muon_on_a_matrix_sharded_over_two_processes_matches_one(tmp_path):
    """A DTensor matrix (FSDP's layout) is gathered for the Newton-Schulz iteration and its update
    applied to each rank's shard: the same weights as one process with the whole matrix (gloo)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "muon.py"
    script.write_text(SHARDED_MUON)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}  # exit_process reads it
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert all(f"rank {i} ok" in out for i, out in enumerate(outputs)), outputs
