"""On-policy distillation and prime-rl 0.6's training modes, piece by piece against references
computed here independently, on fresh random inputs (the seed is in each failure message).

The teacher's term: per sampled token, ``teacher_tau · (log p_teacher - log p_student)`` added
to the advantage (prime-rl 0.5's ``teacher_tau``), or the whole advantage (0.6's ``opd``); the
end-to-end run with a real vLLM teacher is ``test_distillation_e2e.py``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from prime_core.orchestrator.batch import TrainingSample, pack


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def random_tokens(seed: int, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    probs = lambda: torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01  # noqa: E731
    student, inference, teacher = probs().log(), probs().log(), probs().log()
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    advantages[::7] = 0.0
    return student, inference, teacher, advantages


def reference_default(lp, inf, teacher, adv, *, adv_tau, teacher_tau, low, high, kl_tau):
    """Per token, in plain floats: (loss, d loss / d lp, teacher_kl)."""
    out = []
    for x, i, t, a in zip(lp.tolist(), inf.tolist(), teacher.tolist(), adv.tolist(), strict=True):
        dp = math.exp(x) - math.exp(i)
        masked = dp > high if a > 0 else dp < -low  # prime-rl 0.6: not positive holds to the low side
        keep = 0.0 if masked else 1.0
        weight = adv_tau * a + teacher_tau * (t - x)  # the teacher's term is a constant for the gradient
        ratio = math.exp(x - i)
        loss = -keep * weight * ratio + kl_tau * (x - i) ** 2
        grad = -keep * weight * ratio + 2 * kl_tau * (x - i)
        out.append((loss, grad, t - x))
    return out


@pytest.mark.parametrize("adv_tau,teacher_tau", [(1.0, 0.5), (0.0, 1.0), (0.3, 2.0)])
def test_teacher_term_in_the_default_loss_matches_the_reference(adv_tau, teacher_tau):
    from prime_core.algorithms import default_loss

    seed = fresh_seed()
    lp, inf, teacher, adv = random_tokens(seed)
    lp.requires_grad_(True)
    loss, parts = default_loss(lp, inf, adv, adv_tau=adv_tau, teacher_tau=teacher_tau, teacher_logprobs=teacher,
                               mask_low=0.1, mask_high=0.3, kl_tau=0.01)
    loss.sum().backward()
    ref = reference_default(lp.detach(), inf, teacher, adv, adv_tau=adv_tau, teacher_tau=teacher_tau, low=0.1,
                            high=0.3, kl_tau=0.01)
    torch.testing.assert_close(loss.detach(), torch.tensor([r[0] for r in ref], dtype=torch.float64),
                               msg=f"seed {seed}")
    torch.testing.assert_close(lp.grad, torch.tensor([r[1] for r in ref], dtype=torch.float64), msg=f"seed {seed}")
    torch.testing.assert_close(parts["teacher_kl"], torch.tensor([r[2] for r in ref], dtype=torch.float64))


def test_without_a_teacher_the_default_loss_is_unchanged():
    from prime_core.algorithms import default_loss

    seed = fresh_seed()
    lp, inf, teacher, adv = random_tokens(seed)
    plain, parts = default_loss(lp, inf, adv)
    zero_tau, _ = default_loss(lp, inf, adv, teacher_logprobs=teacher, teacher_tau=0.0)
    torch.testing.assert_close(plain, zero_tau, msg=f"seed {seed}")
    assert "teacher_kl" not in parts


def prime_rl_opd(trainer, inference, teacher, advantages, mask):
    """prime-rl v0.6.0's ``opd_loss_fn`` (trainer/rl/loss.py) as read there, for one sample:
    the sum over the sample and its ``teacher_kl`` metric."""
    total, kl_sum = 0.0, 0.0
    for x, i, t, a, m in zip(trainer.tolist(), inference.tolist(), teacher.tolist(), advantages.tolist(),
                             mask.tolist(), strict=True):
        dp = math.exp(x) - math.exp(i)
        invalid = dp > 0.2 if a > 0 else dp < -0.2  # the reward advantage's sign picks the side
        keep = m and not invalid
        adv = 0.0 * a + 1.0 * (t - x)
        total += -(keep * adv * math.exp(x - i)) + 1e-3 * m * (x - i) ** 2
        kl_sum += m * (t - x)
    return total, kl_sum / max(1, sum(mask.tolist()))


def test_opd_mode_is_prime_rl_0_6_opd_loss(installed_plugins):
    from prime_core.trainer.config import LossConfig
    from prime_core.trainer.modes import loss_for

    seed = fresh_seed()
    lp, inf, teacher, adv = random_tokens(seed)
    mask = (torch.rand(len(lp), generator=torch.Generator().manual_seed(seed + 1)) > 0.3).double()
    # trainer.loss tunes the rl mode only: opd keeps prime-rl's fixed knobs whatever it says.
    config = LossConfig.model_validate({"dppo_mask_low": 0.01, "kl_tau": 5.0, "adv_tau": 3.0, "teacher_tau": 7.0})
    fn, kwargs = loss_for("opd", config, installed_plugins)
    per_token, parts = fn(lp, inf, adv, teacher_logprobs=teacher, **kwargs)
    expected, expected_kl = prime_rl_opd(lp, inf, teacher, adv, mask)
    assert float((per_token * mask).sum()) == pytest.approx(expected, rel=1e-9, abs=1e-12), f"seed {seed}"
    assert float((parts["teacher_kl"] * mask).sum() / mask.sum()) == pytest.approx(expected_kl, rel=1e-9)


def test_sft_mode_is_the_negative_log_likelihood(installed_plugins):
    from prime_core.trainer.config import LossConfig
    from prime_core.trainer.modes import loss_for

    lp, inf, _, adv = random_tokens(fresh_seed())
    fn, kwargs = loss_for("sft", LossConfig(), installed_plugins)
    per_token, _ = fn(lp, inf, adv, **kwargs)
    torch.testing.assert_close(per_token, -lp)


def test_teacher_terms_sit_on_sampled_tokens_only():
    """Multi-turn: an environment turn inside the completion (mask 0) carries no teacher term; a
    sample no teacher scored, packed beside one, gets none either."""
    scored = TrainingSample([1, 2], [3, 4, 5, 6, 7], [-0.1] * 5, 1.0, 1.0, 0, completion_mask=[1, 1, 0, 0, 1],
                            teacher_logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0])
    plain = TrainingSample([8], [9, 10], [-0.2] * 2, -1.0, 0.0, 0)
    (row,) = pack([scored, plain], seq_len=64)
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert row.loss_mask == [0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert row.teacher_logprobs == [0, 0, -1.0, -2.0, 0, 0, -5.0, 0, 0, 0]
    (alone,) = pack([plain], seq_len=64)
    assert alone.teacher_logprobs is None
    (cut,) = pack([scored], seq_len=5)  # a sample cut to seq_len keeps its teacher terms aligned
    assert cut.teacher_logprobs == [0, 0, -1.0, -2.0, 0]


def test_trainer_reports_the_teacher_kl_of_the_trained_tokens():
    """``teacher_kl`` = mean over loss tokens of log p_teacher - log p_student, the student's
    log-probabilities from an independent forward of the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from prime_core.algorithms import default_loss
    from prime_core.distributed import World
    from prime_core.trainer.step import forward_backward

    seed = fresh_seed()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n_prompt, n_completion in ((3, 5), (2, 4)):
        ids = torch.randint(0, 64, (n_prompt + n_completion,), generator=g).tolist()
        mask = [1] * n_completion
        mask[1] = 0  # an environment token inside the completion
        teacher = (-torch.rand(n_completion, generator=g) * 4).tolist()
        samples.append(TrainingSample(ids[:n_prompt], ids[n_prompt:], [-1.0] * n_completion, 0.5, 1.0, 0,
                                      completion_mask=mask, teacher_logprobs=teacher))
    rows = [vars(r) for r in pack(samples, seq_len=64)]
    with torch.no_grad():
        expected, count = 0.0, 0
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(ids).logits[0].double().log_softmax(-1)
            for j, (token, m, t) in enumerate(zip(s.completion_ids, s.mask, s.teacher_logprobs, strict=True)):
                if m:
                    position = len(s.prompt_ids) + j
                    expected += t - float(logits[position - 1, token])
                    count += 1
    total = sum(sum(r["loss_mask"]) for r in rows)
    sums = forward_backward(model, rows, total_loss_tokens=total, world=World(), loss_fn=default_loss,
                            loss_kwargs={"teacher_tau": 1.0})
    assert sums["teacher_kl"] == pytest.approx(expected / count, abs=1e-5), f"seed {seed}"


