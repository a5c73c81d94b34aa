"""Training throughput on an RL batch: Cascade's packed trainer step vs transformers' Qwen3-MoE with the
padded micro-batches a TRL-style trainer builds.

One RL batch of ``--rollouts`` sequences (prompt + completion) whose total lengths follow a
long-tailed distribution (log-normal, seeded, clipped to [``--min-len``, ``--max-len``]; the stats are
printed). One training step = per micro-batch: forward, per-token log-probs of the completion tokens,
the policy-gradient loss ``-(advantage * logprob)`` averaged over all completion tokens of the batch,
backward; then one AdamW step. Three implementations, all from the same checkpoint (a fresh
``--preset`` model by default) in fp32:

* ``train`` (Cascade, packed): micro-batches of at most ``--token-budget`` tokens by first-fit
  decreasing (:func:`train.rl.packing.pack_by_tokens`), one row each, :func:`packed_token_logprobs`
  (per-sequence causal attention, LM head + log-softmax on completion positions only, chunked).
* ``padded`` (Cascade, padded): ``--rows`` rollouts per micro-batch in batch order, right-padded to
  the longest, :func:`train.model.modeling.token_logprobs` with the attention mask.
* ``hf`` (transformers' ``Qwen3MoeForCausalLM``, its default attention and experts implementations):
  the same padded micro-batches, ``model(input_ids, attention_mask).logits`` then log-softmax + gather.

Tokens are counted as real (non-pad) prompt + completion tokens for every column. Each
implementation runs one untimed warm-up step, then they take turns for ``--repeats`` timed steps (so
load from other processes on a shared machine hits all alike); the median step is reported, with
every step listed and the median forward / backward / optimizer split of each. Ends with one JSON
line: ``train_tok_s``, ``hf_train_tok_s``, ``train_ratio`` (train / hf), ``padded_tok_s``,
``packed_vs_padded`` (train / padded), ``padding_frac`` (pad share of the padded micro-batches) and
the batch's length stats.

The implementations must compute the same loss. Before the warm-up (not timed), each one's loss on the
fresh weights is computed under ``no_grad`` (``fresh_loss``): ``warmup_loss_rel_diff_padded_vs_hf`` is
padded's against transformers' from these (train and padded share one model and optimizer, so padded's
warm-up step comes after train's update). ``warmup_loss_rel_diff_train_vs_hf`` compares the two warm-up
steps' losses (``warmup_loss``), both on the fresh weights.

    python benchmarks/train.py [--preset tiny-moe] [--rollouts 64] [--repeats 3] [--device cpu] [--threads 1]

Measured (CPU, 1 thread, 2 cores, load 1.0; tiny-moe, 64 rollouts, budget 8192; 2026-12-02, commit e6feb3e):
default (log-normal median 256, sigma 1: 18,460 tokens, p50 208, p90 682, max 1366, 64.5% of padded slots
are pad; 3 repeats each, 3 runs): train 10.3-10.5k tok/s, padded 2.55-2.65k, hf 2.57-2.73k; train_ratio
3.97, 3.84, 4.06 (median 3.97), packed_vs_padded 3.92, 3.96, 4.08. A narrow distribution (``--sigma 0.5``:
17,192 tokens, max 524, 37.9% pad; one run), labelled as the regime where packing has least to remove:
train 11.1k, padded 6.7k, hf 6.7k; train_ratio 1.66, packed_vs_padded 1.65.
Re-run on 2026-12-02 on another machine, about half as fast (defaults, ``--threads 1``, load 1.0), at
commit a98c40b (packing refactored into ``pack_row``, the same operations): train 5.7k tok/s, padded
1.41k, hf 1.45k, train_ratio 3.96, packed_vs_padded 4.09; and at 33fa95f (the chunked LM head through
``logit_stats``, the same arithmetic): train 6.4k, padded 1.53k, hf 1.35k, train_ratio 4.74,
packed_vs_padded 4.18 (one run each: hf's rate moved 7% between them). Re-run at fd54a0c (the packing of
the trainer's micro-batches shared with the SFT warm-up since 0af2c6d; this script's path computes the same):
train 6.1k, padded 1.45k, hf 1.30k, train_ratio 4.68, packed_vs_padded 4.18 (one run, load 1.1). Re-run at
686a1e4 (router-replay ids moved to the model's device in the forward; the varlen attention is CUDA-only, so the
same CPU arithmetic): train 5.4k, padded 1.40k, hf 1.33k, train_ratio 4.02, packed_vs_padded 3.82 (one run).
Re-run at 8ecffe5 (varlen attention only for head sizes FlashAttention takes: CUDA-only, the same CPU path):
train 7.7k, padded 1.80k, hf 1.77k, train_ratio 4.34, packed_vs_padded 4.28 (one run, load 0.94).
Packed costs about what padded costs per slot, so its gain is the padding it removes (plus the quadratic
attention over pad); in a profile of the earlier code's packed step, SDPA forward + backward was about a third of the time, GEMMs a
third. With 2 threads on the loaded box, small ops ran 40x slower (OpenMP waits), hence ``--threads 1``.

On a GPU (one H200, torch 2.11+cu130, transformers 5.17, 2026-12-04, commit dbed86a, one run each, via
``bash benchmarks/gpu.sh``): tiny-moe (``--repeats 5``) train 55.1k tok/s, padded 70.9k, hf 53.7k: train_ratio
1.03, packed_vs_padded 0.78; small-moe (57M parameters, ``--repeats 3``, 29,286 tokens) train 35.3k, padded
32.9k, hf 29.6k: train_ratio 1.19, packed_vs_padded 1.07. The GPU runs the pad slots nearly free at
these sizes, and the packed attention was one SDPA call per sequence (64 small launches per layer, each
way), so the CPU's ratio does not carry over in fp32. In bf16 (``--dtype bfloat16``, the same H200, the code of
d6556d8, which added the varlen path, one run): small-moe train 162.5k tok/s (steps 160.6-172.6k) with the
packed attention as one varlen FlashAttention call (``train.model.modeling.uses_varlen``), 151.2k
(133.9-152.1k) with one SDPA call per sequence (``CASCADE_VARLEN=0``, the same script run separately: 1.07x),
padded 98.6k, hf 66.6k: train_ratio 2.44, packed_vs_padded 1.65.

Re-run at da569dd (2026-12-06: packed rows also keep their scored positions on the host): train_ratio 3.96
(9.3k against transformers 2.3k tokens/s; padded Cascade 2.4k). Re-run at bcfdc2d (2026-12-06, later: the
optimizer picks embeddings by module, the same set for this model): train_ratio 3.79 (9.7k against 2.57k; padded 2.5k).
Re-run at c9a84d9 (2026-12-06, later; one run): train_ratio 4.04 (9.8k against 2.42k; padded 2.4k).
Re-run at 131d608 (2026-12-06, later; one run, the warm-up losses reported since): train_ratio 3.93 (8.0k against
2.04k; padded 2.06k); the warm-up step's loss -0.009763 for Cascade's packed step and for transformers (equal to the
printed 6 decimals; ``warmup_loss_rel_diff_train_vs_hf`` since the next commit). Re-run at 6e4e5fe (2026-12-06, later;
one run, alone): train_ratio 3.93 (9.0k against 2.28k; padded 2.28k); ``warmup_loss_rel_diff_train_vs_hf`` 2.6e-05.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def make_rollouts(n: int, vocab: int, min_len: int, max_len: int, median: float, sigma: float, seed: int):
    """(prompt ids, completion ids, advantage) per rollout; total lengths log-normal, clipped."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = int(min(max_len, max(min_len, round(rng.lognormvariate(math.log(median), sigma)))))
        P = min(L // 2, rng.randint(16, 96))
        ids = [rng.randrange(3, vocab) for _ in range(L)]
        out.append((ids[:P], ids[P:], rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.0)))
    return out


