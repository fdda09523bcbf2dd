"""Config loading: files of three formats, environment, command line, the assembled schema and
its error messages."""

import json
from pathlib import Path

import pytest

from prime_core.config.cli_args import parse_args
from prime_core.config.load import load
from prime_core.errors import ConfigError

SEEDS = Path(__file__).resolve().parents[1] / "examples" / "seeds"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def load_rl(*tokens, environ=None, root="rl"):
    config, _ = load(root, parse_args([str(t) for t in tokens]), environ=environ or {})
    return config


@pytest.fixture(autouse=True)
def _fresh(plugin_manager):
    """Every test here runs against the core alone, unless it registers plugins itself."""


def test_three_formats_merge_left_to_right(tmp_path):
    a = write(tmp_path / "a.yaml", "trainer:\n  optim:\n    lr: 1.0e-4\n    weight_decay: 0.5\nmax_steps: 3\n")
    b = write(tmp_path / "b.toml", "[trainer.optim]\nlr = 2e-5\n")
    c = write(tmp_path / "c.json", json.dumps({"orchestrator": {"batch_size": 64, "rollouts_per_example": 4}}))
    config = load_rl(a, b, c)
    assert config.trainer.optim.lr == 2e-5, "later file wins"
    assert config.trainer.optim.weight_decay == 0.5, "tables merge key by key"
    assert config.orchestrator.batch_size == 64
    assert config.trainer.max_steps == 3 and config.orchestrator.max_steps == 3, "shared keys propagate"


def test_at_form_is_the_same_as_positional(tmp_path):
    a = write(tmp_path / "a.toml", "max_steps = 5\n")
    b = write(tmp_path / "b.toml", "max_steps = 7\n")
    assert load_rl("@", a, "@", b).max_steps == 7
    assert load_rl(f"@{a}").max_steps == 5


@pytest.mark.usefixtures("installed_plugins")
def test_lists_are_replaced_not_unioned(tmp_path):
    a = write(tmp_path / "a.toml", '[trainer.model.ac]\ntargets = ["norm", "mlp"]\n')
    b = write(tmp_path / "b.toml", '[trainer.model.ac]\ntargets = ["attn_proj"]\n')
    assert load_rl(a, b).trainer.model.ac.targets == ["attn_proj"]


def test_precedence_file_env_cli(tmp_path):
    a = write(tmp_path / "a.toml", "[trainer.optim]\nlr = 1e-3\nweight_decay = 0.2\n")
    env = {"PRIME_TRAINER__OPTIM__LR": "1e-4", "PRIME_TRAINER__OPTIM__WEIGHT_DECAY": "0.3",
           "PRIME_MAX_STEPS": "9", "PRIME_API_KEY": "foreign tool's variable", "PRIME_DISABLED_PLUGINS": "x"}
    config = load_rl(a, "--trainer.optim.lr", "1e-5", environ=env)
    assert config.trainer.optim.lr == 1e-5, "CLI beats environment"
    assert config.trainer.optim.weight_decay == 0.3, "environment beats file"
    assert config.max_steps == 9


def test_nested_env_var_typo_is_refused():
    with pytest.raises(ConfigError) as err:
        load_rl(environ={"PRIME_TRAINER__OPTIM__LRR": "1e-4"})
    assert "trainer.optim.lrr (from environment): unknown key (did you mean 'lr'?)" in str(err.value)


@pytest.mark.usefixtures("installed_plugins")
def test_cli_value_forms():
    config = load_rl(
        "--trainer.model.compile",                        # bare flag turns a section on
        "--no-trainer.model.reshard-after-forward",       # --no- and kebab case
        "--trainer.model.ac.targets", "norm", "attn_proj",  # several values make a list
        "--orchestrator.env", '[{"id": "reverse_text", "args": {"n": 3}}]',  # JSON
        "--trainer.optim.betas=[0.9,0.95]",
        "--inference.server.port", "8001",
        "--trainer.optim.lr", "-0.5e-3" if False else "5e-4",
    )
    assert config.trainer.model.compile is not None
    assert config.trainer.model.reshard_after_forward is False
    assert config.trainer.model.ac.targets == ["norm", "attn_proj"]
    assert config.orchestrator.env[0].id == "reverse_text" and config.orchestrator.env[0].args == {"n": 3}
    assert config.trainer.optim.betas == (0.9, 0.95)
    assert config.inference.server.port == 8001
    assert config.orchestrator.client.base_url == ["http://127.0.0.1:8001/v1"], "client follows the server"


