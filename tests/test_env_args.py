"""``prime config validate`` refuses bad ``[[orchestrator.env]] args`` before anything starts:
against an environment's declared ``args`` model, or else against its ``load`` signature."""

import json

import pytest
from pydantic import Field, model_validator

from prime_core import PLUGIN_API_VERSION, hookimpl
from prime_core.config.base import Section
from prime_core.specs import Environment


class CountArgs(Section):
    size: int = Field(default=3, ge=1)
    word: str = "x"


def load_counting(size: int = 3, word: str = "x"):
    raise AssertionError("validation never loads the environment")


def load_signature_only(size: int, word: str = "x"):
    raise AssertionError("validation never loads the environment")


class PassThroughArgs(Section):
    """Declares one argument and passes the others through to a library, checking them itself."""

    model_config = {**Section.model_config, "extra": "allow"}
    kind: str = "a"

    @model_validator(mode="after")
    def _library_knows_them(self):
        unknown = sorted(set(self.model_extra) - {"depth"})
        if unknown:
            raise ValueError(f"{unknown[0]}: kind '{self.kind}' takes no such argument; it takes depth")
        return self


class Envs:
    PRIME_PLUGIN_API = PLUGIN_API_VERSION

    @hookimpl
    def prime_environments(self):
        return [Environment(name="counting", load=load_counting, args=CountArgs, aliases=("count-up",)),
                Environment(name="passing", load=load_counting, args=PassThroughArgs),
                Environment(name="signed", load=load_signature_only),
                Environment(name="lazy", load=load_counting, args="tests_no_such_module:Args")]


@pytest.fixture
def validate(register_plugin, prime_cli):
    register_plugin(Envs(), name="envs")

    def run(*envs):
        return prime_cli("config", "validate", "--orchestrator.env", json.dumps(list(envs)))

    return run


def test_good_args_pass(validate):
    # This manager has no inference backend or launcher: only those are reported.
    result = validate({"id": "counting", "args": {"size": 2}}, {"id": "signed", "args": {"size": 1}})
    assert "problems" in result.output and "orchestrator.env" not in result.output, result.output


def test_every_bad_argument_is_named_with_its_key_and_the_fix(validate):
    result = validate({"id": "counting", "args": {"sise": 2, "word": 5}},
                      {"id": "counting", "args": {"size": 0}})
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert ("orchestrator.env[0].args.sise: environment 'counting' has no argument 'sise' (did you mean 'size'?); "
            "it takes size: int = 3, word: str = 'x'") in out
    assert "orchestrator.env[0].args.word: Input should be a valid string (got 5)" in out
    assert "orchestrator.env[1].args.size: Input should be greater than or equal to 1 (got 0)" in out


def test_values_are_not_coerced(validate):
    # The orchestrator hands the args to load() as written: "2" would arrive as a string.
    result = validate({"id": "counting", "args": {"size": "2"}})
    assert result.exit_code == 2 and "orchestrator.env[0].args.size: Input should be a valid integer" in result.output


def test_without_a_model_the_signature_is_checked(validate):
    result = validate({"id": "signed", "args": {"word": "y", "colour": 1}})
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "orchestrator.env[0].args.colour: environment 'signed' has no argument 'colour'; it takes size, word" in out
    assert "orchestrator.env[0].args.size: environment 'signed' needs this argument" in out


def test_a_broken_args_reference_is_reported(validate):
    result = validate({"id": "lazy"})
    assert result.exit_code == 2
    assert "orchestrator.env[0].args: environment 'lazy' declares its arguments badly" in result.output


def test_the_orchestrator_root_is_checked_too(register_plugin):
    from prime_core.cli.common import load_config
    from prime_core.config.checks import check

    register_plugin(Envs(), name="envs")
    config = load_config("orchestrator", ["--env", json.dumps([{"id": "counting", "args": {"nope": 1}}])])
    assert any(p.startswith("orchestrator.env[0].args.nope:") for p in check(config, "orchestrator"))


def test_an_alias_is_checked_against_the_named_environment(validate):
    result = validate({"id": "count-up", "args": {"size": 2}}, {"id": "count-up", "args": {"sise": 2}})
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "orchestrator.env[0]" not in out
    assert "orchestrator.env[1].args.sise: environment 'counting' has no argument 'sise'" in out


def test_a_model_that_allows_extra_keys_checks_them_itself(validate):
    assert "orchestrator.env" not in validate({"id": "passing", "args": {"kind": "b", "depth": 3}}).output
    result = validate({"id": "passing", "args": {"kind": "b", "width": 3}})
    assert result.exit_code == 2
    assert "orchestrator.env[0].args: width: kind 'b' takes no such argument; it takes depth" in result.output
