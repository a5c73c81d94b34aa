"""Does RL teach? A short SFT warm-up, then RL on a simple environment, on CPU with a fixed seed.

From a fresh ``init_model`` policy: SFT on the environment's reference answers for a few steps
(enough to learn the answer format, not the task), then RL (engine rollouts -> verifier -> group
advantages -> policy loss -> weight sync). Held-out accuracy is measured just before and just
after RL, so the gain is RL's alone.

Held-out problems are distinct problems (by prompt text) that training never sees: they are
removed from the SFT data, and a problem hook swaps any the RL curriculum draws for fresh ones.

Prints ONE JSON line over seeds 0-4 (``--seeds``; each seed in its own process, ``--jobs`` at once,
its full line on stderr): ``accuracy_before`` / ``accuracy_after`` (medians over seeds of the
``metric``: mean pass@1 of ``samples`` sampled answers per held-out problem at temperature 1), each
seed's figures, ``gain_median_points`` (goal >= 20) and ``gain_min_points`` (goal >= 10), ``goal_met``.
``--seed N`` runs one seed and prints its full line. Same seed, same numbers in ``--mode sync`` (one
intra-op thread; CPU); ``--mode async`` runs the pipelined trainer (train/rl/pipeline.py: a producer
thread generating up to ``--max-staleness`` 1 policy version ahead of the update), whose numbers depend
on thread timing.

    python benchmarks/learning.py                  # 5 seeds, 2 at a time: the recipe's RL as the cascade runs it
    python benchmarks/learning.py --mode async     # the same through PipelineRL (bounded staleness 1)
    python benchmarks/learning.py --seed 1 --trace # one seed, progress on stderr
    python benchmarks/learning.py --optim adamw --no-length-reward   # AdamW, no length reward

The recipe as the cascade runs it: maxrl advantages, the DPPO binary-TV loss against the behaviour
policy, Muon (momentum 0), ZAYA1's length reward (T_l 2 tokens, l_max the 10-token cap, c from 0.1 to 1.0
over the RL steps), 120 RL steps of 16 prompts x 8 at lr 1e-3 (5 warm-up steps). The SFT warm-up ends
every reference answer with the end-of-sequence token (train/sft.py, as TRL does), so rollouts stop
after ``\boxed{d}`` instead of running to the 10-token cap, and stops as soon as sampled accuracy on
training problems reaches 0.2 (the policy answers in the boxed format but mostly with a wrong digit),
which leaves RL the task itself to learn; stopping at 0.4 left some seeds after a long SFT plateau with
a near-greedy policy that RL barely moved.

Measured on 2026-12-02 (this session's fresh 2-core CPU, commit ff81563, defaults, ``--jobs 2``;
held-out sampled accuracy before -> after RL, 200 problems x 4 samples):

| mode | seed 0 | seed 1 | seed 2 | seed 3 | seed 4 | median gain | min gain | wall |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| sync  | 0.190 -> 0.473 (+28.2) | 0.163 -> 0.748 (+58.5) | 0.209 -> 0.758 (+54.9) | 0.165 -> 0.794 (+62.9) | 0.253 -> 0.903 (+65.0) | +58.5 | +28.2 | 221 s |
| async | 0.190 -> 0.510 (+32.0) | 0.163 -> 0.689 (+52.6) | 0.209 -> 0.739 (+53.0) | 0.165 -> 0.795 (+63.0) | 0.253 -> 0.903 (+65.0) | +53.0 | +32.0 | 217 s |
| sync at 5e45654 (2026-12-03, this session's machine, ``--jobs`` default) | 0.190 -> 0.501 (+31.1) | 0.163 -> 0.746 (+58.4) | 0.209 -> 0.750 (+54.1) | 0.165 -> 0.789 (+62.4) | 0.253 -> 0.898 (+64.5) | +58.4 | +31.1 | 330 s (a test run shared the cores part of it) |
| async at 5e45654 (same machine, alone) | 0.190 -> 0.495 (+30.5) | 0.163 -> 0.768 (+60.5) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.789 (+62.4) | 0.253 -> 0.859 (+60.6) | +60.5 | +30.5 | 270 s |
| sync at 0af2c6d (SFT packed; 2026-12-03, the same machine, alone) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 266 s |
| async at 0af2c6d (same machine, alone) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.901 (+64.8) | +60.8 | +32.5 | 277 s |
| sync at bf70bfd (``Pair`` refactor 9d0c4d7; beside a tiny cascade run), and again at d51fac0 (linear answer extraction; 282 s, tests beside it part of the time) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 407 s |
| async at bf70bfd (part beside that run) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.905 (+65.1) | +60.8 | +32.5 | 366 s |
| async at d51fac0 (alone) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.772 (+60.8) | 0.254 -> 0.904 (+65.0) | +60.8 | +32.5 | 252 s |
| sync at 216bf09 (2026-12-04; trainer verifying through ``envs.verify_all``, router-replay ids moved to the model's device) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 316 s |
| async at 216bf09 (alone) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.903 (+64.9) | +60.8 | +32.5 | 280 s |
| sync at 4a224e4 (2026-12-04, later: the trainer skips routing replay for engines that cannot record it; in-process the same) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 277 s |
| async at 4a224e4 (alone) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.903 (+64.9) | +60.8 | +32.5 | 203 s |
| sync at 5db9c21 (2026-12-04, later: nothing on this in-process path changed) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 212 s |
| async at 5db9c21 (alone) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.901 (+64.8) | +60.8 | +32.5 | 211 s |
| sync at 8db7fb9 (the varlen bound and the router load count: not on this CPU path) | +30.6 | +57.1 | +51.5 | +68.0 | +65.2 | +57.1 | +30.6 | 198 s |
| async at 8db7fb9 (alone) | +32.5 | +61.3 | +47.8 | +60.8 | +64.8 | +60.8 | +32.5 | 199 s |
| sync at 0fbd5d7 (2026-12-05, another machine; the update's metrics read once per step, its denominators counted from the rollouts), and identically at 9bbf71d, eb9ab54, 6f000cc, 6cb2d68, cc178f2, 485290f, 1e84d77, 2ca2976, 2ad1353 and 86b25b7 (2026-12-06; alone; at 2ca2976 an unclosed think block earns nothing; at 2ad1353 160 s; at 86b25b7, DPPO's gradient through the log-probs, 170 s) | 0.190 -> 0.480 (+29.0) | 0.163 -> 0.765 (+60.2) | 0.373 -> 0.690 (+31.8) | 0.165 -> 0.838 (+67.2) | 0.253 -> 0.913 (+66.0) | +60.2 | +29.0 | 151-208 s |
| async at 0fbd5d7 (alone), and identically at 4fa1ddc, 0fb5ec6, 9bbf71d, eb9ab54, 6f000cc, 6cb2d68, cc178f2, 485290f, 1e84d77, 2ca2976, 2ad1353 and 86b25b7 (2026-12-06; a step trains exactly its own batch; at 2ad1353 buffered groups carry their batch, 156 s; at 86b25b7 168 s) | 0.190 -> 0.506 (+31.6) | 0.163 -> 0.733 (+57.0) | 0.373 -> 0.691 (+31.9) | 0.165 -> 0.606 (+44.1) | 0.253 -> 0.889 (+63.6) | +44.1 | +31.6 | 150-204 s |
| sync at fc73bd7 (2026-12-07, on a machine like the one of 0af2c6d to 8db7fb9 (the same figures to the last digit as there): a step that trains nothing moves the length reward's c, dynamic sampling drops groups with no trained rollout; alone, 217 s) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 217 s |
| async at fc73bd7 (alone, 211 s; seed 4 0.900 against 0.901 at 5db9c21 and 0.903 at 4a224e4, the rest as there) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.900 (+64.6) | +60.8 | +32.5 | 211 s |
| sync at 7436fed (2026-12-07, later, the same machine as fc73bd7's: nothing on this path changed; a review helper beside it, 270 s) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 270 s |
| async at 7436fed (the same machine; under load: a tiny cascade and the test suite ran beside it, 396 s; its later seeds may have imported c9a38ee's toy parsing, which reads ``\boxed{3.}`` as 3; thread timing moved seed 3) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.751 (+58.6) | 0.254 -> 0.901 (+64.8) | +58.6 | +32.5 | 396 s |
| async at 1f9a5ae (the same machine, alone, 177 s: the code of HEAD at this session's end) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.773 (+60.8) | 0.254 -> 0.905 (+65.1) | +60.8 | +32.5 | 177 s |
| sync at 453038d (2026-12-07, a later session, the same machine: toy's answer forms (``\\boxed{3.}``, ``$3$``) re-landed at 613793d; beside a tiny cascade run and review helpers, 424 s) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 424 s |
| async at f5d719b (alone, 182 s: seed 3 0.751 as at 7436fed, whose later seeds had c9a38ee's toy parsing: that, not thread timing, moved seed 3) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.751 (+58.6) | 0.254 -> 0.904 (+65.0) | +58.6 | +32.5 | 182 s |
| sync at 6003712 (2026-12-08, a later session, alone, 185 s: the pipeline's close interrupts the engine, the engine checks that once per decoding step) | 0.190 -> 0.496 (+30.6) | 0.163 -> 0.734 (+57.1) | 0.209 -> 0.724 (+51.5) | 0.165 -> 0.845 (+68.0) | 0.254 -> 0.906 (+65.2) | +57.1 | +30.6 | 185 s |
| async at 6003712 (alone, 182 s) | 0.190 -> 0.515 (+32.5) | 0.163 -> 0.775 (+61.3) | 0.209 -> 0.686 (+47.8) | 0.165 -> 0.751 (+58.6) | 0.254 -> 0.906 (+65.2) | +58.6 | +32.5 | 182 s |
| async ``--max-staleness 2`` at f305a7d (2026-12-05, later; alone; version lag mean 1.50, seeds 1.22-1.64) | 0.190 -> 0.541 (+35.1) | 0.163 -> 0.763 (+60.0) | 0.373 -> 0.705 (+33.2) | 0.165 -> 0.766 (+60.1) | 0.253 -> 0.896 (+64.4) | +60.0 | +33.2 | 189 s |

(At e925322 on the previous session's machine: sync median +58.4, min +31.4; async +59.1 / +30.4; seed 2's
SFT warm-up ended there at 0.336 held-out, here at 0.209.)

The trajectories depend on the machine's float kernels: on other CPUs the same seeds gave other
figures (git history has them). A seed takes up to 78 s here (SFT, then RL); async trains on
rollouts 0.99 versions behind on average. Tiny policies
are chaotic across seeds: read these as five samples; ``--trace`` adds held-out evaluations during RL,
which shift the random streams, so traced runs give other (same-seed reproducible) numbers.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root before benchmarks/ (envs.py)


def held_out_problems(env, difficulty: int, n: int, seed: int) -> list:
    """``n`` distinct problems (by prompt) from seeds far from any training seed."""
    out, seen = [], set()
    i = 0
    while len(out) < n:
        p = env.generate(10**12 + seed * 10**6 + i, difficulty)
        i += 1
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
        if i > 100 * n:
            raise ValueError(f"{env.id} at difficulty {difficulty} has fewer than {n} distinct problems")
    return out


def unseen_hook(env, reserved: set[str], seed: int):
    """A problem hook that swaps any problem whose prompt is in ``reserved`` (the held-out set) for a
    fresh one of the same difficulty, so that training never sees a held-out prompt."""
    rng = random.Random(seed)

    def keep_held_out_unseen(picks):
        out = []
        for env_id, p in picks:
            while p.prompt in reserved:
                p = env.generate(rng.getrandbits(62), p.difficulty)
            out.append((env_id, p))
        return out

    return keep_held_out_unseen


def fresh_policy_and_sft(args, reserved: set[str], chat: bool, think: bool):
    """A fresh ``--preset`` policy and its tokenizer, an SFT trainer (AdamW at ``--sft-lr``) and the
    encoded reference answers of ``--env`` at ``--difficulty``, held-out prompts (``reserved``) left out.
    Returns (model, tokenizer, sft, encoded examples, the (prompt, response) pairs)."""
    from train.optim import OptimConfig
    from train.presets import init_model
    from train.sft import SFTConfig, SFTTrainer, reference_pairs

    with tempfile.TemporaryDirectory() as tmp:
        model, tok = init_model(args.preset, tmp, seed=args.seed)
    pairs = [pr for pr in reference_pairs([args.env], args.sft_examples, seed=args.seed + 1,
                                          difficulties=(args.difficulty,), think=think) if pr[0] not in reserved]
    sft = SFTTrainer(model, tok, SFTConfig(batch_size=args.sft_batch, micro_batch_size=args.sft_batch,
                                           chat_template=chat, seed=args.seed,
                                           optim=OptimConfig(lr=args.sft_lr, warmup_steps=5)))
    return model, tok, sft, sft.encode(pairs), pairs


def sft_until(sft, enc, args, rl, probe: list, log) -> tuple[int, float, dict]:
    """SFT on ``enc`` until sampled accuracy on ``probe`` (training problems, never held-out ones; through
    ``rl``'s engine, every ``--sft-check`` steps) reaches ``--sft-target`` (0: never), at most
    ``--sft-steps``. Returns (steps run, the last probe accuracy, the last step's metrics)."""
    m, acc, n = {}, 0.0, 0
    while n < args.sft_steps:
        m = sft.step(sft.sample_batch(enc))
        n += 1
        if args.sft_target and n % args.sft_check == 0:
            rl.sync_weights()
            acc = rl.evaluate(probe, n=2, greedy=False, seed=args.seed + 4)
            log(f"seed {args.seed} SFT step {n}: loss {m['sft_loss']:.3f} probe sampled {acc:.3f}")
            if acc >= args.sft_target:
                break
    return n, acc, m


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from envs.base import get_env
    from envs.curriculum import Curriculum
    from train.engine import TorchEngine
    from train.optim import OptimConfig
    from train.rl.shaping import LengthRewardConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.trace else (lambda *a: None)
    env = get_env(args.env)
    held = held_out_problems(env, args.difficulty, args.held_out, args.seed)
    reserved = {p.prompt for p in held}
    held = [(args.env, p) for p in held]

    model, tok, sft, enc, pairs = fresh_policy_and_sft(args, reserved, chat=False, think=False)

    keep_held_out_unseen = unseen_hook(env, reserved, args.seed + 2)

    engine = TorchEngine(copy.deepcopy(model), tok)
    cfg = RLConfig(group_size=args.group_size, prompts_per_step=args.prompts_per_step, advantage=args.advantage,
                   loss=args.loss, chat_template=False, micro_batch_size=args.group_size * args.prompts_per_step,
                   sampling=SamplingConfig(max_new_tokens=args.max_new_tokens),
                   optim=OptimConfig(lr=args.lr, warmup_steps=args.rl_warmup, name=args.optim,
                                     muon_momentum=args.muon_momentum), seed=args.seed,
                   # ZAYA1's length reward (eqs. 8-10): l_max = max_new_tokens, T_l 2 tokens for 10-token
                   # answers, c from 0.1 to 1.0 over the RL steps
                   length_reward=args.length_reward,
                   length_cfg=LengthRewardConfig(t_len=2, ramp_steps=args.rl_steps),
                   # --mode async: PipelineRL, rollouts up to max_staleness versions behind the update
                   max_staleness=args.max_staleness if args.mode == "async" else 0, sync_every=1,
                   min_ready_batches=1)
    curriculum = Curriculum([args.env], controller="fixed", seed=args.seed,
                            controller_kwargs={"difficulty": args.difficulty})
    rl = RLTrainer(model, tok, engine, curriculum, cfg, problem_hook=keep_held_out_unseen)

    def evaluate():
        return (rl.evaluate(held, n=args.samples, greedy=False, seed=args.seed + 3), rl.evaluate(held, greedy=True))

    # SFT until the policy is partly competent: sampled accuracy on a probe of *training* problems
    # (never the held-out ones) reaches --sft-target, checked every --sft-check steps.
    probe = keep_held_out_unseen([(args.env, env.generate(10**11 + args.seed * 10**6 + i, args.difficulty))
                                  for i in range(args.probe)])
    t0 = time.perf_counter()
    sft_steps, probe_acc, m = sft_until(sft, enc, args, rl, probe, log)
    t_sft = time.perf_counter() - t0
    rl.sync_weights()
    before = evaluate()
    log(f"after {sft_steps} SFT steps: loss {m.get('sft_loss', float('nan')):.3f} "
        f"sampled {before[0]:.3f} greedy {before[1]:.3f} ({t_sft:.1f}s)")
    t1 = time.perf_counter()
    rewards, lags = [], []
    pipe = None
    if args.mode == "async":
        from train.rl.pipeline import Pipeline

        pipe = Pipeline(rl)  # a producer thread generating ahead of the updates
    try:
        for i in range(args.rl_steps):
            m = pipe.step() if pipe is not None else rl.step()
            rewards.append(m["reward_mean"])
            lags.append(m.get("version_lag_mean", 0.0))
            if args.trace and (i + 1) % args.trace_every == 0:
                extra = ""
                if pipe is None:  # a held-out check would race the producer's engine in async mode
                    s, g = evaluate()
                    extra = f" held-out sampled {s:.3f} greedy {g:.3f}"
                log(f"RL step {i + 1}: reward {m['reward_mean']:.3f} dropped {m['groups_dropped']} "
                    f"entropy {m.get('entropy', 0):.3f}{extra} ({time.perf_counter() - t0:.1f}s)")
    finally:
        if pipe is not None:
            pipe.close()
    t_rl = time.perf_counter() - t1
    after = evaluate()
    k = max(1, min(5, len(rewards) // 2))
    return {
        "benchmark": "learning", "env": args.env, "difficulty": args.difficulty, "preset": args.preset,
        "seed": args.seed, "mode": args.mode, "optim": args.optim, "length_reward": args.length_reward,
        "version_lag_mean": round(sum(lags) / len(lags), 3) if lags else 0.0,
        "metric": f"sampled_pass@1_T1_n{args.samples}", "held_out_problems": len(held),
        "accuracy_before": round(before[0], 4), "accuracy_after": round(after[0], 4),
        "gain": round(after[0] - before[0], 4),
        "greedy_before": round(before[1], 4), "greedy_after": round(after[1], 4),
        "rl_reward_first5": round(sum(rewards[:k]) / k, 4) if rewards else None,
        "rl_reward_last5": round(sum(rewards[-k:]) / k, 4) if rewards else None,
        "sft_steps": sft_steps, "sft_probe_accuracy": round(probe_acc, 4), "sft_examples": len(pairs), "rl_steps": args.rl_steps,
        "advantage": args.advantage, "loss": args.loss, "rl_lr": args.lr, "group_size": args.group_size,
        "prompts_per_step": args.prompts_per_step, "threads": args.threads,
        "seconds_sft": round(t_sft, 1), "seconds_rl": round(t_rl, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds wants comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds wants distinct integers, got {text!r}")
    return seeds


def _run_seed(args, seed: int) -> dict:
    return run(argparse.Namespace(**{**vars(args), "seed": seed, "seeds": None}))


def run_seeds(args) -> list[dict]:
    """One fresh process per seed (``--jobs`` at once), so each seed's numbers equal a ``--seed`` run's.

    Prints each seed's JSON line in seed order as soon as it and the seeds before it are done."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(args.seeds)), mp_context=ctx,
                             max_tasks_per_child=1) as pool:
        futures = [pool.submit(_run_seed, args, s) for s in args.seeds]
        results = []
        for f in futures:
            results.append(f.result())
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def summarize(results: list[dict], seconds: float, goal_median: float = 20.0, goal_min: float = 10.0) -> dict:
    """The one line over seeds: median before/after accuracy, every seed's figures, and the median and
    minimum gain in points against the issue's goals (median >= 20, minimum >= 10)."""
    import statistics

    med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    gains = [round(100 * r["gain"], 1) for r in results]
    first = results[0]
    return {
        "benchmark": "learning", "mode": first["mode"], "env": first["env"], "difficulty": first["difficulty"],
        "preset": first["preset"], "optim": first["optim"], "length_reward": first["length_reward"],
        "advantage": first["advantage"], "loss": first["loss"], "metric": first["metric"],
        "held_out_problems": first["held_out_problems"], "rl_steps": first["rl_steps"],
        "seeds": [r["seed"] for r in results],
        "accuracy_before": med([r["accuracy_before"] for r in results]),
        "accuracy_after": med([r["accuracy_after"] for r in results]),
        "accuracy_before_per_seed": [r["accuracy_before"] for r in results],
        "accuracy_after_per_seed": [r["accuracy_after"] for r in results],
        "gain_points_per_seed": gains,
        "gain_median_points": round(statistics.median(gains), 1), "gain_min_points": min(gains),
        "goal": {"gain_median_points": goal_median, "gain_min_points": goal_min},
        "goal_met": statistics.median(gains) >= goal_median and min(gains) >= goal_min,
        "version_lag_mean": med([r["version_lag_mean"] for r in results]),
        "sft_steps_per_seed": [r["sft_steps"] for r in results],
        "seconds_per_seed_max": max(r["seconds"] for r in results), "seconds_wall": round(seconds, 1),
    }


def shared_args(ap: argparse.ArgumentParser, *, difficulty: int, seeds: list[int], rl_steps: int, lr: float,
                held_out: int) -> None:
    """The flags this benchmark and ``rsa_learning.py`` share (task, seeds, the SFT start, the RL budget,
    the held-out set, tracing); the defaults that differ between the two are arguments."""
    ap.add_argument("--preset", default="tiny-dense")
    ap.add_argument("--env", default="toy/max")
    ap.add_argument("--difficulty", type=int, default=difficulty)
    ap.add_argument("--seeds", type=_seed_list, default=seeds,
                    help=f"comma-separated seeds (default {','.join(map(str, seeds))}): each seed's line on stderr, "
                         "the summary on stdout")
    ap.add_argument("--jobs", type=int, default=2, help="seeds run at once, one process each (default 2: both cores)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for tiny models)")
    ap.add_argument("--sft-steps", type=int, default=400, help="most SFT steps")
    ap.add_argument("--sft-target", type=float, default=0.2,
                    help="stop SFT once sampled accuracy on training probe problems reaches this (0: never)")
    ap.add_argument("--sft-check", type=int, default=10)
    ap.add_argument("--probe", type=int, default=64, help="training problems in the SFT stop probe")
    ap.add_argument("--sft-examples", type=int, default=2000)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--rl-steps", type=int, default=rl_steps)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--rl-warmup", type=int, default=5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=held_out)
    ap.add_argument("--trace", action="store_true", help="progress on stderr")
    ap.add_argument("--trace-every", type=int, default=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared_args(ap, difficulty=1, seeds=[0, 1, 2, 3, 4], rl_steps=120, lr=1e-3, held_out=200)
    ap.add_argument("--seed", type=int, default=None, help="run this one seed (its full JSON line) instead of --seeds")
    ap.add_argument("--mode", default="sync", choices=["sync", "async"],
                    help="async: the pipelined trainer (PipelineRL) generating up to --max-staleness versions ahead")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--optim", default="muon", choices=["adamw", "muon"],
                    help="the RL optimizer (the cascade's Muon, momentum 0, by default; SFT: AdamW)")
    ap.add_argument("--muon-momentum", type=float, default=0.0)
    ap.add_argument("--length-reward", action=argparse.BooleanOptionalAction, default=True,
                    help="ZAYA1's length reward on the advantages, as the cascade runs (--no-length-reward: off)")
    ap.add_argument("--advantage", default="maxrl")
    ap.add_argument("--loss", default="dppo_tv")
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--samples", type=int, default=4, help="sampled answers per held-out problem")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit("learning.py: error: --jobs must be >= 1")
    if args.max_staleness < 1 and args.mode == "async":
        raise SystemExit("learning.py: error: --mode async needs --max-staleness >= 1")
    if args.seed is not None:
        print(json.dumps(run(argparse.Namespace(**{**vars(args), "seeds": None}))), flush=True)
        return 0
    t0 = time.perf_counter()
    results = run_seeds(args)
    print(json.dumps(summarize(results, time.perf_counter() - t0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
