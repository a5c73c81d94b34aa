"""One RL update step on the sharded core (a DP x TSP mesh of gloo ranks) vs the same step in one process.

The batch is what an RL step trains on: ``--rollouts`` rollouts (default 64) drawn as
benchmarks/train.py draws them (total lengths log-normal, median 256, clipped to 32 .. 2048; prompts of
16 .. 96 tokens), or with ``--prompt N`` every prompt N tokens long (long system prompts or few-shot
examples: the regime where prompt tokens, which the LM head skips, are most of the batch). Packed into
micro-batches of ``--budget`` tokens (``trainer.tokens_per_micro``). The policy is a small dense model
(hidden 128, 2 layers, vocabulary ``--vocab``, default 8192: the LM head is much of the work, as in
real policies whose vocabularies are 150K wide).

Two runs from the same weights, on the same cores: the mesh of ``--dp`` x ``--tsp`` ranks (one intra-op
thread each: ``trainer.nproc=dp*tsp trainer.tsp=tsp``; default TSP D=2), and the same ``RLUpdater`` in
one process with as many threads (``trainer.nproc=1``). Each takes ``--steps`` steps (the first
untimed); seconds are wall clock around ``step()`` measured here, the slowest rank's, the ranks
starting together.

Prints one JSON line: ``tokens`` (trained, prompt + completion), ``scored_tokens`` (completion tokens:
the LM head runs only on these), ``ranks_step_s`` and ``single_step_s`` (medians of the warm steps,
with every warm step listed), ``ranks_tok_s``, ``single_tok_s`` and ``ranks_vs_single`` (the
single-process step time over the mesh's: above 1 means the ranks are faster on these cores), and
``max_param_diff``: the largest difference between the two runs' weights after their steps.

    python benchmarks/rl_step.py                    # TSP D=2 against one process with 2 threads
    python benchmarks/rl_step.py --prompt 512       # prompt tokens most of the batch
    python benchmarks/rl_step.py --tsp 1 --dp 2     # plain data parallel (ZeRO-1) on 2 ranks
    python benchmarks/rl_step.py --arch zaya        # ZAYA1's layers (CCA, top-1 experts) on TSP D=2

Measured on this project's 2-core CPU (2026-12-03, defaults: 64 rollouts, vocab 8192, budget 4096; two
runs of each setting, interleaved with the same script on commit 3d2b6e2, whose TSP LM head ran on every
position, prompt tokens included, where the single-process trainer already skipped them; the machine was
busy enough that the same setting moved by up to 25% between runs):

| batch | tokens (scored) | TSP step s | TSP step s at 3d2b6e2 | one process s | ranks_vs_single |
| --- | --- | --- | --- | --- | --- |
| default (prompts 16..96) | 26,005 (22,341) | 7.68, 7.10 | 8.26, 8.69 | 4.61, 5.11 | 0.60, 0.72 |
| ``--prompt 512`` | 55,109 (22,341) | 10.11, 12.55 | 18.49, 18.21 | 5.42, 7.22 | 0.54, 0.58 |

Running the TSP LM head on completion positions only made the TSP step 1.45-1.83x faster with long
prompts and 1.08-1.22x with short ones (pairs of runs above, commit 099dc61).

Re-run at 69fad46 (2026-12-06, a faster machine; the TSP LM head's rows now chosen on the host, its shard
statistics padded into place): default TSP D=2 4.90, 4.97 s against 2.79, 2.93 s in one process
(``ranks_vs_single`` 0.57, 0.59); ``--prompt 512`` 6.96 s against 3.58 s (0.52). Re-run at bcfdc2d (2026-12-06,
later; default, one run): 4.30 s (4.06-4.39) against 2.92 s (2.89-2.94) in one process, ``ranks_vs_single`` 0.68.
Re-run at c9a84d9 (2026-12-06, later: RLUpdateConfig's ratio check shared with RLConfig; default, one run): 4.88 s
(4.34-4.94) against 2.88 s (2.87-2.90), ``ranks_vs_single`` 0.59. Re-run at 86b25b7 (2026-12-06, later: the off-policy
losses' gradient through the log-probs; default, one run, alone): 5.08 s against 3.07 s, ``ranks_vs_single`` 0.61.

Plain data parallel on the same cores (``--tsp 1 --dp 2``, commit 146e6d5 plus this script's ``--dp``,
three runs interleaved with two of the default TSP D=2): ``ranks_vs_single`` 1.21, 1.37, 1.15 (DP step
4.05-4.65 s against 4.85-5.54 s in one process), TSP D=2 0.57 and 0.64 in the same session. On CPU cores
DP is the layout that pays: each rank runs half the rollouts on its own core, where one process's two
intra-op threads scale poorly on this model's small matrices.

ZAYA1's layers at the same width (``--arch zaya``: CCA with its halo exchange, 4 experts top-1; runs
interleaved with the dense default): at commit 595fea3 plus this flag, TSP D=2 step 6.81, 7.58 s against
4.44, 4.86 s in one process, ``ranks_vs_single`` 0.65, 0.64 (dense 0.62 in the same session); at 6ae6d3a
(query and KV bundles broadcast separately, so that ranks can share a KV head) 8.67, 6.72 s against 4.65,
4.29 s, 0.54, 0.64 (dense 0.65 between them). The halo (max(K, 1) = 2 tokens per chunk per layer) costs
no more than the ratio's noise.

Re-run at 4aaf4ad (TSP attention refactored into one ``_attend`` shared with zaya; one run each, in
this order): default TSP D=2 8.56 s against 5.49 s (0.64), ``--tsp 1 --dp 2`` 4.24 s against 5.49 s
(1.29), ``--prompt 512`` TSP 12.82 s against 7.19 s (0.56), default again 7.84 s against 4.97 s (0.63),
``--arch zaya`` 9.15 s against 5.22 s (0.57): inside the ranges above. Re-run at 5e45654 (RLUpdater's
buffer names, the balancing rule's no-token case, the reference step skipping dropped rollouts; one run
each): ``--arch zaya`` 10.49 s against 6.74 s (0.64), default 9.67 s against 6.33 s (0.66), ``--tsp 1 --dp 2``
5.57 s against 6.80 s (1.22): inside the ranges above. Re-run at 9d0c4d7 (``TrainSample.trained``; one run,
default): TSP D=2 9.11 s against 5.67 s (0.62), inside the range. Re-run at fd54a0c (the same code as 9d0c4d7
for these steps; three runs of ``--tsp 1 --dp 2``, two of ``--arch zaya``, interleaved): ``--tsp 1 --dp 2``
4.99, 4.90, 5.33 s against 5.25, 5.63, 5.88 s (1.05, 1.15, 1.10: below the earlier 1.15-1.37, the one-process
step this time as fast as the ranks'), ``--arch zaya`` 9.02, 9.46 s against 6.23, 6.63 s (0.69, 0.70: above
the earlier 0.54-0.65; the same setting moved by up to 25% between runs on this machine before). Re-run at
799e832 (the router's load count weights padding 0 instead of masking it out; two runs of ``--arch zaya``): 6.84,
6.06 s against 4.50, 4.60 s (0.66, 0.76), both sides faster than at fd54a0c on the same code for everything else. Re-run
at dd837b4 (the ZeRO-1 master slice built per parameter: construction only, outside the timed steps), one run
each: default TSP D=2 6.40 s against 4.40 s (0.69), ``--arch zaya`` 7.19 s against 4.77 s (0.66). Re-run at
f6aed24 (the loss metrics summed on the device and read once per step) on another machine, interleaved with
dc6f21e (before that change): default TSP D=2 5.51, 5.62, 5.81 s against 3.16, 3.28, 3.41 s (0.57, 0.58, 0.59),
dc6f21e 5.80, 5.66 s against 3.28, 3.36 s (0.57, 0.59); ``--tsp 1 --dp 2`` 3.06, 3.05 s against 3.51, 3.58 s
(1.15, 1.17), dc6f21e 3.09, 3.01 s against 3.45, 3.10 s (1.12, 1.03): no change the noise shows. At 0fbd5d7
(the same counts through ``losses.loss_count``), one run each: TSP D=2 5.58 s against 3.42 s (0.61), ``--tsp 1
--dp 2`` 3.12 s against 3.38 s (1.08). At 6f000cc (RLUpdater takes ``ratio_against``; the behaviour path unchanged),
one run, default: TSP D=2 5.25 s against 3.22 s (0.61). At 9a464f0 (2026-12-06: a batch without a loss token skips
the optimizer step, none here; a machine ~30% slower than the last), one run, default: TSP D=2 7.29 s against 3.83 s
(0.53). At 63c8932 (2026-12-06, later, another machine; ``max_param_diff`` now reported: the mesh's and the
one process's weights after the same 4 steps within 5.6e-07), one run, default: TSP D=2 5.87 s against 3.99 s (0.68).
At bb5e338 (2026-12-07, another machine; the load now reported, 1.54), one run, default: 7.99 s against 4.86 s (0.61),
weights within 5.6e-07.

TSP is a memory layout first (each rank holds 1/D of the weights and activations, see
benchmarks/parallel.py); on 2 CPU cores it pays for its weight ring with gloo transfers that one
process does not make, so ``ranks_vs_single`` below 1 is expected here.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def make_batch(a):
    """benchmarks/train.py's rollouts (its module is loaded by path: its name is the ``train`` package's)."""
    import importlib.util
    import random

    from train.rl.exchange import TrainBatch, TrainSample

    spec = importlib.util.spec_from_file_location("bench_train", Path(__file__).with_name("train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rng = random.Random(a.seed + 1)
    samples = []
    for p, c, adv in bench.make_rollouts(a.rollouts, a.vocab, 32, 2048, 256.0, 1.0, a.seed):
        if a.prompt:
            p = [rng.randrange(3, a.vocab) for _ in range(a.prompt)]
        samples.append(TrainSample(p, c, [-9.0] * len(c), adv, True))
    return TrainBatch(0, samples)


def make_model(a):
    from train.model.config import ModelConfig
    from train.model.modeling import CausalLM

    shape = dict(vocab_size=a.vocab, hidden_size=128, num_hidden_layers=2, head_dim=32, num_attention_heads=4,
                 num_key_value_heads=2)
    if a.arch == "zaya":  # ZAYA1's layers at the same width: CCA, 4 experts top-1 (+ skip), router width 32
        cfg = ModelConfig(architecture="zaya", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=256,
                          router_hidden_size=32, partial_rotary_factor=0.5, **shape)
    else:
        cfg = ModelConfig(intermediate_size=256, **shape)
    return CausalLM(cfg).init_weights(0)


def timed_steps(up, batch, steps: int, barrier=None) -> list[float]:
    out = []
    for s in range(steps):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        up.step(batch, s)
        if barrier is not None:
            barrier()
        out.append(time.perf_counter() - t)
    return out[1:]  # the first step is a warm-up


def _rank(rank, world, port, a, q):
    import torch.distributed as dist

    from train.parallel.rl_update import RLUpdateConfig, RLUpdater

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        up = RLUpdater(make_model(a), RLUpdateConfig(tokens_per_micro=a.budget), tsp=a.tsp)
        ts = timed_steps(up, make_batch(a), a.steps, dist.barrier)
        full = up.full_state_dict(dst=0)  # (collective: every rank takes part)
        if rank == 0:
            q.put((ts, {k: v.numpy() for k, v in full.items()}))  # (numpy: pickled by value)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tsp", type=int, default=2, help="TSP degree (1: plain data parallel)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel degree (ranks: dp x tsp)")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=0, help="every prompt this many tokens (0: train.py's 16..96)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=("dense", "zaya"), default="dense",
                    help="the policy: a small Qwen3 dense model, or ZAYA1's layers at the same width")
    a = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from train.parallel.comm import free_port
    from train.parallel.rl_update import RLUpdateConfig, RLUpdater

    batch = make_batch(a)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)
    scored = sum(len(s.completion_ids) for s in batch.samples)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world = a.dp * a.tsp
    procs = [ctx.Process(target=_rank, args=(r, world, port, a, q)) for port in [free_port()] for r in range(world)]
    for p in procs:
        p.start()
    got = []
    while not got and any(p.is_alive() for p in procs):  # read before joining: rank 0's put of the weights blocks
        if not q.empty():                                 # until they are read (larger than a pipe's buffer)
            got.append(q.get())
        time.sleep(0.05)
    if not got and not q.empty():
        got.append(q.get())
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs) or not got:
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    mesh, mesh_weights = got[0]
    import torch.distributed as dist

    torch.set_num_threads(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        one = RLUpdater(make_model(a), RLUpdateConfig(tokens_per_micro=a.budget))
        single = timed_steps(one, batch, a.steps)
        one_weights = one.full_state_dict()
    finally:
        dist.destroy_process_group()
    t_mesh, t_one = statistics.median(mesh), statistics.median(single)
    print(json.dumps({
        "arch": a.arch, "tsp": a.tsp, "dp": a.dp, "rollouts": a.rollouts, "prompt": a.prompt, "vocab": a.vocab, "budget": a.budget,
        "tokens": tokens, "scored_tokens": scored,
        "ranks_step_s": round(t_mesh, 3), "ranks_steps_s": [round(x, 3) for x in mesh],
        "single_step_s": round(t_one, 3), "single_steps_s": [round(x, 3) for x in single],
        "ranks_tok_s": round(tokens / t_mesh, 1), "single_tok_s": round(tokens / t_one, 1),
        "ranks_vs_single": round(t_one / t_mesh, 3), "threads_single": world, "threads_per_rank": 1,
        # the two runs' weights after the same steps (the same arithmetic up to summation order)
        "max_param_diff": float(f"{max((torch.from_numpy(mesh_weights[k]) - v).abs().max().item() for k, v in one_weights.items()):.3g}"),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # (a loaded machine slows the 2-thread single run most)
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