def test_scoped_file_under_a_key(tmp_path):
    t = write(tmp_path / "t.toml", "[optim]\nlr = 3e-6\n")
    assert load_rl("--trainer", "@", t).trainer.optim.lr == 3e-6


def test_optional_section_off(tmp_path):
    config = load_rl("--inference", "None")
    assert config.inference is None


@pytest.mark.usefixtures("installed_plugins")
def test_all_errors_at_once_with_paths_sources_and_suggestions(tmp_path):
    a = write(tmp_path / "a.toml", '[trainer.optim]\nlrr = 1e-5\n[trainer.model]\nep = "eight"\ncp_style = "rings"\n'
                                   '[orchestator]\nbatch_size = 2\n')
    with pytest.raises(ConfigError) as err:
        load_rl(a, "--trainer.epp", "2")
    problems = err.value.problems
    assert err.value.exit_code == 2
    text = "\n".join(problems)
    assert len(problems) == 5, text
    assert f"trainer.optim.lrr (from {a}): unknown key (did you mean 'lr'?)" in text
    assert "trainer.model.ep" in text and "valid integer" in text and "'eight'" in text
    assert "trainer.model.cp_style" in text and "'ring' or 'ulysses'" in text
    assert "orchestator" in text and "did you mean 'orchestrator'" in text
    assert "trainer.epp (from --trainer.epp 2): unknown key" in text


def test_suggestions_inside_a_discriminated_union():
    with pytest.raises(ConfigError, match="deployment.num_train_node .*did you mean 'num_train_nodes'"):
        load_rl("--deployment.type", "multi_node", "--deployment.num-train-node", "2")


@pytest.mark.usefixtures("installed_plugins")
def test_key_in_the_wrong_section_points_to_its_home():
    with pytest.raises(ConfigError) as err:
        load_rl("--trainer.fsdp_cpu_offload", "true")
    assert "'fsdp_cpu_offload' is a key of trainer.model" in str(err.value)


def test_malformed_files_name_the_file(tmp_path):
    bad_toml = write(tmp_path / "bad.toml", "[trainer\nlr = 1\n")
    bad_yaml = write(tmp_path / "bad.yaml", "trainer:\n  optim: [1, 2\n")
    bad_json = write(tmp_path / "bad.json", "{\"trainer\": }")
    for path in (bad_toml, bad_yaml, bad_json):
        with pytest.raises(ConfigError) as err:
            load_rl(path)
        assert str(path) in str(err.value) and "could not parse" in str(err.value)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_rl(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="unsupported config format '.ini'"):
        load_rl(write(tmp_path / "x.ini", "a=1"))


def test_missing_model_folder_and_data_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_rl("--model.name", str(tmp_path / "no-such-model"))
    assert "model.name" in str(err.value) and "model folder not found" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_rl("--data.path", str(tmp_path / "train.jsonl"), root="sft")
    assert "data.path" in str(err.value) and "file not found" in str(err.value)


@pytest.mark.usefixtures("installed_plugins")
def test_exclusive_offloads_are_refused():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_rl("--trainer.model.fsdp-cpu-offload", "--trainer.model.optim-cpu-offload")


@pytest.mark.usefixtures("installed_plugins")
@pytest.mark.parametrize(("args", "message"), [
    (["--trainer.model.impl", "hf", "--trainer.model.ep", "2"], "ep = 2 needs impl = 'custom'"),
    (["--trainer.model.impl", "hf", "--trainer.model.cp", "2", "--trainer.model.attn", "flash_attention_2"],
     "cp = 2 needs impl = 'custom'"),
    (["--trainer.model.impl", "custom", "--trainer.model.cp", "2", "--deployment.num-train-gpus", "3"],
     "cp = 2 does not divide the 3 trainer"),
    (["--trainer.model.impl", "custom", "--trainer.model.ep", "4", "--deployment.num-train-gpus", "6"],
     "ep = 4 does not divide the 6 trainer"),
    (["--trainer.model.ac.mode", "selective", "--trainer.model.ac.targets", '["norms"]'], "targets"),
])
def test_combinations_the_docs_rule_out_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_rl(*args)


@pytest.mark.usefixtures("installed_plugins")
def test_sft_refuses_an_integer_lm_head_chunk():
    with pytest.raises(ConfigError, match="RL-only"):
        load_rl("--model.fused-lm-head-token-chunk-size", "1024", root="sft")
    assert load_rl("--model.fused-lm-head-token-chunk-size", "auto", root="sft")