@pytest.fixture(scope="module")
def tiny_student(tmp_path_factory):
    from prime_plugin_hf.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("student") / "model", hidden_size=32, num_layers=1)


def orchestrator_config(model, *extra: str):
    from prime_core.cli.common import load_config

    return load_config("orchestrator", ["--model.name", str(model), "--env", '[{"id": "arithmetic"}]',
                                        "--batch-size", "4", "--rollouts-per-example", "2", *extra])


def test_the_mode_decides_who_samples_and_who_scores(installed_plugins, tiny_student):
    """No server is contacted: the clients are only made. ``sft``: the teacher's servers sample the
    training rollouts; ``opd``: the student's do and the teacher scores; ``rl``: no teacher."""
    from prime_core.orchestrator.role import Orchestrator

    teacher = ["--teacher.model.name", str(tiny_student), "--teacher.client.base-url", "http://127.0.0.1:9/v1",
               "--teacher.client.backend", "vllm"]
    sft = Orchestrator(orchestrator_config(tiny_student, "--training-mode", "sft", *teacher))
    assert sft.rollouts is sft.teacher and not sft.config.scores_with_teacher()
    opd = Orchestrator(orchestrator_config(tiny_student, "--training-mode", "opd", *teacher))
    assert opd.rollouts is opd.pool and opd.config.scores_with_teacher()
    assert list(opd.teacher.clients) == ["http://127.0.0.1:9/v1"]
    rl = Orchestrator(orchestrator_config(tiny_student))
    assert rl.teacher is None and rl.rollouts is rl.pool


def test_a_teacher_backend_that_cannot_score_is_named(installed_plugins, tiny_student):
    from prime_core.errors import ConfigError
    from prime_core.orchestrator.role import Orchestrator

    config = orchestrator_config(tiny_student, "--training-mode", "opd", "--teacher.model.name", str(tiny_student),
                                 "--teacher.client.base-url", "http://127.0.0.1:9/v1",
                                 "--teacher.client.backend", "transformers")
    with pytest.raises(ConfigError, match="cannot score given tokens"):
        Orchestrator(config)
