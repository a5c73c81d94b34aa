"""``cascade init-model`` and ``cascade generate``."""
from __future__ import annotations

import argparse
import json


def init_model_main(argv: list[str]) -> int:
    from train.presets import init_model, list_presets

    ap = argparse.ArgumentParser(prog="cascade init-model", description="Write a fresh policy checkpoint (HF format).")
    ap.add_argument("--preset", required=True, help=f"one of: {', '.join(list_presets())}")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0,
                    help="seeds the weights and the corpus the byte-level BPE tokenizer is trained on (different "
                         "seeds give different vocabularies of the same size)")
    a = ap.parse_args(argv)
    model, tok = init_model(a.preset, a.out, seed=a.seed)
    from train.model.modeling import count_parameters

    print(json.dumps({"out": a.out, "preset": a.preset, "model_type": model.config.model_type,
                      "parameters": count_parameters(model), "vocab_size": len(tok)}))
    return 0


def generate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="cascade generate", description="Sample from a checkpoint with the torch engine.")
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    ap.add_argument("-n", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    from train.engine import SamplingParams, TorchEngine
    from train.tokenizer import chat_prompt_ids

    eng = TorchEngine.from_pretrained(a.model)
    if eng.tokenizer is None:
        raise FileNotFoundError(f"{a.model!r} has no tokenizer files")
    prompts = [p if a.raw else chat_prompt_ids(eng.tokenizer, p) for p in a.prompt]
    sp = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        min_p=a.min_p, seed=a.seed, repetition_penalty=a.repetition_penalty,
                        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty)
    for c in eng.generate(prompts, sp):
        print(json.dumps({"prompt": c.prompt_index, "text": c.text, "tokens": len(c.token_ids),
                          "finish_reason": c.finish_reason, "mean_logprob": sum(c.logprobs) / len(c.logprobs)}))
    return 0
