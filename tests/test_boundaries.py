"""The core knows no plugin: no first-party plugin name in ``prime_core``'s code (outside
docstrings), no import of a plugin package, and no import cycle inside ``prime_core``."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "prime_core"

# Names of first-party plugins and of what they register (strategies, backends, kernels,
# launchers, environments, monitors). Distinctive words are refused anywhere in a string or
# as an identifier; short generic ones only as a whole string ("ep", "local", ...).
DISTINCT = {"fsdp", "deepep", "deep_ep", "liger", "vllm", "slurm", "torchrun", "flash_attn", "flash_attention_2",
            "flash_attention_3", "fp8", "fused_lm_head", "reverse_text", "arithmetic", "wandb", "tensorboard",
            "reasoning_gym", "math_env", "math_verify", "verifiers"}
WHOLE = {"ep", "cp", "ac", "ac_offloading", "hf", "custom", "local", "compile", "lora", "torch_flash",
         "torch_fused", "deep_gemm"}
ALLOWED = {
    # PyTorch's own launcher CLI (`python -m torch.distributed.run`), which the core uses to start
    # several trainer processes, shown to users under its usual name; not the torchrun plugin.
    ("launch/plan.py", "torchrun"), ("sft/role.py", "torchrun"),
    # PEFT's own adapter format constant (peft_type = "LORA"), which published adapters carry.
    ("testing/contracts/weight_transport.py", "lora"),
    # prime-rl's `trainer.loss.type = "custom"` (a loss function by import path), not the model plugin.
    ("trainer/config.py", "custom"),
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def plugin_names_in(path: Path, root: Path = CORE) -> list[str]:
    source = path.read_text(encoding="utf-8")
    docs = _docstring_lines(ast.parse(source))
    relative = path.relative_to(root).as_posix()
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.start[0] in docs:
            continue
        found: set[str] = set()
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            words = set(re.findall(r"[a-z0-9_]+", tok.string.lower()))
            found = (words & DISTINCT) | ({tok.string.strip("'\"").lower()} & WHOLE)
        elif tok.type == tokenize.NAME and tok.string.lower() in DISTINCT:
            found = {tok.string.lower()}
        hits += [f"{relative}:{tok.start[0]}: {name!r} in {tok.line.strip()[:100]}"
                 for name in sorted(found) if (relative, name) not in ALLOWED]
    return hits


def test_the_core_names_no_plugin():
    hits = [hit for path in sorted(CORE.rglob("*.py")) for hit in plugin_names_in(path)]
    assert not hits, "first-party plugin names in prime_core (make it a hook or the plugin's config):\n" + \
        "\n".join(hits)


def test_the_name_check_catches_a_branch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""Docstrings may say fsdp."""\nif backend == "vllm" or name == "ep" or epoch:\n    pass\n')
    assert [hit.split(": ")[1].split(" in ")[0] for hit in plugin_names_in(probe, tmp_path)] == ["'vllm'", "'ep'"]


@pytest.fixture(scope="module")
def graph():
    grimp = pytest.importorskip("grimp")
    return grimp.build_graph("prime_core", include_external_packages=True)


def test_no_import_cycles_inside_the_core(graph):
    cycles = set()
    for module in graph.modules:
        if not module.startswith("prime_core"):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith("prime_core") and graph.chain_exists(importer=imported, imported=module):
                cycles.add(" <-> ".join(sorted((module, imported))))
    assert not cycles, "import cycles in prime_core:\n" + "\n".join(sorted(cycles))


def test_the_core_imports_no_plugin(graph):
    offenders = sorted(f"{module} imports {imported}" for module in graph.modules if module.startswith("prime_core")
                       for imported in graph.find_modules_directly_imported_by(module)
                       if imported.startswith("prime_plugin"))
    assert not offenders, "\n".join(offenders)