@pytest.mark.usefixtures("installed_plugins")
def test_lora_trainer_turns_on_lora_serving():
    config = load_rl("--trainer.model.lora.rank", "8")
    assert config.inference.lora.max_rank == 8
    assert load_rl().inference.lora is None
    assert load_rl("--trainer.model.lora.rank", "8", "--inference.lora.max-rank", "32").inference.lora.max_rank == 32


def test_bench_goes_to_the_trainer():
    config = load_rl("--bench.output-json", "b.json")
    assert str(config.trainer.bench.output_json) == "b.json" and config.trainer.bench.steps == 3
    assert load_rl("--bench").trainer.bench.warmup_steps == 2
    assert load_rl("--data.fake.length", "variable", "--bench", root="trainer").data.fake.length == "variable"


def test_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of rollouts_per_example"):
        load_rl("--orchestrator.batch-size", "10", "--orchestrator.rollouts-per-example", "4")


def test_group_size_alias():
    assert load_rl("--orchestrator.group-size", "4").orchestrator.rollouts_per_example == 4


@pytest.mark.usefixtures("installed_plugins")
@pytest.mark.parametrize("seed", sorted(p.name for p in SEEDS.glob("*.toml") if "slurm" not in p.name))
def test_seed_configs_load(seed):
    root = "sft" if "sft" in seed else "rl"
    config = load_rl(SEEDS / seed, root=root)
    assert config is not None


@pytest.mark.usefixtures("installed_plugins")
def test_seed_values_land_where_documented():
    tight = load_rl(SEEDS / "memory_tight.toml").trainer.model
    assert (tight.impl, tight.ep, tight.cp, tight.fused_lm_head_token_chunk_size) == ("custom", 8, 2, 1024)
    assert tight.compile is not None and tight.ac.freq == 1 and tight.ac_offloading.max_inflight_activations == 1
    assert load_rl(SEEDS / "optim_offload_legacy.toml").trainer.model.optim_cpu_offload is True
    multi = load_rl(SEEDS / "multinode_rl.toml").deployment
    assert (multi.type, multi.num_train_nodes, multi.nodes_per_fsdp_group) == ("multi_node", 2, 1)
    split = load_rl("--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2")
    assert split.deployment.type == "single_node"


@pytest.mark.parametrize("args, dp", [
    (["--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2"], 6),
    (["--inference-gpu-ids", "0,1,2,3,4,5", "--trainer-gpu-ids", "6,7"], 6),
    (["--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2", "--inference.parallel.tp", "2"], 3),
    (["--deployment.num-infer-gpus", "6", "--deployment.num-train-gpus", "2", "--inference.parallel.dp", "2"], 2),
    (["--deployment.num-train-nodes", "1", "--deployment.num-infer-nodes", "1", "--inference.parallel.tp", "4"], 2),
    ([], 1),
])
def test_inference_replicas_fill_the_inference_gpus(args, dp):
    """prime-rl's ``dp = infer_gpus // tp`` where dp is unset (a multi-node run: per inference
    node); the orchestrator gets every replica's URL."""
    config = load_rl(*args)
    assert config.inference.parallel.dp == dp
    assert len(config.orchestrator.client.base_url) == dp


def test_a_later_file_or_option_may_use_another_name_of_a_key(tmp_path):
    base = write(tmp_path / "base.toml", "[orchestrator]\nrollouts_per_example = 16\n")
    over = write(tmp_path / "over.toml", "[orchestrator]\ngroup_size = 8\n")
    assert load_rl(base, over).orchestrator.rollouts_per_example == 8
    assert load_rl(base, "--orchestrator.group-size", "4").orchestrator.rollouts_per_example == 4
    both = write(tmp_path / "both.toml", "[orchestrator]\ngroup_size = 8\nrollouts_per_example = 4\n")
    with pytest.raises(ConfigError, match="another name of 'rollouts_per_example', which is set too"):
        load_rl(base, both)  # one file giving both is ambiguous


def test_shared_model_propagates_unless_a_role_overrides(tmp_path):
    a = write(tmp_path / "a.toml", '[model]\nname = "org/base"\ntrust_remote_code = false\n[trainer.model]\n'
                                   'impl = "hf"\n[inference.model]\ntrust_remote_code = true\n')
    config = load_rl(a)
    assert config.trainer.model.name == "org/base" and config.trainer.model.impl == "hf"
    assert config.orchestrator.model.name == config.inference.model.name == "org/base"
    assert config.inference.model.trust_remote_code and not config.orchestrator.model.trust_remote_code


