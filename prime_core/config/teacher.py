"""The teacher's server in ``prime run`` (prime-rl 0.5's ``teacher_inference`` and
``deployment.num_teacher_gpus``).

``teacher_inference`` is an inference config like ``inference``, for a second server the
launcher starts (``prime inference configs/teacher_inference.json``, placed after the trainer:
its GPUs are the last ones). Keys it leaves out are the student's server's (dtype, context
length, backend options), except its port, which follows the student's replicas
(``inference.server.port + inference.parallel.dp``). ``deployment.num_teacher_gpus`` alone
starts one too, serving the student's model (prime-rl 0.5's default) or ``orchestrator.teacher``'s
model. The orchestrator's teacher (``orchestrator.teacher``) is pointed at that server unless it
names one (``client.base_url``): its model name and backend come from it.
"""

from __future__ import annotations

import copy
from typing import Any

from prime_core.config.base import merge_tables

ROLE = "teacher_inference"
"""Its config file (``configs/teacher_inference.json``), log and placement row."""


def _table(data: dict, *path: str) -> dict | None:
    node: Any = data
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node if isinstance(node, dict) else None


def point_teacher_at_server(data: dict) -> None:
    """Fill ``teacher_inference`` (from ``inference`` and ``deployment.num_teacher_gpus``) and the
    orchestrator's teacher that talks to it. Runs on the raw config, after the shared keys were
    copied into the roles; leaves bad values for the schema to report."""
    orchestrator = data.setdefault("orchestrator", {})
    if not isinstance(orchestrator, dict):
        return
    raw = orchestrator.get("teacher", orchestrator.get("teacher_model"))
    teacher = raw if isinstance(raw, dict) else {}
    server = _teacher_server(data, teacher)
    if server is None:
        return
    data[ROLE] = server
    _point_at(teacher, server)
    orchestrator.pop("teacher_model", None)
    orchestrator["teacher"] = teacher


def _teacher_server(data: dict, teacher: dict) -> dict | None:
    """The teacher's server config: ``teacher_inference`` over the student's server's keys (its
    model the teacher's, its port after the student's replicas); ``None`` when none is asked for."""
    deployment = data.get("deployment") if isinstance(data.get("deployment"), dict) else {}
    given = data.get(ROLE)
    given = {} if given is True else given
    wanted = deployment.get("num_teacher_gpus")
    if given is None or given is False:
        if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted <= 0:
            return None
        given = {}
    if not isinstance(given, dict):
        return None
    student = data.get("inference")
    student = student if isinstance(student, dict) else {}
    server = copy.deepcopy(student)
    parallel = _table(server, "parallel")
    if parallel is not None:  # one server of the student's replica shape (its tp), not its replica count
        server["parallel"] = {k: v for k, v in parallel.items() if k != "dp"}
    model = dict(_table(server, "model") or {})
    name = (_table(given, "model") or {}).get("name") or (_table(teacher, "model") or {}).get("name")
    if name is not None:  # another model: the student's tokenizer and template settings are not its own
        model = {k: v for k, v in model.items() if k not in ("tokenizer", "chat_template")}
        model["name"] = name
    server["model"] = model
    try:
        port = int((_table(student, "server") or {}).get("port", 8000)) + int(
            (_table(student, "parallel") or {}).get("dp", 1))
        server["server"] = {**(_table(server, "server") or {}), "port": port}
    except (TypeError, ValueError):
        pass  # the schema reports the bad value
    return merge_tables(server, given)


def _point_at(teacher: dict, server: dict) -> None:
    """The orchestrator's teacher talks to ``server`` unless it names its own URL; its model and
    backend are the server's, and it presents the server's API key."""
    from prime_core.inference.replicas import local_url

    client = teacher.setdefault("client", {})
    target = _table(server, "server") or {}
    if not isinstance(client, dict):
        return
    if "base_url" not in client:
        try:
            client["base_url"] = [local_url(str(target.get("host", "127.0.0.1")), int(target.get("port", 8000)))]
        except (TypeError, ValueError):
            pass
    if "backend" not in client and isinstance(server.get("backend"), str):
        client["backend"] = server["backend"]
    if not {"api_key_var", "api_key_file"} & client.keys():
        client["api_key_var"] = target.get("api_key_var", "VLLM_API_KEY")
        if target.get("api_key_file") is not None:
            client["api_key_file"] = target["api_key_file"]
    model = teacher.setdefault("model", {})
    name = (_table(server, "model") or {}).get("name")
    if isinstance(model, dict) and name is not None:
        model.setdefault("name", name)


def problems(config) -> list[str]:
    """What contradicts itself about the teacher in a whole ``prime run`` config."""
    out = []
    orchestrator = config.orchestrator
    teacher = orchestrator.teacher
    tau = config.trainer.loss.kwargs.get("teacher_tau", 0.0) if config.trainer.loss.type == "default" else 0.0
    if orchestrator.training_mode == "rl" and tau and teacher is None:
        out.append(f"trainer.loss.teacher_tau = {tau} needs a teacher to score the samples: set "
                   "[orchestrator.teacher.model] name = ... and its server (teacher_inference, or "
                   "orchestrator.teacher.client.base_url), or deployment.num_teacher_gpus; or set teacher_tau = 0")
    if orchestrator.training_mode == "rl" and teacher is not None and not tau:
        out.append("orchestrator.teacher is set but training_mode = 'rl' with trainer.loss.teacher_tau = 0 does not "
                   "use it: set training_mode = 'opd' (on-policy distillation) or 'sft' (the teacher samples), or "
                   "trainer.loss.teacher_tau > 0 (prime-rl 0.5's distillation beside the rewards)")
    server = getattr(config, ROLE, None)
    if server is None:
        if getattr(config.deployment, "num_teacher_nodes", None):
            out.append("deployment.num_teacher_nodes: prime starts a teacher server on a single-node deployment only "
                       "(as prime-rl 0.5); on a cluster, run the teacher yourself and set "
                       "orchestrator.teacher.client.base_url")
        return out
    if config.deployment.type != "single_node":
        out.append("teacher_inference: prime starts a teacher server on a single-node deployment only (as prime-rl "
                   "0.5); on a cluster, run the teacher yourself and set orchestrator.teacher.client.base_url")
    if teacher is None:
        out.append("teacher_inference starts a teacher server but nothing uses it: set training_mode = 'opd' or "
                   "'sft', or trainer.loss.teacher_tau > 0")
    if server.parallel.dp != 1:
        out.append(f"teacher_inference.parallel.dp = {server.parallel.dp}: prime starts one teacher server (give it "
                   "more GPUs with deployment.num_teacher_gpus and teacher_inference.parallel.tp)")
    student = config.inference
    if student is not None:
        ports = range(student.server.port, student.server.port + student.parallel.dp)
        if server.server.port in ports:
            out.append(f"teacher_inference.server.port = {server.server.port} is a port of the student's inference "
                       f"servers ({ports.start}-{ports.stop - 1}): give the teacher another one, or leave it out")
    return out
