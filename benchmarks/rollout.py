"""Rollout throughput: the torch engine vs transformers' ``generate`` (and vLLM when importable).

All engines get the same checkpoint (a fresh ``tiny-moe`` by default, or ``--model DIR``), the
same prompts (``--prompts`` chat-formatted questions of mixed lengths) and generate exactly
``--new-tokens`` tokens each (EOS ignored), sampling at ``--temperature``. Each engine is warmed up
on a small batch first, then the engines take turns for ``--repeats`` rounds (so that load from
other processes on a shared machine hits all of them alike); the figure reported per engine is
the best round's generated tokens / wall seconds, with every round listed. Ends with one JSON
line: ``engine_tok_s``, ``hf_tok_s``, ``ratio`` (engine / hf), the engine's prefill seconds and decode
milliseconds per step in its best round, ``engine_native`` (whether the engine ran its fused C++ CPU
ops; ``CASCADE_NATIVE_DECODE=0`` measures its PyTorch path instead), and ``vllm_tok_s`` when ``vllm``
imports (run it in ``.venv-vllm`` for that column; vLLM's engine core then runs in this process). The engine's
completions of its last round are checked against transformers (``logprob_max_abs_diff_vs_hf``, ``..._mean_...``:
each sampled token's log-probability as the engine recorded it and as transformers computes it, teacher-forced).

    python benchmarks/rollout.py [--prompts 64] [--new-tokens 128] [--model DIR] [--repeats 3] [--no-vllm]

Measured on this project's 2-core CPU, defaults (tiny-moe, 64 prompts x 128 tokens, best of 3 rounds each), every
session that ran it since 2026-12-02 (the figures the README quotes): 3.43, 3.42, 3.43 at e6feb3e; 3.37, 3.55, 3.30 at
d52fa63; 3.09 at 6f2893e (a slow hour); 3.70 at 6f000cc (26.2k against 7.1k tokens/s); 3.68 at cc178f2 (17.2k against
4.7k on a slower machine). Re-run at da569dd (2026-12-06: the engine's stop-string window and min_tokens masks, off
this path): ratio 3.66 (engine 25.1k against transformers 6.9k tokens/s, best of 3). Re-run at bcfdc2d (2026-12-06,
later: the engine's end ids computed by ``eos_ids_of``, the same set): 3.75 (27.7k against 7.4k). Re-run at 6cd3ff2
(2026-12-06, later: a pad id outside the vocabulary pads with 0; stop strings need a tokenizer): 3.43 (27.1k against
7.9k). Re-run at c9a84d9
(2026-12-06, later: temperatures below 0.01 refused, none here): 3.43 (28.2k against 8.2k). Re-run at db4d818
(2026-12-06, later: the prefix cache's weights fingerprint in one pass, off this path: the cache is off here; one run,
alone): 3.58 (26.5k against 7.4k). Re-run at 63c8932 (2026-12-06, later, another machine (AMD EPYC); the engine's
stop-string rule shared with the server, off this path; the new check of the engine's completions against
transformers: every sampled token's log-probability within 9.5e-07, mean 1.5e-07; one run, alone): 3.17 (20.9k
against 6.6k). Re-run at bb5e338 (2026-12-07, another machine: a bare string one prompt, numpy seeds as ints; one
run, alone): 2.98 (13.8k against 4.6k; log-probs within 9.5e-07 of transformers). Re-run at 9663526 (2026-12-07,
later: the vLLM engine's EOS ids and min_tokens clamp, off this CPU path; one run, alone): 2.92 (18.1k against 6.2k;
log-probs within 9.5e-07). Re-run at ed04e7e (2026-12-08: the engine checks an interrupt event once per decoding
step), three runs interleaved with 58fdeae's engine (before it), alone: 3.43, 3.44, 3.42 (22.3k, 21.4k, 22.2k against
6.2-6.5k) against 3.70, 3.39, 3.07 (24.6k, 21.7k, 20.0k): the same within this machine's noise; log-probs within
9.5e-07.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_WORDS = ("sum of the digits list sort graph path shortest prime find answer box value integer order "
          "count ways triangle area number then explain why compute").split()


def make_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 30)))
        text = f"<|im_start|>user\n{q} {rng.randint(0, 999)}?<|im_end|>\n<|im_start|>assistant\n"
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def engine_runner(model_dir, prompts, new_tokens, temperature, phases: list, last: list):
    """A warmed-up torch engine; returns a function that generates for all prompts -> tokens.
    Each call appends its (prefill seconds, decode seconds) to ``phases`` and leaves its completions in ``last``."""
    from train.engine import SamplingParams, TorchEngine

    eng = TorchEngine.from_pretrained(model_dir)
    sp = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
    eng.generate(prompts[:4], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=0))

    def run():
        s0 = (eng.stats.prefill_s, eng.stats.decode_s)
        last[:] = eng.generate(prompts, sp)
        phases.append((eng.stats.prefill_s - s0[0], eng.stats.decode_s - s0[1]))
        return sum(len(c.token_ids) for c in last)

    return run, None


def hf_runner(model_dir, prompts, new_tokens, temperature, pad_id):
    """transformers' ``generate`` on a left-padded batch, exactly ``new_tokens`` per row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as for batched decoding
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    kw = dict(do_sample=temperature > 0, pad_token_id=pad_id, eos_token_id=None)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=None, top_p=None)

    def run(n_rows, steps):
        with torch.no_grad():
            out = model.generate(input_ids=ids[:n_rows], attention_mask=mask[:n_rows], max_new_tokens=steps,
                                 min_new_tokens=steps, **kw)
        return (out.shape[1] - L) * n_rows

    run(4, 8)
    return lambda: run(len(prompts), new_tokens), None


