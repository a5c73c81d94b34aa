"""The SFT warm-up's step, packed (``SFTTrainer.step``) vs padded (the right-padded micro-batches it
used before, as a TRL-style trainer without packing builds them), on the tiny cascade's SFT data.

Data: ``--examples`` reference answers of the tiny profile's SFT mix (``configs/profiles/tiny.yaml``:
toy/max 2, toy/add 4, gym/catalan 1, gym/derangements 1, ifeval 2; difficulties 0-1), chat template, as
``cascade run profile=tiny`` encodes them; a fresh ``--preset`` policy (tiny-moe, the profile's). Both
trainers start from the same weights and take the same ``--steps`` batches of ``--batch`` examples
(seeded draws), one step each in turn (so load from other processes hits both alike); the first
``--warmup`` steps are not timed. The padded reference here is the previous ``SFTTrainer.step``:
``make_batch`` (right padding to the batch's longest), ``micro_batch_size`` rows at a time,
``token_logprobs`` with the attention mask, the same loss (response-token NLL summed over the batch /
its response tokens) and the same AdamW.

Prints ONE JSON line: ``packed_step_s`` and ``padded_step_s`` (medians of the timed steps, wall clock
around each call, measured here), ``speedup`` (padded / packed), ``padding_frac`` (pad share of the
padded batches), the mean example length, and ``max_param_diff`` (largest |difference| of any parameter
after all steps: the two compute the same update up to float summation order).

    python benchmarks/sft.py [--steps 24] [--batch 32] [--threads 1]

Measured (2026-12-03, commit 0af2c6d, this project's 2-core CPU, 1 thread, defaults, one run, nothing else
running): packed 0.361 s per step, padded 1.037 s, speedup 2.88; padding_frac 0.603 (mean example 81.3
tokens); max_param_diff 2.3e-06 after 24 steps. Before this commit ``SFTTrainer.step`` was the padded
column: the tiny cascade's 360 SFT steps took 359 s of its 650 s (profiled with py-spy at 62e002e).
Re-run at bf70bfd (one ``Pair`` class for the packed examples since 9d0c4d7; one run, beside a
``learning.py`` run finishing): packed 0.350 s, padded 0.987 s, speedup 2.82, max_param_diff 2.3e-06.
Re-run at 58f57a8 (2026-12-06: SFTTrainer's schedule and data checks, nothing in the step; a faster machine, one
run, alone): packed 0.231 s, padded 0.678 s, speedup 2.93, padding_frac 0.603, max_param_diff 1.3e-06.

Re-run at da569dd (2026-12-06: the step reports the rate it applied, nothing else): 0.236 vs 0.685 s (2.90x).
Re-run at bcfdc2d (2026-12-06, later: the tokenizer's <think> ids unchanged, not special): 0.195 vs 0.560 s (2.87x).
Re-run at 3a0a6c1 (2026-12-06, later: encode_pair goes on from a template's opened thinking, none here; the SFT
schedule by OptimConfig.over; one run, alone): 0.218 vs 0.628 s (2.88x), padding_frac 0.604, max_param_diff 1.1e-06.
Re-run at 486a354 (2026-12-06, later; one run, alone): 0.233 vs 0.699 s (3.00x), padding_frac 0.604, max_param_diff
1.4e-04, where 13be45b's code on the same machine right after gave 1.1e-06 (3.03x): the packed and padded steps
agree 100x less closely after 20 steps. Not isolated: the SFT data's content changed with IFEval's prompts (multi-line
examples, the named request to repeat; the same token counts), and AdamW turns the rounding differences of
near-zero gradients into updates of the learning rate's size; a bug in the packed step would show in its tests
(tests/test_sft.py compares packed and padded losses and gradients), which pass. Re-run at 63c8932 (2026-12-06,
later, another machine (AMD EPYC); trimming counts responses as a thinking template trains them, none here; one run,
alone): 0.248 vs 0.776 s (3.13x), max_param_diff 1.9e-06, and 5cbf690's code (the 1.4e-04 commit's figures' code)
right after: 0.239 vs 0.714 s (2.99x), max_param_diff 1.9e-06: the 1.4e-04 was that machine's rounding, not the code
(the difference grows from 4.4e-07 after 2 steps, 8.6e-07 after 8, to 1.9e-06 after 16 and stays there).
At bb5e338 (2026-12-07, another machine; SFT data and config changes off this path; one run, alone): 0.299 vs 0.933 s
(3.13x), max_param_diff 1.9e-06.
Re-run at a8d020a and 7cf1467 (2026-12-07/08, a later session: the gym generators of the SFT data run under a CPU-time
bound, envs/caps.py; the data are the same problems; two runs, alone): 0.275 vs 0.804 s (2.92x) and 0.272 vs 0.847 s
(3.11x); padding_frac 0.604, mean example 81.1 tokens, max_param_diff 1.9e-06 both times.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY_SFT_ENVS = {"toy/max": 2, "toy/add": 4, "gym/catalan": 1, "gym/derangements": 1, "ifeval": 2}


def padded_step(tr, examples) -> None:
    """The SFT step on right-padded micro-batches (the reference)."""
    from train.batching import index_batch, make_batch, micro_batches
    from train.model.modeling import token_logprobs
    from train.optim import clip_and_step

    batch = make_batch([p for p, _ in examples], [r for _, r in examples], 0)
    total = float(batch.loss_mask.sum().clamp(min=1))
    tr.policy.train()
    for s in micro_batches(len(examples), tr.cfg.micro_batch_size):
        b = index_batch(batch, s)
        lp = token_logprobs(tr.policy, b.input_ids, b.attention_mask)
        (-(lp * b.loss_mask).sum() / total).backward()
    clip_and_step(tr.policy, tr.opt, tr.sched, tr.cfg.optim.grad_clip)
    tr.policy.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--examples", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=32, help="micro_batch_size (rows) for both")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch

    from train.optim import OptimConfig
    from train.presets import init_model
    from train.sft import SFTConfig, SFTTrainer, encode_pair, reference_pairs

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        model, tok = init_model(a.preset, Path(d) / "m", seed=a.seed)
    pairs = reference_pairs(list(TINY_SFT_ENVS), a.examples, seed=a.seed, weights=list(TINY_SFT_ENVS.values()),
                            difficulties=[0, 1])
    enc = [encode_pair(tok, p, r, True, None) for p, r in pairs]
    cfg = SFTConfig(batch_size=a.batch, micro_batch_size=a.micro, max_len=512,
                    optim=OptimConfig(lr=1e-3, warmup_steps=5))
    packed, padded = SFTTrainer(copy.deepcopy(model), tok, cfg), SFTTrainer(copy.deepcopy(model), tok, cfg)
    rng = random.Random(a.seed)
    batches = [[enc[rng.randrange(len(enc))] for _ in range(a.batch)] for _ in range(a.steps)]
    t_packed, t_padded, real, slots = [], [], 0, 0
    for i, b in enumerate(batches):
        t = time.perf_counter()
        packed.step(b)
        dt_packed = time.perf_counter() - t
        t = time.perf_counter()
        padded_step(padded, b)
        dt_padded = time.perf_counter() - t
        lens = [len(p) + len(r) for p, r in b]
        real, slots = real + sum(lens), slots + len(lens) * max(lens)
        if i >= a.warmup:
            t_packed.append(dt_packed)
            t_padded.append(dt_padded)
    with torch.no_grad():
        diff = max(float((p - q).abs().max()) for p, q in zip(packed.policy.parameters(), padded.policy.parameters()))
    pk, pd = statistics.median(t_packed), statistics.median(t_padded)
    print(json.dumps({"packed_step_s": round(pk, 4), "padded_step_s": round(pd, 4), "speedup": round(pd / pk, 3),
                      "padding_frac": round(1 - real / slots, 3), "mean_example_tokens": round(real / (a.batch * a.steps), 1),
                      "max_param_diff": diff, "steps_timed": len(t_packed), "batch": a.batch, "threads": a.threads,
                      "preset": a.preset}))


if __name__ == "__main__":
    main()
