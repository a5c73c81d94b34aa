"""Rollout throughput: the torch engine vs transformers' ``generate`` (and vLLM when importable).

All engines get the same checkpoint (a fresh ``tiny-moe`` by default, or ``--model DIR``), the
same prompts (``--prompts`` chat-formatted questions of mixed lengths) and generate exactly
``--new-tokens`` tokens each (EOS ignored), sampling at ``--temperature``. Each engine is warmed up
on a small batch first; the timed figure is generated tokens / wall seconds of one full call.
Ends with one JSON line: ``engine_tok_s``, ``hf_tok_s``, ``ratio`` (engine / hf), and
``vllm_tok_s`` when ``vllm`` imports (run it in ``.venv-vllm`` for that column).

    python benchmarks/rollout.py [--prompts 64] [--new-tokens 128] [--model DIR] [--no-vllm]
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


def bench_engine(model_dir, prompts, new_tokens, temperature) -> float:
    from train.engine import SamplingParams, TorchEngine

    eng = TorchEngine.from_pretrained(model_dir)
    sp = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
    eng.generate(prompts[:4], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=0))
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    dt = time.perf_counter() - t
    return sum(len(c.token_ids) for c in outs) / dt


def bench_hf(model_dir, prompts, new_tokens, temperature, pad_id) -> float:
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
            return model.generate(input_ids=ids[:n_rows], attention_mask=mask[:n_rows], max_new_tokens=steps,
                                  min_new_tokens=steps, **kw)

    run(4, 8)
    t = time.perf_counter()
    out = run(len(prompts), new_tokens)
    dt = time.perf_counter() - t
    return (out.shape[1] - L) * len(prompts) / dt


def bench_vllm(model_dir, prompts, new_tokens, temperature) -> float:
    from train.engine import SamplingParams
    from train.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine(model_dir)
    try:
        eng.generate(prompts[:4], SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=0))
        t = time.perf_counter()
        outs = eng.generate(prompts, SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True,
                                                    seed=0))
        dt = time.perf_counter() - t
    finally:
        eng.close()
    return sum(len(c.token_ids) for c in outs) / dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint directory (default: a fresh tiny-moe)")
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
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
        res["engine_tok_s"] = round(bench_engine(model_dir, prompts, a.new_tokens, a.temperature), 1)
        print(f"torch engine: {res['engine_tok_s']} tok/s", file=sys.stderr)
        res["hf_tok_s"] = round(bench_hf(model_dir, prompts, a.new_tokens, a.temperature, pad_id), 1)
        print(f"transformers generate: {res['hf_tok_s']} tok/s", file=sys.stderr)
        res["ratio"] = round(res["engine_tok_s"] / res["hf_tok_s"], 2)
        if not a.no_vllm and importlib.util.find_spec("vllm") is not None:
            res["vllm_tok_s"] = round(bench_vllm(model_dir, prompts, a.new_tokens, a.temperature), 1)
            print(f"vllm: {res['vllm_tok_s']} tok/s", file=sys.stderr)
    sys.stdout.flush()
    print(json.dumps(res), file=json_out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