def logprob_check(model_dir, prompts, completions, temperature) -> dict:
    """The engine's own output checked against transformers: each sampled token's log-probability as the engine
    recorded it against transformers' (teacher-forced on prompt + completion, logits / temperature); a fast path
    that sampled from wrong logits shows here."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t = temperature if temperature > 0 else 1.0
    diffs = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([list(p) + list(c.token_ids)])
            lp = torch.log_softmax(model(ids).logits[0, len(p) - 1:-1].float() / t, -1)
            ref = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            diffs.append((ref - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return {"logprob_max_abs_diff_vs_hf": float(f"{d.max().item():.3g}"),
            "logprob_mean_abs_diff_vs_hf": float(f"{d.mean().item():.3g}")}


def vllm_runner(model_dir, prompts, new_tokens, temperature):
    from train.engine import SamplingParams
    from train.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine(model_dir, enable_prefix_caching=False)  # (the same prompts every round: the others have no cache)
    sp = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
    eng.generate(prompts[:4], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=0))
    return lambda: sum(len(c.token_ids) for c in eng.generate(prompts, sp)), eng.close


def timed(fn) -> float:
    t = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint directory (default: a fresh tiny-moe)")
    ap.add_argument("--preset", "--model-preset", dest="preset", default="tiny-moe")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per engine; the best is reported")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM column even when vllm imports")
    a = ap.parse_args(argv)
    # everything but the final JSON line goes to stderr (vLLM logs to stdout)
    sys.stdout.flush()
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    import importlib.util

    import torch
    from train.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model
        if model_dir is None:
            from train.presets import init_model

            model_dir = str(Path(tmp) / a.preset)
            init_model(a.preset, model_dir, seed=0)
        tok = load_tokenizer(model_dir)
        prompts = make_prompts(tok, a.prompts)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        res = {"benchmark": "rollout", "model": a.model or a.preset, "prompts": a.prompts,
               "new_tokens": a.new_tokens, "temperature": a.temperature,
               "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
        phases: list = []
        last: list = []
        runners = {"engine": engine_runner(model_dir, prompts, a.new_tokens, a.temperature, phases, last),
                   "hf": hf_runner(model_dir, prompts, a.new_tokens, a.temperature, pad_id)}
        if not a.no_vllm and importlib.util.find_spec("vllm") is not None:
            runners["vllm"] = vllm_runner(model_dir, prompts, a.new_tokens, a.temperature)
        runs: dict[str, list[float]] = {k: [] for k in runners}
        try:
            for r in range(a.repeats):  # alternate engines so that load on a shared machine hits all alike
                for k, (fn, _) in runners.items():
                    runs[k].append(timed(fn))
                    print(f"round {r}: {k} {runs[k][-1]:.1f} tok/s", file=sys.stderr)
        finally:
            for _, close in runners.values():
                if close is not None:
                    close()
        for k, v in runs.items():
            res[f"{k}_tok_s"] = round(max(v), 1)
            res[f"{k}_runs_tok_s"] = [round(x, 1) for x in v]
        res["ratio"] = round(res["engine_tok_s"] / res["hf_tok_s"], 2)
        best = max(range(len(runs["engine"])), key=runs["engine"].__getitem__)  # the engine's phases in its best round
        res["engine_prefill_s"] = round(phases[best][0], 4)
        res["engine_decode_ms_per_step"] = round(phases[best][1] / a.new_tokens * 1e3, 3)
        from train.engine import native

        # fused C++ ops (CASCADE_NATIVE_DECODE=0: off); for zaya they run the decoding steps (prefill in PyTorch)
        res["engine_native"] = native.enabled() and native.load()
        res.update(logprob_check(model_dir, prompts, last, a.temperature))  # after the timed rounds
        res["load_avg_1m"] = round(os.getloadavg()[0], 2)
    sys.stdout.flush()
    print(json.dumps(res), file=json_out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