@pytest.mark.parametrize("args, message", [
    (["--model.name", "org/base", "--inference.model.name", "org/served"],
     "trainer.model.name = 'org/base', orchestrator.model.name = 'org/base', inference.model.name = 'org/served'"),
    (["--max-steps", "10", "--trainer.max-steps", "5"], "trainer.max_steps = 5, orchestrator.max_steps = 10"),
    (["--trainer.weight-broadcast.type", "nccl"],
     "trainer.weight_broadcast.type = 'nccl', orchestrator.weight_broadcast.type = 'filesystem'"),
    (["--trainer.ckpt.interval", "5", "--orchestrator.ckpt.interval", "7"],
     "trainer.ckpt.interval = 5, orchestrator.ckpt.interval = 7"),
])
def test_roles_that_disagree_on_a_shared_key_are_refused(args, message):
    # The run would hang (steps, weight transport), pack rows the trainer refuses, or serve
    # another model than it trains: prime-rl refuses these too.
    with pytest.raises(ConfigError) as error:
        load_rl(*args)
    assert f"{message}: the roles must agree; set the top-level" in str(error.value)


def test_a_trainer_seq_len_shorter_than_the_orchestrators_is_refused():
    with pytest.raises(ConfigError, match="trainer.seq_len = 256 is shorter than orchestrator.seq_len = 2048, the "
                                          "rows it packs"):
        load_rl("--trainer.seq-len", "256")
    assert load_rl("--seq-len", "512", "--trainer.seq-len", "1024").trainer.seq_len == 1024  # longer is fine


def test_a_problem_found_after_the_schema_names_the_file_that_set_its_keys(tmp_path):
    a = write(tmp_path / "a.toml", "[trainer]\nseq_len = 256\n")
    b = write(tmp_path / "b.toml", "[orchestrator]\nseq_len = 2048\n")
    with pytest.raises(ConfigError) as error:
        load_rl(a, b)
    assert (f"trainer.seq_len (from {a}) = 256 is shorter than orchestrator.seq_len (from {b}) = 2048, the rows "
            "it packs") in str(error.value)
    with pytest.raises(ConfigError) as error:  # an option is in the command as typed
        load_rl(a, "--orchestrator.seq-len", "2048")
    assert f"trainer.seq_len (from {a}) = 256 is shorter than orchestrator.seq_len = 2048" in str(error.value)


def test_with_sources_names_a_key_s_file_at_its_first_mention():
    from prime_core.config.report import with_sources

    provenance = {("trainer",): "a.toml", ("trainer", "seq_len"): "a.toml", ("model", "name"): "b.toml",
                  ("max_steps",): "--max-steps 3", ("orchestrator", "env"): "c.toml"}
    assert with_sources(["trainer.seq_len = 1: trainer.seq_len again, trainer.lr at its default; "
                         "trainer.model.name from the shared [model]; examples/cpu/rl.toml, model.safetensors",
                         "trainer.seq_len in a second problem; trainer.max_steps set by an option",
                         "orchestrator.env[0].id = 'chess': an item of a list"], provenance) == [
        "trainer.seq_len (from a.toml) = 1: trainer.seq_len again, trainer.lr at its default; "
        "trainer.model.name (from b.toml) from the shared [model]; examples/cpu/rl.toml, model.safetensors",
        "trainer.seq_len in a second problem; trainer.max_steps set by an option",
        "orchestrator.env[0].id (from c.toml) = 'chess': an item of a list"]
    already = "trainer.seq_len (from c.toml): as the schema says it"
    assert with_sources([already], provenance) == [already]


def test_role_configs_round_trip(tmp_path):
    from prime_core.launch.plan import write_role_configs

    config = load_rl("--model.name", "org/m", "--trainer.optim.lr", "3e-6", "--max-steps", "4",
                     "--output-dir", str(tmp_path))
    paths = write_role_configs(config, tmp_path)
    for role in ("trainer", "orchestrator", "inference"):
        alone = load_rl(paths[role], root=role)
        assert alone == getattr(config, role), f"{role}.json must load on its own to the same config"
    assert load_rl(paths["rl"]).trainer == config.trainer


