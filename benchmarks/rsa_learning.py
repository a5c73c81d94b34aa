"""Markovian RSA in miniature (issue 15, part 4): does RL on aggregation prompts teach a tiny policy to
aggregate its own candidates?

    python benchmarks/rsa_learning.py                       # defaults: toy/max difficulty 2, seeds 0,1,2, --jobs 2
    python benchmarks/rsa_learning.py --seeds 0 --jobs 1 --trace   # one seed, progress on stderr
    python benchmarks/rsa_learning.py --fraction 0.5 --rl-steps 80   # another share of aggregation prompts

Prints ONE JSON line per seed on stderr (every figure for both policies), then ONE summary line on stdout: medians over seeds
``agg.single_acc``, ``agg.majority_acc``, ``agg.rsa_acc``, ``agg.rsa_acc_no_rescue``, ``ablation.*`` (also
``*.rsa_majority_acc``, ``*.pass_at_n``), ``rsa_gain_points`` (agg rsa - agg single, points; per seed too, and
``rsa_gain_points_min``, the min over seeds), ``rsa_gain_points_no_rescue`` (agg rsa_acc_no_rescue - agg single;
per seed and min too), ``rsa_vs_ablation_points`` (agg rsa - ablation rsa; per seed, and ``_min``) and
``goal_met``: the median over seeds of the per-seed ``rsa_gain_points_no_rescue`` >= 10 and the median over
seeds of the per-seed ``rsa_vs_ablation_points`` > 0 (medians of per-seed differences, not differences of
medians). ``goal_met_with_rescue`` is the same test on ``rsa_gain_points``.

``rsa_acc`` grades the final round as RSA returns it: a final-round trace cut at beta gets ``force_answer``
and up to ``final_budget`` more tokens (the rescue), while round 0 (``single_acc``, ``majority_acc``) is graded
as it stopped at beta, with no rescue, so ``rsa_gain_points`` leans toward RSA. ``rsa_acc_no_rescue`` grades
each final-round trace's text as it was at beta (``Candidate.text``, kept beside the rescued
``final_text``), as round 0 is: no extra generation. ``final_rescued`` counts the final-round traces that got
the rescue. Since this change ``goal_met`` tests ``rsa_gain_points_no_rescue``; before it, the figures below
tested ``rsa_gain_points`` (what ``goal_met_with_rescue`` now gives).

Per seed (one process each, ``--jobs`` at once; one intra-op thread): a fresh ``tiny-dense`` policy is
SFT'd on the task's reference traces (a fixed think block, then ``The answer is \\boxed{d}.``: about 24
tokens with EOS, chat template on) until sampled accuracy on a probe of training problems reaches 0.2, as in
``benchmarks/learning.py``. From that one start, two RL runs with the same budget (100 steps x 16 prompts x
8 rollouts; maxrl, dppo_tv, Muon lr 2e-3; response cap = RSA's beta):

- ``agg``: a ``cascade.aggregation.AggregationMixer`` (fraction 0.75, C = 4 tails of tau tokens) wired as
  stage 3 wires it (``problem_hook=mixer.mix``, ``rollout_hook=mixer.remember``): that share of the sampled
  problems become aggregation prompts showing tails of the policy's own earlier rollouts of the problem;
- ``ablation``: the same mixer with fraction 0 (it makes no aggregation prompt).

Then 64 held-out problems (disjoint by prompt from the SFT data and the RL stream: learning.py's
``held_out_problems`` plus a swap hook) go through ``ttc.rsa.MarkovianRSA`` on an ``EngineBackend`` over
the policy's engine: N=8, C=4, T=2, beta=28 tokens, tau=6 tokens (a tail keeps `` is \\boxed{d}.`` and
drops the think block and the rest of the ~24-token trace), final-answer budget 8. ``single_acc`` is round
0's mean accuracy over its N samples (one sample at T=1), ``majority_acc`` the majority vote over round 0's
N, ``rsa_acc`` the mean accuracy over the final round's N; ``round1_shown_a_correct_tail`` is the share of
round-1 aggregation prompts of which at least one shown tail was right (what a perfect picker would score in
round 1). One ``Template`` object makes the training prompts (mixer) and RSA's: its ``solve`` is the bare
problem (the env prompt as RL trains on it; the built-in templates add instructions RL never saw) and its
``aggregate``/``candidate`` are ``compact`` (the math template's structure in fewer words: 148 tokens for
C=4 instead of 338; ``--template math`` keeps the built-in wording). ``tests/test_rsa_learning.py`` checks
that both paths give the policy the same token ids.

Task: ``toy/max`` at difficulty 2 (the largest of 4 digits). Checking is easier than producing where it
matters to an aggregator: every candidate answers with a digit of the list, so the largest of the C shown
answers is right whenever any one of them is; choosing the largest of 4 boxed answers is a smaller problem
than the task and needs nothing the task does not. After the warm-up the policy is partly right and its
samples disagree (after RL, round-0 pass@8 0.656-0.938 against single 0.334-0.824 below), so there is
room to aggregate.

Figures are accuracies on the 64 held-out problems; "r1" is round 1's accuracy and "r1 ceiling" its
perfect-picker bound; "cut" counts RSA traces (of 64 x 8 x 3 = 1,536) that hit beta.

Measured on 2026-12-03 (2-core CPU, commit 08a6f4d: the SFT warm-up packs its examples since 0af2c6d,
which changes the SFT start; defaults, ``--jobs 2``: 797 s wall, 398 / 507 / 391 s per seed; that seed 2 ran
with an engine change not kept, so it was run again alone at 08a6f4d: 403 s, the same figures; trajectories depend on the machine's
float kernels, and other CPUs and earlier commits gave other figures, in git history):

| seed | agg single | agg maj. | agg rsa | agg r1 / ceiling | agg cut | abl. single | abl. maj. | abl. rsa | abl. cut |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 0 | 0.508 | 0.562 | 0.615 | 0.631 / 0.639 | 15 | 0.824 | 0.828 | 0.690 | 77 |
| 1 | 0.721 | 0.734 | 0.713 | 0.719 / 0.830 | 1 | 0.787 | 0.828 | 0.002 | 1022 |
| 2 | 0.334 | 0.344 | 0.354 | 0.346 / 0.654 | 4 | 0.565 | 0.641 | 0.275 | 0 |

``rsa_gain_points`` +10.7 / -0.8 / +1.9 (median +1.9, min -0.8); ``rsa_vs_ablation_points`` -7.4 /
+71.1 / +7.8 (median +7.8, min -7.4); ``goal_met`` false (the goal is RSA over the policy's own
single sample: median +10). Re-run at 216bf09 (2026-12-04: the trainer verifies through ``envs.verify_all``,
router-replay ids moved to the model's device; defaults, 763 s wall): every seed's ``rsa_gain_points`` and
``rsa_vs_ablation_points`` the same (+10.7 / -0.8 / +1.9, median +1.9; -7.4 / +71.1 / +7.8, median +7.8). Re-run at d634d38
(2026-12-04: the trainer skips routing replay with vLLM servers, a no-op here; defaults, 632 s wall): the same
figures again, seed by seed. At ff81563 (SFT on padded batches; the previous session's machine) the same
seeds gave ``rsa_gain_points`` -12.5 / +19.9 / +1.0 and against the ablation +11.7 / +50.0 / +13.5; at
e925322 median -3.1 (min -46.3) and +2.3 (min +0.4). Re-run at 0fbd5d7 (2026-12-05, another machine; the RL
update's metrics read once per step, its loss denominators counted on the host: the same values; defaults, 531 s
wall): agg single / maj. / rsa / r1 / r1 ceiling / cut 0.420 / 0.531 / 0.529 / 0.525 / 0.561 / 98, 0.609 / 0.719 /
0.000 / 0.000 / 0.834 / 549, 0.293 / 0.297 / 0.264 / 0.277 / 0.533 / 0; ablation single / maj. / rsa / cut 0.824 /
0.828 / 0.455 / 480, 0.688 / 0.719 / 0.098 / 128, 0.531 / 0.641 / 0.418 / 5. ``rsa_gain_points`` +10.9 / -60.9 /
-2.9 (median -2.9, min -60.9), ``rsa_vs_ablation_points`` +7.4 / -9.8 / -15.4 (median -9.8, min -15.4): on this
machine seed 1's agg policy ran 549 of its 1,536 RSA traces to beta and answered none, the picture of the
ablation's seed 1 above; seed 0 again picks (+10.9). Re-run at 6ebe7cf (2026-12-05, later: the engine's sampler
checks for penalties, none here; defaults, 509 s wall): every seed's figures the same as at 0fbd5d7. Re-run at 6f000cc
(the sampler's min_tokens / logit_bias, none here; defaults, 489 s wall): the same again (``rsa_gain_points`` +10.9 /
-60.9 / -2.9, median -2.9, min -60.9; ``rsa_vs_ablation_points`` +7.4 / -9.8 / -15.4, median -9.8, min -15.4).
Re-run at 6cb2d68 (2026-12-06; defaults; 866 s wall, two orphaned processes of an interrupted run sharing the cores
for part of it): every seed's figures the same again. Re-run at 7a3c8b6 (2026-12-06, later: empty boxes skipped, the
trainer's metrics and LR stepping, none of which moves these runs; defaults, 497 s wall): the same again.
Re-run at 9ee55d4 (2026-12-06, later: aggregation tails leave out any end id and a multi-byte character's remnant at
their front, trimming keeps the longest common length; and the fairer grading above; ``--jobs 1``, 765 s): seeds 0 and
1 and every ablation the same as at 0fbd5d7; seed 2's agg policy now differs (single / maj. / rsa / rsa no rescue /
r1 / r1 ceiling / cut / rescued 0.275 / 0.266 / 0.072 / 0.250 / 0.285 / 0.607 / 859 / 337; which of the tail changes
moved it was not isolated: the ablation, which makes no aggregation prompt, is unchanged). ``rsa_gain_points`` +10.9 /
-60.9 / -20.3 (median -20.3, min -60.9); without the rescue (``rsa_gain_points_no_rescue``, the goal's figure now)
+10.9 / -60.9 / -2.5 (median -2.5, min -60.9): on seed 2 the forced answer of 337 cut traces took rsa from 0.250 to
0.072, the rescue hurting, not flattering. ``rsa_vs_ablation_points`` +7.4 / -9.8 / -34.6 (median -9.8, min -34.6).
``goal_met`` false.
Re-run at 2ca2976 (2026-12-06, later: a trace whose ``<think>`` is never closed has no answer, in grading and in the
SFT probe, so every seed's SFT start moved; defaults, 484 s wall): agg single / maj. / rsa (= no rescue) / r1 / r1
ceiling / cut 0.619 / 0.688 / 0.672 / 0.676 / 0.688 / 34, 0.600 / 0.688 / 0.000 / 0.000 / 0.801 / 92, 0.301 / 0.344 /
0.287 / 0.318 / 0.574 / 0; ablation single / rsa 0.826 / 0.670, 0.686 / 0.000, 0.285 / 0.070 (cut 227, 688, 1,519).
``rsa_gain_points_no_rescue`` +5.3 / -60.0 / -1.4 (median -1.4, min -60.0; with the rescue the same);
``rsa_vs_ablation_points`` +0.2 / 0.0 / +21.7 (median +0.2, min 0.0). ``goal_met`` false: on seed 1 both policies'
round 1 answered nothing right although a shown tail was right 80% of the time.
Re-run at 86b25b7 (2026-12-06, later: the off-policy losses' gradient through the log-probs, the verifiers' changes,
the no-rescue grading read after a thinking block the template opens (none here); defaults, 536 s wall, alone): agg
single / maj. / rsa / rsa no rescue / r1 0.555 / 0.609 / 0.518 / 0.523 / 0.543, 0.549 / 0.656 / 0.344 / 0.342 / 0.404,
0.301 / 0.344 / 0.287 / 0.287 / 0.318; ablation single / rsa 0.684 / 0.330, 0.656 / 0.197, 0.277 / 0.109.
``rsa_gain_points_no_rescue`` -3.1 / -20.7 / -1.4 (median -3.1, min -20.7; with the rescue -3.7 / -20.5 / -1.4);
``rsa_vs_ablation_points`` +18.7 / +14.6 / +17.8 (median +17.8, min +14.6). ``goal_met`` false.
Re-run at 6f90c2d (2026-12-07, another machine: aggregation prompts take a buffered problem of the drawn problem's
own environment (one environment here), ttc's prompt text encoded whole between the tails, Delethink's carry, the
limiters; defaults, 589 s wall, alone but for a short test run): agg single / maj. / rsa / rsa no rescue 0.385 / 0.453
/ 0.346 / 0.426, 0.631 / 0.656 / 0.715 / 0.715, 0.480 / 0.594 / 0.570 / 0.572; ablation single / rsa 0.809 / 0.186,
0.846 / 0.027, 0.293 / 0.000. ``rsa_gain_points_no_rescue`` +4.1 / +8.4 / +9.2 (median +8.4, min +4.1; with the
rescue -3.9 / +8.4 / +9.0); ``rsa_vs_ablation_points`` +16.0 / +68.8 / +57.0 (median +57.0, min +16.0). ``goal_met``
false (+10 over its own single sample: no seed reaches it, all three above 0 for the first time).
Re-run at 55cd2fd (2026-12-07, a later session, the same machine: toy's answer forms re-landed at 613793d, aggregation grading; beside a
tiny cascade run and review helpers, 803 s wall): every figure above again (the same per-seed gains, +8.4 median, min
+4.1; +57.0 / +16.0 over the ablation).
Re-run at 6003712 (2026-12-08, a later session: the engine checks an interrupt event once per decoding step, the
verifier workers forked from one thread, neither on this toy/max path's arithmetic; defaults, 587 s wall, alone): every
figure again (``rsa_gain_points_no_rescue`` +4.1 / +8.4 / +9.2, median +8.4, min +4.1; +57.0 / +16.0 over the ablation).

Why the goal is not met (what the figures say; the bullets are the 08a6f4d run's, and the later runs above add one
pattern: at 0fbd5d7 and 2ca2976 seed 1's agg policy also answered nothing right in round 1, 0.000 against single
0.609 and 0.600, so reading aggregation prompts is not learnt reliably either):

- Training on aggregation prompts teaches the policy to *read* them: the ablation, never trained on
  such prompts, loses on them on every seed (rsa 0.002-0.690 against its single 0.565-0.824; on seed 1
  1,022 of 1,536 traces ran to beta), while the agg policy's round 1 answers them at least as well as
  plain problems (0.631 / 0.719 / 0.346 against single 0.508 / 0.721 / 0.334) at 08a6f4d.
- Picking from them happened on one seed: on seed 0 round 1 (0.631, its perfect-picker ceiling 0.639)
  and RSA (0.615) beat single (0.508) and majority (0.562), +10.7 points. On seeds 1 and 2 a shown
  tail was right far more often than round 1 was (ceiling 0.830 and 0.654 against 0.719 and 0.346):
  the policy answers an aggregation prompt about as it answers the bare problem, without choosing
  the largest shown answer. Seed 2's RL barely took off (agg reward 0.23 -> 0.32 over the run).
- The aggregation share is paid for in single-sample accuracy: the ablation, all of whose RL went to
  plain problems, ends at single 0.824 / 0.787 / 0.565 against the agg policy's 0.508 / 0.721 / 0.334.
  1,629-1,874 aggregation prompts of reward alone are little for a 0.8M-parameter policy.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root before benchmarks/ (envs.py)

from benchmarks.learning import (  # noqa: E402
    fresh_policy_and_sft, held_out_problems, sft_until, shared_args, unseen_hook)


def make_template(name: str):
    """The RSA template of both training (AggregationMixer) and evaluation (MarkovianRSA).

    ``solve`` is the bare problem: the env's prompt (which carries its ``\\boxed{}`` instruction) is
    exactly what RL trains on, so RSA's round 0 samples the policy as RL left it. ``math``: the
    built-in math template's aggregate and candidate texts (186 + 4 x 35 template tokens with the
    tiny tokenizer); ``compact``: the same structure in fewer words (cheaper on 2 CPU cores)."""
    from ttc.templates import MATH

    if name == "math":
        return replace(MATH, name="math-bare-solve", solve="{problem}").check()
    if name == "compact":
        return replace(MATH, name="compact", solve="{problem}", candidate="Candidate: {tail}\n",
                       aggregate=("{problem}\n\nCandidate answers (any may be wrong):\n{candidates}"
                                  "Check them and give the correct answer within \\boxed{{}}.")).check()
    raise ValueError(f"unknown --template {name!r}; choose from compact, math")


def _mean(xs):
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else None


def _r(xs):
    m = _mean(xs)
    return None if m is None else round(m, 4)


def rsa_eval(engine, tok, held, args, template) -> dict:
    """Markovian RSA on every held-out problem: single-sample accuracy (round 0's mean over N),
    majority vote over round 0's N, and RSA's accuracy (mean over the final round's N)."""
    from ttc.backends import EngineBackend
    from ttc.rsa import MarkovianRSA, RSAConfig, extract_answer

    cfg = RSAConfig(population=args.population, aggregate=args.aggregate, rounds=args.rounds, budget=args.budget,
                    tail=args.tail, final_budget=args.final_budget, seed=args.seed + 5)
    rsa = MarkovianRSA(EngineBackend(engine, tok), cfg, template, grader="exact")
    fmt = rsa.template.answer_format
    single, major, final, final_major, pass_n, round1, reach, cut, gen = [], [], [], [], [], [], [], 0, 0
    final_plain, rescued = [], 0
    for _, p in held:
        gold = str(p.answer)
        r = rsa.run(p.prompt, gold=gold, problem_key=p.prompt)
        m = r.metrics
        single.append(m["round_accuracy"][0])
        major.append(m["round_majority_accuracy"][0])
        final.append(m["mean_accuracy"])
        # the final round graded as round 0 is: each trace as it stopped at beta, before any rescue
        # (force_answer + final_budget tokens), which RSA keeps in ``text`` beside ``final_text``
        # (read as RSA reads answers: after a thinking block the template opened, none inside one left open)
        final_plain.append(_mean(rsa.grader(extract_answer(rsa.think_open + c.history_text + c.text, fmt), gold)
                                 for c in r.final))
        rescued += sum(c.final_text is not None for c in r.final)
        final_major.append(m["majority_accuracy"])
        pass_n.append(m["round_pass_at_k"][0][str(args.population)])
        if args.rounds:
            round1.append(m["round_accuracy"][1])
            # the ceiling of a perfect picker in round 1: some of the C tails it was shown was right
            reach.append(_mean([any(r.rounds[0][j].correct for j in c.parents) for c in r.rounds[1]]))
        cut += sum(c.finish_reason == "length" for rnd in r.rounds for c in rnd)
        gen += m["generated_tokens"]
    return {"single_acc": _r(single), "majority_acc": _r(major), "rsa_acc": _r(final),
            "rsa_acc_no_rescue": _r(final_plain),
            "rsa_majority_acc": _r(final_major), "pass_at_n": _r(pass_n), "round1_acc": _r(round1),
            "round1_shown_a_correct_tail": _r(reach),
            "cut_at_budget": cut, "final_rescued": rescued, "generated_tokens": gen}


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from cascade.aggregation import AggregationMixer
    from envs.base import get_env
    from envs.curriculum import Curriculum
    from train.engine import TorchEngine
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig

    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.trace else (lambda *a: None)
    template = make_template(args.template)
    env = get_env(args.env)
    held = held_out_problems(env, args.difficulty, args.held_out, args.seed)
    reserved = {p.prompt for p in held}
    held = [(args.env, p) for p in held]
    keep_held_out_unseen = unseen_hook(env, reserved, args.seed + 2)

    def rl_config():
        return RLConfig(group_size=args.group_size, prompts_per_step=args.prompts_per_step, advantage="maxrl",
                        loss="dppo_tv", chat_template=True, micro_batch_size=args.group_size * args.prompts_per_step,
                        sampling=SamplingConfig(max_new_tokens=args.budget),
                        optim=OptimConfig(lr=args.lr, warmup_steps=args.rl_warmup, name="muon", muon_momentum=0.0),
                        seed=args.seed)

    def curriculum():
        return Curriculum([args.env], controller="fixed", seed=args.seed,
                          controller_kwargs={"difficulty": args.difficulty})

    t0 = time.perf_counter()
    # 1. the common start: a fresh tiny policy, SFT on reference traces (a fixed think block, then the
    # boxed answer) until sampled accuracy on training problems reaches --sft-target
    model, tok, sft, enc, _ = fresh_policy_and_sft(args, reserved, chat=True, think=True)
    probe_rl = RLTrainer(model, tok, TorchEngine(copy.deepcopy(model), tok), curriculum(), rl_config())
    probe = keep_held_out_unseen([(args.env, env.generate(10**11 + args.seed * 10**6 + i, args.difficulty))
                                  for i in range(args.probe)])
    sft_steps, probe_acc, _ = sft_until(sft, enc, args, probe_rl, probe, log)
    start = copy.deepcopy(model.state_dict())
    t_sft = time.perf_counter() - t0
    del probe_rl

    # 2. two RL runs from that start, the same budget (steps x prompts x group): with aggregation
    # prompts built from the policy's own rollouts' tails (as stage 3), and without (the ablation:
    # the same mixer, fraction 0)
    out = {"benchmark": "rsa_learning", "env": args.env, "difficulty": args.difficulty, "seed": args.seed,
           "sft_steps": sft_steps, "sft_probe_accuracy": round(probe_acc, 4)}
    for name, fraction in (("agg", args.fraction), ("ablation", 0.0)):
        if name not in args.policies:
            continue
        t1 = time.perf_counter()
        model.load_state_dict(start)
        policy = copy.deepcopy(model)
        engine = TorchEngine(copy.deepcopy(policy), tok)
        mixer = AggregationMixer(tok, fraction, args.aggregate, args.tail, template=template, seed=args.seed + 6)

        def hook(picks, mixer=mixer):
            return mixer.mix(keep_held_out_unseen(picks))

        split = {"agg": [], "plain": []}  # rewards on aggregation prompts and on plain problems

        def remember(groups, mixer=mixer, split=split):
            for g in groups:
                split["agg" if g.problem.meta.get("aggregation") else "plain"].extend(g.rewards)
            mixer.remember(groups)

        rl = RLTrainer(policy, tok, engine, curriculum(), rl_config(), problem_hook=hook, rollout_hook=remember)
        rl.sync_weights()
        rewards = []
        for i in range(args.rl_steps):
            m = rl.step()
            rewards.append(m["reward_mean"])
            if args.trace and (i + 1) % args.trace_every == 0:
                mr = {k: sum(v[-400:]) / max(len(v[-400:]), 1) for k, v in split.items()}
                log(f"seed {args.seed} {name} RL step {i + 1}: reward {m['reward_mean']:.3f} "
                    f"(recent plain {mr['plain']:.3f}, aggregation {mr['agg']:.3f}) "
                    f"aggregation prompts {mixer.made} ({time.perf_counter() - t1:.1f}s)")
        t_rl = time.perf_counter() - t1
        ev = rsa_eval(engine, tok, held, args, template)
        k = max(1, min(10, len(rewards) // 2))
        out[name] = {**ev, "aggregation_prompts": mixer.made, "aggregation_fraction": fraction,
                     "rl_reward_first10": round(sum(rewards[:k]) / k, 4) if rewards else None,
                     "rl_reward_last10": round(sum(rewards[-k:]) / k, 4) if rewards else None,
                     "seconds_rl": round(t_rl, 1), "seconds_eval": round(time.perf_counter() - t1 - t_rl, 1)}
        log(f"seed {args.seed} {name}: {out[name]}")
    if "agg" in out:  # per seed; the summary line has them per seed too
        a = out["agg"]
        out["rsa_gain_points"] = round(100 * (a["rsa_acc"] - a["single_acc"]), 1)
        out["rsa_gain_points_no_rescue"] = round(100 * (a["rsa_acc_no_rescue"] - a["single_acc"]), 1)
    out.update({"rl_steps": args.rl_steps, "prompts_per_step": args.prompts_per_step, "group_size": args.group_size,
                "held_out_problems": len(held), "template": args.template,
                "rsa": {"N": args.population, "C": args.aggregate, "T": args.rounds, "budget": args.budget,
                        "tail": args.tail, "final_budget": args.final_budget},
                "seconds_sft": round(t_sft, 1), "seconds": round(time.perf_counter() - t0, 1)})
    return out


def _run_seed(args, seed: int) -> dict:
    return run(argparse.Namespace(**{**vars(args), "seed": seed}))


def run_seeds(args) -> list[dict]:
    """One fresh process per seed (``--jobs`` at once; in this process when --jobs 1); prints each
    seed's JSON line in seed order, on stderr."""
    if args.jobs == 1:
        results = []
        for s in args.seeds:
            results.append(_run_seed(args, s))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # per seed; stdout: the summary
        return results
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(args.seeds)), mp_context=ctx,
                             max_tasks_per_child=1) as pool:
        futures = [pool.submit(_run_seed, args, s) for s in args.seeds]
        results = []
        for f in futures:
            results.append(f.result())
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # per seed; stdout: the summary
    return results


FIGURES = ("single_acc", "majority_acc", "rsa_acc", "rsa_acc_no_rescue", "rsa_majority_acc", "pass_at_n")


def summarize(results: list[dict], seconds: float) -> dict:
    med = lambda xs: round(statistics.median(xs), 4)  # noqa: E731
    out = {"benchmark": "rsa_learning_seeds", "env": results[0]["env"], "difficulty": results[0]["difficulty"],
           "seeds": [r["seed"] for r in results], "statistic": "median over seeds"}
    for pol in ("agg", "ablation"):
        for f in FIGURES:
            out[f"{pol}.{f}"] = med([r[pol][f] for r in results])
    gain = [100 * (r["agg"]["rsa_acc"] - r["agg"]["single_acc"]) for r in results]
    plain = [100 * (r["agg"]["rsa_acc_no_rescue"] - r["agg"]["single_acc"]) for r in results]
    vs = [100 * (r["agg"]["rsa_acc"] - r["ablation"]["rsa_acc"]) for r in results]
    out.update({"rsa_gain_points": round(statistics.median(gain), 1),
                "rsa_gain_points_min": round(min(gain), 1),
                "rsa_gain_points_per_seed": [round(g, 1) for g in gain],
                "rsa_gain_points_no_rescue": round(statistics.median(plain), 1),
                "rsa_gain_points_no_rescue_min": round(min(plain), 1),
                "rsa_gain_points_no_rescue_per_seed": [round(g, 1) for g in plain],
                "rsa_vs_ablation_points": round(statistics.median(vs), 1),
                "rsa_vs_ablation_points_min": round(min(vs), 1),
                "rsa_vs_ablation_points_per_seed": [round(v, 1) for v in vs]})
    # medians over seeds of the per-seed differences; the gain graded without the final round's rescue,
    # as round 0 is (goal_met_with_rescue: the same test on the rescued rsa_acc, goal_met before this change)
    out["goal_met"] = bool(out["rsa_gain_points_no_rescue"] >= 10 and out["rsa_vs_ablation_points"] > 0)
    out["goal_met_with_rescue"] = bool(out["rsa_gain_points"] >= 10 and out["rsa_vs_ablation_points"] > 0)
    out["seconds_wall"] = round(seconds, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared_args(ap, difficulty=2, seeds=[0, 1, 2], rl_steps=100, lr=2e-3, held_out=64)
    ap.add_argument("--template", default="compact", choices=["compact", "math"])
    ap.add_argument("--fraction", type=float, default=0.75, help="share of RL prompts turned into aggregation prompts")
    ap.add_argument("--population", type=int, default=8, help="RSA N")
    ap.add_argument("--aggregate", type=int, default=4, help="RSA C (also the tails per training aggregation prompt)")
    ap.add_argument("--rounds", type=int, default=2, help="RSA T")
    ap.add_argument("--budget", type=int, default=28, help="RSA beta (also RL's max_new_tokens)")
    ap.add_argument("--tail", type=int, default=6, help="RSA tau (also the training tails' tokens)")
    ap.add_argument("--final-budget", type=int, default=8)
    ap.add_argument("--policies", default="agg,ablation", help=argparse.SUPPRESS)  # exploring: one policy only
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit("rsa_learning.py: error: --jobs must be >= 1")
    t0 = time.perf_counter()
    results = run_seeds(args)
    print(json.dumps(summarize(results, time.perf_counter() - t0)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
