"""Markovian RSA on a tiny model with the torch engine, shared-prefix KV reuse off vs on.

Prints one JSON line. Usage: python benchmarks/ttc.py [--preset tiny-moe] [--population 8]
[--aggregate 4] [--rounds 2] [--budget 32] [--tail 16] [--problem-words 200] [--device cpu] [--threads 1]
Both sides run the same seeded RSA on the same checkpoint (a fresh random model written to a
temporary directory); ``same_outputs`` says whether every candidate's tokens agree.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from train.engine.prefix_cache import enable_prefix_caching  # noqa: E402
from train.engine.torch_engine import TorchEngine  # noqa: E402
from train.presets import init_model  # noqa: E402
from ttc.backends import EngineBackend  # noqa: E402
from ttc.rsa import RSAConfig, run_rsa  # noqa: E402

WORDS = ("triangle circle radius area integer prime sum product divisor sequence graph edge path "
         "probability coin fair expected value square root fraction remainder").split()


def measure(path, device, cached: bool, problem: str, cfg: RSAConfig, repeats: int):
    eng = TorchEngine.from_pretrained(path, device=device)
    if cached:
        enable_prefix_caching(eng)
    be = EngineBackend(eng)
    run_rsa(be, problem, RSAConfig(**{**cfg.__dict__, "rounds": 1, "budget": 4, "tail": 2}), gold="1")  # warm up
    if cached:
        eng.prefix_cache.clear()
    s0 = (eng.stats.prefill_s, eng.stats.decode_s)
    best, res = None, None
    for _ in range(repeats):
        t = time.perf_counter()
        res = run_rsa(be, problem, cfg, gold="1")
        wall = time.perf_counter() - t
        best = wall if best is None else min(best, wall)
    m = res.metrics
    out = {"wall_s": round(best, 4), "generated_tokens": m["generated_tokens"], "prefill_tokens": m["prefill_tokens"],
           "generated_tokens_per_s": round(m["generated_tokens"] / best, 1),
           "total_tokens_per_s": round((m["generated_tokens"] + m["prefill_tokens"]) / best, 1),
           "prefill_s": round((eng.stats.prefill_s - s0[0]) / repeats, 4),
           "decode_s": round((eng.stats.decode_s - s0[1]) / repeats, 4)}
    if cached:
        out["prefill_tokens_not_recomputed"] = eng.prefix_cache.stats.saved_tokens // repeats
    return out, [[c.token_ids for c in r] for r in res.rounds]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--population", type=int, default=8)
    ap.add_argument("--aggregate", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--tail", type=int, default=16)
    ap.add_argument("--problem-words", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = random.Random(0)
    problem = " ".join(rng.choice(WORDS) for _ in range(a.problem_words)) + ". Find the answer."
    cfg = RSAConfig(population=a.population, aggregate=a.aggregate, rounds=a.rounds, budget=a.budget, tail=a.tail,
                    final_budget=0, temperature=1.0, seed=0)
    with tempfile.TemporaryDirectory() as d:
        init_model(a.preset, d, seed=0)
        off, toks_off = measure(d, a.device, False, problem, cfg, a.repeats)
        on, toks_on = measure(d, a.device, True, problem, cfg, a.repeats)
    print(json.dumps({"benchmark": "ttc_markovian_rsa_prefix_cache", "preset": a.preset, "device": a.device,
                      "threads": a.threads, "N": a.population, "C": a.aggregate, "T": a.rounds, "beta": a.budget,
                      "tau": a.tail, "problem_words": a.problem_words, "no_prefix_cache": off, "prefix_cache": on,
                      "speedup_wall": round(off["wall_s"] / on["wall_s"], 3),
                      "speedup_prefill": round(off["prefill_s"] / max(on["prefill_s"], 1e-9), 3),
                      "same_outputs": toks_off == toks_on}))


if __name__ == "__main__":
    main()