def test_plugin_section_mounts_and_validates(register_plugin):
    from pydantic import Field, model_validator

    from prime_core import hookimpl
    from prime_core.config.base import Section
    from prime_core.specs import ConfigSection

    class Extra(Section):
        budget: int = Field(default=1, ge=1)

    class WidgetFields(Section):
        widget_degree: int = 1
        """How many widgets."""

        @model_validator(mode="after")
        def _widget_native_only(self):
            if self.widget_degree > 1 and self.impl == "hf":  # a merged validator sees the core's keys
                raise ValueError("widget_degree > 1 needs impl = 'custom'")
            return self

    class WidgetTable(Section):
        color: str = "red"

    class CrossCheck(Section):
        @model_validator(mode="after")
        def _widget_fits_steps(self):
            if self.trainer.model.widget_degree > (self.max_steps or 100):
                raise ValueError("trainer.model.widget_degree must not exceed max_steps")
            return self

    class Plugin:
        @hookimpl
        def prime_config_sections(self):
            return [ConfigSection(name="trainer.model.extra", model=Extra),
                    ConfigSection(name="trainer.model", model=WidgetFields, merge=True, roots=("rl", "sft")),
                    ConfigSection(name="widget", model=WidgetTable, roots=("rl", "sft"), roles=("trainer",)),
                    ConfigSection(name="", model=CrossCheck, merge=True)]

    register_plugin(Plugin(), name="extra")
    config = load_rl("--trainer.model.extra.budget", "5", "--trainer.model.widget-degree", "3")
    assert config.trainer.model.extra.budget == 5 and config.trainer.model.widget_degree == 3
    assert config.trainer.model.impl == "auto", "the core's fields and validators survive"
    assert type(config.trainer.model).model_fields["widget_degree"].description == "How many widgets."
    assert load_rl("--model.extra", "true", root="trainer").model.extra.budget == 1, "roles get it too"
    assert load_rl("--model.widget-degree", "2", root="sft").model.widget_degree == 2, "SFT's model gets it too"
    with pytest.raises(ConfigError, match="trainer.model.extra.budgt .*did you mean 'budget'"):
        load_rl("--trainer.model.extra.budgt", "5")
    with pytest.raises(ConfigError, match="widget_degree > 1 needs impl = 'custom'"):
        load_rl("--trainer.model.widget-degree", "2", "--trainer.model.impl", "hf")
    with pytest.raises(ConfigError, match="must not exceed max_steps"):
        load_rl("--trainer.model.widget-degree", "3", "--max-steps", "2")
    # A top-level table with roles reaches those roles' configs; a role's own value wins.
    config = load_rl("--widget.color", "blue", "--trainer.widget.color", "green")
    assert (config.widget.color, config.trainer.widget.color) == ("blue", "green")
    assert load_rl("--widget.color", "blue").trainer.widget.color == "blue"
    assert load_rl("--widget.color", "blue", root="trainer").widget.color == "blue"
    assert load_rl(root="sft").widget is None


def test_plugin_section_clash_names_both(register_plugin):
    from pydantic import model_validator

    from prime_core import hookimpl
    from prime_core.config.base import Section
    from prime_core.errors import PluginError
    from prime_core.specs import ConfigSection

    class Clash(Section):
        dtype: str = "float16"

    class Plugin:
        @hookimpl
        def prime_config_sections(self):
            return [ConfigSection(name="trainer.model", model=Clash, merge=True)]

    record = register_plugin(Plugin(), name="clashing")
    with pytest.raises(PluginError, match="'trainer.model.dtype' is defined by both prime-core and plugin 'clashing'"):
        load_rl()

    class Shadow(Section):
        @model_validator(mode="before")
        @classmethod
        def _propagate(cls, data):
            return data

    class Shadowing:
        @hookimpl
        def prime_config_sections(self):
            return [ConfigSection(name="", model=Shadow, merge=True)]

    from prime_core.plugins import get_plugin_manager

    get_plugin_manager().unregister(record.name)
    register_plugin(Shadowing(), name="shadowing")
    with pytest.raises(PluginError, match="adds validator '_propagate' to 'the root config'"):
        load_rl()


@pytest.mark.usefixtures("installed_plugins")
def test_degrees_beyond_the_default_deployment_stop_the_run():
    from prime_core.config.checks import check

    config = load_rl("--trainer.model.impl", "custom", "--trainer.model.cp", "2")  # loads: a knobs-only file
    assert any("trainer.model.cp = 2 does not divide the 1 trainer processes" in p for p in check(config, "rl"))
