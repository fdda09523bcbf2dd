"""Exact expected reward of a policy on tasks with one right answer, from log-probabilities.

For an environment whose reward is 1 for the reference answer and 0 otherwise (such as
``arithmetic``), the expected reward of sampling at temperature 1 is the probability of the
answer followed by end-of-turn. Summed over tasks this measures a policy without sampling
noise, which makes a before/after comparison of two checkpoints exact.
"""

from __future__ import annotations


def answer_probabilities(model_path, conversations, *, tokenizer_path=None, device: str = "cpu") -> list[float]:
    """For each chat, the probability at temperature 1 that the model writes its last
    (assistant) message, through its end of turn, after the messages before it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_core.sft.role import chat_sample

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    found = []
    with torch.no_grad():
        for messages in conversations:
            sample = chat_sample(tokenizer, messages)
            ids = torch.tensor([sample.prompt_ids + sample.completion_ids], device=device)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            token_logp = logp.gather(-1, targets[:, None])[:, 0][len(sample.prompt_ids) - 1:]
            found.append(float(token_logp.sum().exp()))
    return found


def expected_exact_match(model_path, tasks, *, tokenizer_path=None, device: str = "cpu") -> float:
    found = answer_probabilities(model_path, [[*task.prompt, {"role": "assistant", "content": task.answer}]
                                              for task in tasks], tokenizer_path=tokenizer_path, device=device)
    return sum(found) / len(found)