def length_stats(lengths: list[int]) -> dict:
    s = sorted(lengths)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return {"tokens": sum(s), "mean": round(sum(s) / len(s), 1), "min": s[0], "p50": q(0.5), "p90": q(0.9),
            "max": s[-1]}


class Step:
    """One timed training step of one implementation; ``split`` collects (fwd+loss, backward, optimizer) s."""

    def __init__(self, model, micro, opt, device):
        self.model, self.micro, self.opt, self.device = model, micro, opt, device
        self.split: list[tuple[float, float, float]] = []
        self.loss = None  # the last step's loss (a tensor: read outside the timing)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self) -> float:
        self.model.train()
        self._sync()
        t0 = time.perf_counter()
        fwd = bwd = 0.0
        total = 0.0
        for run in self.micro:
            a = time.perf_counter()
            loss = run()
            total = total + loss.detach()
            self._sync()
            b = time.perf_counter()
            loss.backward()
            self._sync()
            fwd, bwd = fwd + b - a, bwd + time.perf_counter() - b
        c = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        end = time.perf_counter()
        self.split.append((fwd, bwd, end - c))
        self.loss = total
        return end - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--median-len", type=float, default=256.0, help="median of the log-normal total length")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma (tail weight)")
    ap.add_argument("--rows", type=int, default=8, help="rollouts per padded micro-batch (TRL-style)")
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens per packed micro-batch")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per implementation; the median is reported")
    ap.add_argument("--only", default="train,padded,hf", help="comma-separated subset of train,padded,hf")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="parameters and activations of all three (bfloat16: on a GPU the packed attention is one "
                         "varlen FlashAttention call)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default). On a shared CPU box 2 threads measure "
                         "OpenMP waiting on descheduled threads (40x slower small ops at load 4 on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from train.batching import index_batch, make_batch, micro_batches
    from train.model.hf_io import load_pretrained
    from train.model.modeling import token_logprobs
    from train.presets import init_model
    from train.rl.packing import pack_by_tokens, packed_token_logprobs

    dev = torch.device(a.device)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    only = set(a.only.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / a.preset
        init_model(a.preset, model_dir, seed=a.seed)
        dtype = getattr(torch, a.dtype)
        ours = load_pretrained(model_dir, dtype=dtype).to(dev)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(dev) if "hf" in only else None
    cfg = ours.config
    rolls = make_rollouts(a.rollouts, cfg.vocab_size, a.min_len, a.max_len, a.median_len, a.sigma, a.seed)
    lengths = [len(p) + len(c) for p, c, _ in rolls]
    real_tokens = sum(lengths)
    n_completion = sum(len(c) for _, c, _ in rolls)
    stats = length_stats(lengths)
    print(f"batch: {a.rollouts} rollouts, lengths {stats}", file=sys.stderr)

    # packed micro-batches (Cascade)
    class Sample:  # what packed_token_logprobs reads from a sample
        def __init__(self, p, c):
            self.prompt_ids, self.completion_ids = p, c

    samples = [Sample(p, c) for p, c, _ in rolls]
    packs = pack_by_tokens(lengths, a.token_budget)

    def packed_micro(idx):
        adv = torch.tensor([rolls[i][2] for i in idx], device=dev)

        def run():
            lps = packed_token_logprobs(ours, [samples[i] for i in idx], return_entropy=False)
            return -sum((w * lp.sum()) for w, lp in zip(adv, lps)) / n_completion
        return run

    # padded micro-batches (TRL-style: fixed rows, right-padded to the longest of the micro-batch)
    batch = make_batch([p for p, _, _ in rolls], [c for _, c, _ in rolls], int(cfg.pad_token_id or 0)).to(dev)
    adv_all = torch.tensor([r[2] for r in rolls], device=dev)
    slices = micro_batches(len(rolls), a.rows)
    padded_slots = sum(len(range(*sl.indices(len(rolls)))) * max(lengths[sl]) for sl in slices)

    def padded_micro(sl, impl):
        b = index_batch(batch, sl)
        adv = adv_all[sl, None]

        def run():
            if impl == "hf":
                logits = hf(input_ids=b.input_ids, attention_mask=b.attention_mask.long(), use_cache=False).logits
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                lp = logp.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
            else:
                lp = token_logprobs(ours, b.input_ids, b.attention_mask)
            return -(adv * lp * b.loss_mask).sum() / n_completion
        return run

    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-6)
    steps = {}
    if "train" in only:
        steps["train"] = Step(ours, [packed_micro(mb) for mb in packs], opt_ours, dev)
    if "padded" in only:
        steps["padded"] = Step(ours, [padded_micro(sl, "ours") for sl in slices], opt_ours, dev)
    if "hf" in only:
        steps["hf"] = Step(hf, [padded_micro(sl, "hf") for sl in slices],
                           torch.optim.AdamW(hf.parameters(), lr=1e-6), dev)
    fresh_loss = {}
    with torch.no_grad():  # each implementation's loss on the fresh weights (not timed): they must agree
        for k, st in steps.items():
            st.model.train()  # (the mode its steps run in)
            fresh_loss[k] = float(sum(run() for run in st.micro))
    first_loss = {}
    for k, st in steps.items():  # warm-up, not timed; its loss checks the implementations compute the same
        t = st()
        st.split.clear()
        first_loss[k] = float(st.loss)
        print(f"warm-up {k}: {t:.2f} s", file=sys.stderr)
    runs: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(a.repeats):
        for k, st in steps.items():
            runs[k].append(real_tokens / st())
            print(f"round {r}: {k} {runs[k][-1]:.0f} tok/s ({real_tokens / runs[k][-1]:.2f} s)", file=sys.stderr)

    names = {"train": "train", "padded": "padded", "hf": "hf_train"}
    res = {"benchmark": "train", "model": a.preset, "params": sum(p.numel() for p in ours.parameters()),
           "device": str(dev), "dtype": a.dtype, "rollouts": a.rollouts, "real_tokens": real_tokens,
           "completion_tokens": n_completion,
           "lengths": stats, "length_dist": f"lognormal(median {a.median_len:g}, sigma {a.sigma:g}) "
                                           f"clipped to [{a.min_len}, {a.max_len}]",
           "token_budget": a.token_budget, "packed_micro_batches": len(packs), "rows": a.rows,
           "padded_micro_batches": len(slices), "padding_frac": round(1 - real_tokens / padded_slots, 3),
           # the warm-up step's loss of each implementation (train and padded share a policy: padded's follows
           # train's first update), and train's against transformers' (both on the fresh weights)
           "warmup_loss": {names[k]: round(v, 6) for k, v in first_loss.items()},
           # each implementation's loss on the fresh weights, before the warm-up (no_grad)
           "fresh_loss": {names[k]: round(v, 6) for k, v in fresh_loss.items()}}
    if "train" in first_loss and "hf" in first_loss:
        res["warmup_loss_rel_diff_train_vs_hf"] = float(
            f"{abs(first_loss['train'] - first_loss['hf']) / max(abs(first_loss['hf']), 1e-12):.2e}")
    if "padded" in fresh_loss and "hf" in fresh_loss:  # (from the fresh-weights losses: see the docstring)
        res["warmup_loss_rel_diff_padded_vs_hf"] = float(
            f"{abs(fresh_loss['padded'] - fresh_loss['hf']) / max(abs(fresh_loss['hf']), 1e-12):.2e}")
    for k, v in runs.items():
        res[f"{names[k]}_tok_s"] = round(statistics.median(v), 1)
        res[f"{names[k]}_runs_tok_s"] = [round(x, 1) for x in v]
        split = steps[k].split
        res[f"{names[k]}_split_s"] = {n: round(statistics.median(s[i] for s in split), 3)
                                      for i, n in enumerate(("fwd", "bwd", "opt"))}
    if "train" in runs and "hf" in runs:
        res["train_ratio"] = round(res["train_tok_s"] / res["hf_train_tok_s"], 2)
    if "train" in runs and "padded" in runs:
        res["packed_vs_padded"] = round(res["train_tok_s"] / res["padded_tok_s"], 2)
    if "padded" in runs and "hf" in runs:
        res["padded_vs_hf"] = round(res["padded_tok_s"] / res["hf_train_tok_s"], 2)
    if hf is not None:
        res["hf_attn_implementation"] = hf.config._attn_implementation
        res["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    res.update(torch_threads=torch.get_num_threads(), torch=torch.__version__,
               load_avg_1m=round(os.getloadavg()[0], 2))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
