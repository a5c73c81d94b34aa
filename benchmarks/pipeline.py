"""Synchronous vs pipelined (PipelineRL) RL steps on CPU: does generation overlap training?

The same RL trainer (tiny-moe policy, toy/max prompts, ``maxrl`` + ``dppo_tv``, G=8 x 8 prompts,
48 new tokens, in-process torch engine) runs ``--steps`` steps twice from the same weights and
seed: once synchronously (``max_staleness=0``: generate, then train) and once pipelined
(``max_staleness=2``, ``min_ready_batches=2``, ``sync_every=1``: a producer thread generates the
next batches while the trainer updates). Steps per second are timed over the warm steps only
(after ``--warmup`` steps, which include the pipeline filling its buffer), wall clock around
``step()`` calls, measured here and not by the trainer.

Prints ONE JSON line: ``sync_steps_per_s``, ``async_steps_per_s``, ``async_speedup`` (their ratio),
``max_lag_seen`` (the largest version lag of any trained token), the mean rollout / trainer busy
fractions of the async run, the mean time of one rollout batch and one update in the sync run
(the overlap can at best hide the shorter of the two), and the threads used.

Both sides of every ceiling below are timed by this script the same way: wall clock around the
trainer's ``collect()`` (the rollout) and around its ``train_on()`` (the update, with the engine's
weight sync that follows it), in the synchronous run's warm steps (``sync_rollout_s``,
``sync_train_s``: wrappers on that trainer's two methods, inside its timed ``step()`` calls) and in the
split runs alike. Since this change ``sync_rollout_s`` and ``sync_train_s`` are these times; before it they
were the trainer's own ``time_rollout_s`` and ``time_train_s`` (the latter without the weight sync, which the
split side's update included), so the lending and any-mix ceilings below compared unlike times. The trainer's
figures are kept beside them as ``sync_rollout_s_reported`` and ``sync_train_s_reported``.

    python benchmarks/pipeline.py                 # torch threads = 2 (the machine's cores)
    python benchmarks/pipeline.py --threads 1     # both runs on one intra-op thread
    python benchmarks/pipeline.py --servers 1     # async rollouts on a `cascade serve` process

Also printed: ``async_threads`` (the pipeline's split of torch's threads: rollout, update) and three
ceilings measured on the synchronous trainer, each side timed alone on its share of the threads:
``overlap_ceiling``, the best a fixed split can do at this mix (sync step time / the longer of the two
sides alone); ``overlap_ceiling_lending``, the best any schedule can do at this mix (both sides on
their shares until the shorter ends, then the rest of the longer on all the threads:
:func:`lending_step`); and ``overlap_ceiling_any_mix``, the best at any rollout:update mix (1/a + 1/b,
a and b each side's speed-up from its share to all the threads: where both sides take equally long
alone).

The update borrows the rollout thread's share whenever the producer waits (train/rl/pipeline.py,
``Pipeline.lend_threads``), so the pipeline can beat ``overlap_ceiling`` (a fixed split) and at best
reach ``overlap_ceiling_lending``; no workload's mix on these cores beats ``overlap_ceiling_any_mix``.
The GIL is not what holds the overlap back: py-spy ``--gil`` (100 Hz) over a default run (2026-12-03)
found it held 1.3 s by the main thread's timed steps of both loops (about 15 s) and 0.85 s by the
producer thread: at most 2.1 s of the pipelined loop's ~7 s, so rollouts in another process would
free little.

Measured on this project's 2-core CPU (2026-12-02, another machine than the previous figures': its
synchronous steps are about half as fast, and run-to-run noise is large: the synchronous rate of one
setting varies by up to 1.5x between runs; 8 warm steps per run, commit 1317269). "no lending": the
same runs with train/rl/pipeline.py of commit dc20a80 (a fixed split), interleaved with these:

| setting | runs | async speedup | median, min | no lending: speedup (median, min) | overlap ceiling | ceiling, any mix | sync steps/s | async steps/s | rollout s / update s (sync) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 2 threads, 48 tokens (default) | 6 | 1.33, 1.37, 1.19, 1.27, 1.21, 0.89 | 1.24, 0.89 | 0.84, 0.80, 1.03, 0.96, 0.96, 1.00 (0.96, 0.80) | 0.91-1.09 | 1.39-1.71 | 1.49-2.04 | 1.81-2.39 | 0.13-0.19 / 0.35-0.48 |
| 2 threads, 256 tokens, 16 stop tokens | 6 | 1.07, 1.18, 1.73, 0.95, 1.35, 1.37 | 1.27, 0.95 | 1.15, 1.18, 1.39, 1.08, 1.38, 1.08 (1.17, 1.08) | 1.13-1.35 (3 runs) | 1.43-1.64 (3 runs) | 0.89-1.35 | 1.21-1.54 | 0.33-0.50 / 0.43-0.52 |
| 1 thread, 48 tokens (no split, nothing to lend) | 3 | 1.32, 1.19, 1.38 | 1.32, 1.19 | - | - | - | 1.27-1.63 | 1.76-1.94 | 0.16-0.19 / 0.46-0.59 |

Re-run on 2026-12-02 at commit f457256 on another machine (this session's: the trainer's arithmetic
unchanged, bitwise, since 1317269), default setting, 4 runs one after another: async speedup 0.88, 1.47,
1.01, 0.99 (median 1.00, min 0.88); sync steps/s 1.05-1.53, async 1.32-1.55; overlap ceiling 0.85-1.35;
ceiling at any mix 1.20-1.89; rollout s / update s (sync) 0.21-0.31 / 0.44-0.64. The synchronous
baseline's own rate moved 1.5x between runs, which moves the ratio as much as the pipeline does.
Re-run on 2026-12-03 at commit 5e45654 (the trainer skips rollouts without a loss token, which these
batches do not have: the same arithmetic), default setting, 3 runs one after another: async speedup 0.95,
1.07, 1.23 (median 1.07, min 0.95); sync steps/s 1.29-1.39, async 1.32-1.58; ceiling at any mix 1.44-1.84;
max_lag_seen 2.
Re-run on 2026-12-03 at commit 9d0c4d7 (the trainer's micro-batches now come from
``train.rl.packing.pack_micro_batches``: the same grouping), default setting, one run, part of it beside a
test run on the same cores (so both loops were slower than above): async speedup 1.28 (sync 0.745 steps/s,
async 0.951); overlap ceiling 2.03 and ceiling at any mix 2.78, inflated by that load on the timed-alone
sides; max_lag_seen 2. Not a figure for the goal: the three unloaded runs above are.

With the rollouts on a ``cascade serve`` process (``--servers 1``, one thread there, the trainer's two here;
commit 146e6d5, one run): async speedup 0.57 (sync 1.79 steps/s, async 1.01), the trainer busy 99.8% of
the time: three threads on two cores, and every step's version published through files for the server
to reload (``sync_every=1``), cost more than the overlap wins on this machine.
Re-run at 53d95e8 (2026-12-04; the server pool and the remote engine changed only around restarts and
closing), two runs: async speedup 0.44 and 0.40 (sync 2.20 and 1.97 steps/s, async 0.96 and 0.79), the
trainer busy 99.7-99.8%, max_lag_seen 2: the same picture.
Part of that was the server's own waste: the remote engine asked for ``"logprobs": 1``, and Cascade's server
answered the top-1 alternative of every token with a teacher-forced forward per choice, one sequence at a
time on the request's thread (71% of the server's time under py-spy); a 64-rollout batch took 0.60 s on
the 1-thread server against 0.13 s in-process on one thread (``RLTrainer.collect`` timed over 5-20 warm calls by a
script outside the repository, 2026-12-05). Since c52dc41 the engine asks for
``"logprobs": 0`` (the sampled tokens' only, all the trainer reads): 0.20 s. Three runs of each, interleaved
with c370969 (before it; 2026-12-05): async speedup 0.77, 0.71, 0.73 (async 1.80-1.90 steps/s, sync
2.47-2.58) against 0.44, 0.45, 0.45 (async 1.11-1.16, sync 2.52-2.60); the trainer still busy 99.5% of the
time, its update slowed by the server's thread on the same two cores; max_lag_seen 2. At 8dc48a5 (routed experts
over HTTP as int16 bytes in base64 instead of nested JSON lists: the batch 0.21 -> 0.16-0.17 s), 3 runs: 0.83, 0.81,
0.86 (async 2.13-2.19 steps/s, sync 2.54-2.64); the trainer busy 99.5%; max_lag_seen 2. At 4fa1ddc (after these: a
per-prompt ``max_tokens`` cap from the servers' context, servers in a process group of their own, the key by
environment), 3 runs: 0.92, 0.80, 0.77 (median 0.80, min 0.77; async 1.94-2.04 steps/s, sync 2.19-2.53); the trainer
busy 99.4%; max_lag_seen 2. At f4356a2 (the engine asks for the special tokens in the text, which the server then
takes as the engine decoded it), 3 runs: 0.83, 0.87, 0.83 (median 0.83, min 0.83; async 2.10-2.13 steps/s, sync
2.45-2.56); the trainer busy 99.2-99.5%; max_lag_seen 2. At 0fb5ec6 (the same requests), 2 runs: 0.82, 0.87 (async
2.00-2.02, sync 2.33-2.45); the trainer busy 99.4-99.5%; max_lag_seen 2. At 57116df (2026-12-05, later: the server
refuses a ``max_tokens`` above its context, one comparison per request), 3 runs: 0.81, 0.80, 0.79 (median 0.80, min
0.79; async 1.93-2.02, sync 2.44-2.49); the trainer busy 99.3%; max_lag_seen 2. At 9bbf71d (the remote engine's body
from ``completion_request``: every sampling field named, no penalties), 3 runs: 0.83, 0.84, 0.85 (median 0.84, min 0.83;
async 2.04-2.13, sync 2.41-2.56); the trainer busy 99.2-99.4%; max_lag_seen 2. At eb9ab54 (the engine samples with
vLLM's penalties when asked, the server refuses fields it does not implement: neither on these requests), 2 runs: 0.80,
0.88 (async 2.02-2.04, sync 2.32-2.53); the trainer busy 99.2-99.6%; max_lag_seen 2. At 2b5d4e6 (2026-12-07: the
server reads its unsupported boolean fields as flags; this script starts its server without ``--device``), 3 runs: 0.85,
0.69, 0.86 (median 0.85, min 0.69; async 1.42-1.92, sync 2.08-2.23); the trainer busy 99.6-99.7%; max_lag_seen 2.

With ``overlap_ceiling_lending`` (commit 8dc7021 plus this field, added in 1ff29ba; runs one after
another): default setting, async speedup 1.14, 0.88, 1.16 against a lending ceiling of 1.26, 1.12, 1.28 (any mix 1.51, 1.19,
1.51; rollout s / update s in the sync run 0.17-0.24 / 0.38-0.48); 256 tokens with 16 stop tokens, 0.94 and
1.71 against 1.32 and 1.60 (any mix 1.36, 1.67): in that second run the synchronous baseline was slow
(0.78 steps/s against 1.19 in the first, the rollout 0.68 s against 0.39), which lifts the ratio above
a ceiling taken from sides timed at other moments.

max_lag_seen 2 and no group dropped as stale in every run; the two sides of each run generate the
same response lengths (mean 47.1 of 48 tokens by default; 61.2 with 16 stop tokens and 256 new
tokens).

Re-run at d52fa63 (2026-12-04: the trainer verifies through ``envs.verify_all``, the pipeline counts evictions made
while the trainer waits; the same arithmetic), default setting, 3 runs one after another: async speedup 0.85, 1.04,
0.96 (median 0.96, min 0.85); sync steps/s 1.84-2.20, async 1.88-2.07; ``overlap_ceiling_lending`` 1.17, 1.27, 1.24;
ceiling at any mix 1.38-1.52; rollout s / update s (sync) 0.13-0.17 / 0.32-0.37; max_lag_seen 2.
Re-run at 686a1e4 (2026-12-04: router-replay ids moved to the model's device in the forward, a no-op here;
the same arithmetic), default setting, 3 runs one after another: async speedup 0.97, 0.93, 0.90 (median 0.93,
min 0.90); sync steps/s 1.75-1.99, async 1.56-1.84; ``overlap_ceiling_lending`` 1.15, 1.19, 1.18; ceiling at any
mix 1.25-1.36; max_lag_seen 2.
Re-run at 4a224e4 (2026-12-04: the trainer skips routing replay for engines that cannot record it, a no-op
in-process; the same arithmetic), default setting, 3 runs one after another: async speedup 1.13, 1.36, 0.91
(median 1.13, min 0.91); sync steps/s 1.42-2.13, async 1.92-2.00; ``overlap_ceiling_lending`` 1.26, 1.46, 1.14;
ceiling at any mix 1.24-2.05; max_lag_seen 2.
Re-run at 5db9c21 (2026-12-04, later: only the rollout servers' restart and close paths and the trainer ranks'
orphan check changed, none of them on this in-process path), default setting, 3 runs one after another: async
speedup 0.96, 0.84, 0.97 (median 0.96, min 0.84); sync steps/s 1.98-2.17, async 1.82-2.02;
``overlap_ceiling_lending`` 1.18, 1.07, 1.26; ceiling at any mix 1.12-1.54; rollout s / update s (sync)
0.13-0.15 / 0.33-0.35; max_lag_seen 2. Re-run at dba01df (the attention's varlen bound, CUDA-only; nothing else on
this path), 3 runs: async speedup 1.00, 0.87, 0.99 (median 0.99, min 0.87); sync 1.97-2.37 steps/s, async 1.98-2.09;
``overlap_ceiling_lending`` 1.29, 1.15, 1.17; max_lag_seen 2.
Re-run at f6aed24 (2026-12-05, another machine: the update's loss metrics summed as tensors and read once per
step instead of several ``float()`` per micro-batch), 3 runs interleaved with 3 of dc6f21e (before that change):
async speedup 1.08, 1.08, 1.07 (median 1.08, min 1.07; sync 2.29-2.36 steps/s, async 2.48-2.54;
``overlap_ceiling_lending`` 1.15-1.16) against dc6f21e's 1.01, 0.88, 0.97 (median 0.97, min 0.88; sync 2.39-2.54,
async 2.12-2.46; ceiling 1.13-1.15); max_lag_seen 2. Re-run at b8d992e (the single-process update counts its loss
denominators from the rollouts; nothing else on this path), 3 runs after the others: 0.96, 0.97, 1.13 (median 0.97;
sync 2.21-2.48, async 2.28-2.49; ceiling 1.16-1.17): f6aed24's lead over dc6f21e was this machine's noise. At
0fbd5d7 (the same counts through ``losses.loss_count``), 3 runs: 1.04, 1.06, 1.07 (median 1.06, min 1.04; sync
2.42-2.46, async 2.50-2.62; ceiling 1.15-1.16); max_lag_seen 2. At c52dc41 (2026-12-05; this path unchanged), 2 runs:
1.10, 1.01 (sync 2.40-2.59, async 2.62-2.63; ceiling 1.14-1.15, any mix 1.32-1.37); with ``OMP_WAIT_POLICY=ACTIVE``
(OpenMP threads spin instead of sleeping between regions) 0.85, 0.86: worse, the spinning side takes the other's core.
At 4fa1ddc (the pipeline only logs a lowered ``min_ready_batches``), 2 runs: 1.00, 1.05 (sync 2.50-2.53, async
2.54-2.61; ceiling 1.14-1.16, any mix 1.31-1.37); max_lag_seen 2.
At 0fb5ec6 (this path unchanged: the session's changes are in the servers, the remote engine and the weight group),
3 runs: 1.03, 0.99, 1.03 (median 1.03, min 0.99; sync 2.38-2.50, async 2.45-2.56; ceiling 1.13-1.15, any mix
1.29-1.37); max_lag_seen 2. At 9bbf71d (this path unchanged), 3 runs: 1.07, 1.09, 1.04 (median 1.07, min 1.04; sync
2.43-2.46, async 2.56-2.64; ceiling 1.15-1.17, any mix 1.35-1.39); max_lag_seen 2. At eb9ab54 (the engine's sampler
checks for penalties, none here; the stage's end and resume sync the engine, off this path), 3 runs: 1.06, 1.06, 1.05
(median 1.06, min 1.05; sync 2.45-2.50, async 2.60-2.64; ceiling 1.14-1.15, any mix 1.32-1.34); max_lag_seen 2.
At d9aab17 (2026-12-05, later: the pipeline takes an optional per-batch hook and batch count, unset here, and the
engine's sampler checks for min_tokens / logit_bias, none here), 6 runs: 1.04, 1.03, 1.00, then interleaved with
547e7ba (the code before) 1.14, 1.10, 1.10 against 1.01, 1.01, 1.05 (median 1.07, min 1.00; sync 2.41-2.55, async
2.50-2.81; ceiling 1.14-1.17, any mix 1.32-1.41); max_lag_seen 2: the same within this machine's noise.
At 6f000cc (the same in-process path; 3 runs): 1.04, 1.04, 1.07 (median 1.04, min 1.04; sync 2.51-2.64, async
2.61-2.76; ceiling 1.16, any mix 1.37-1.38); max_lag_seen 2.
At 9a464f0 (2026-12-06: the update moves each micro-batch's gradients into fp32 masters, a no-op in fp32, and its
grad_norm is the mean over optimizer steps; one session's machine ~30% slower than the last; 3 runs): 0.88, 1.02,
0.86 (median 0.88, min 0.86; sync 1.54-1.92 steps/s, async 1.36-1.81; ``overlap_ceiling_lending`` 1.22-1.32, any
mix 1.48-1.74; rollout s / update s (sync) 0.15-0.20 / 0.37-0.44); max_lag_seen 2.
At cc178f2 (2026-12-06, later: a step trains exactly its own batch, the producer buffering a batch's groups and
recording it in one critical section; alone, 3 runs): 1.04, 1.02, 0.94 (median 1.02, min 0.94; sync 2.47-2.53
steps/s, async 2.37-2.58; ``overlap_ceiling_lending`` 1.15, any mix 1.33-1.35; rollout s / update s (sync)
0.10-0.11 / 0.29-0.30); max_lag_seen 2, no group dropped as stale.

The goal (>= 1.5 against the best synchronous setting, here 2 threads) is not met: median 1.24 by
default and 1.27 with long-tailed responses (one run of twelve above 1.5). Lending the producer's
threads to the update lifted the default setting from a median 0.96 to 1.24, above the fixed
split's ceiling (0.91-1.09: by default the update takes about 2.5x the rollout, so with a fixed
split the rollout thread idles most of the time); with long-tailed responses, where the two sides
are closer, the difference (median 1.27 against 1.17) is inside the noise. At the default mix no
schedule on these cores reaches 1.5: ``overlap_ceiling_lending`` is 1.12-1.28, and the pipeline reaches
0.79-0.91 of it; the bound for a workload whose sides take equally long alone is
``overlap_ceiling_any_mix``, 1.19-1.71 over these runs (1.32-1.37 on the previous machine): each side
runs only part-faster on two cores than on one, and giving one core to each costs most of what
overlapping wins. One thread for both loops, a regime that flatters the overlap (its synchronous
baseline is slower than the 2-thread one), gives 1.32x.

Re-run at da569dd (2026-12-06, the trainer's LR stepping and metrics, not its arithmetic; defaults, three runs one after
another, alone): async_speedup 1.03, 1.09, 1.00 (median 1.03, min 1.00); sync 2.49-2.62 steps/s, async 2.55-2.71;
lending ceiling 1.14-1.17, any mix 1.29-1.37; max_lag_seen 2.
Re-run at a345f38 (2026-12-06, later: both sides of every ceiling timed by this script, 32a4206; the trainer's
arithmetic unchanged; defaults, three runs one after another, alone): async_speedup 1.07, 1.06, 1.12 (median 1.07, min
1.06); sync 2.71-2.80 steps/s, async 2.87-3.08; sync rollout 0.093-0.097 s and update 0.262-0.272 s as timed here
(the trainer's own 0.093-0.096 / 0.260-0.270: its update leaves out a ~2 ms weight sync); lending ceiling 1.14-1.16,
any mix 1.33-1.39; max_lag_seen 2. Re-run at c9a84d9 (2026-12-06, later: rollouts verified with the thinking a
template opens, "" here; three runs one after another, alone): async_speedup 1.11, 1.11, 1.06 (median 1.11, min
1.06); sync 2.79-2.88 steps/s, async 3.02-3.20; lending ceiling 1.17-1.19, any mix 1.40-1.46; max_lag_seen 2.
Re-run at 6cd3ff2 (2026-12-06, later: buffered groups tagged with their batch; alone): async_speedup 1.08, 1.06, 0.98,
then alternating with 5d14efe's code (the commit before the change) 1.11, 1.07, 1.02 against its 1.06, 0.98, 0.95 (the
same machine slower that hour than at c9a84d9); median 1.06, min 0.98 over the six; sync 2.60-2.71 steps/s, async
2.63-3.01; lending ceiling 1.14-1.18, any mix 1.33; max_lag_seen 2; no group dropped as stale.
Re-run at 86b25b7 (2026-12-06, later: CISPO/DPPO/GSPO's gradient through the log-probs past the ratio clamp, the loss
metric over mini-batches that updated, a republished version read again until settled; three runs one after
another, a short test run beside the first two for part of the time): async_speedup 1.18, 1.03, 1.09 (median 1.09,
min 1.03); sync 2.33-2.43 steps/s, async 2.50-2.76; lending ceiling 1.15-1.19, any mix 1.36-1.45.
Re-run at 63c8932 (2026-12-06, later, another machine (AMD EPYC), noisier: sync 1.95-2.49 steps/s between runs;
min_ready_batches capped at the batches the buffer holds, 4 here, so 2 as before; rollout_busy_frac counted over the
steps a batch spans): async_speedup 0.90, then alternating with 5cbf690's code (before today's changes) 1.03, 0.85
against its 1.01, 1.01: the same within this machine's noise (median 0.90, min 0.85 at 63c8932); lending ceiling
1.17, any mix 1.33; max_lag_seen 2, no group dropped as stale. Re-run at bb5e338 (2026-12-07, another machine; the
trainer's mismatch over every mini-batch when there are several, off this path's one; one run, alone): async_speedup
1.11 (1.81 against 1.63 steps/s), lending ceiling 1.26, any mix 1.48; max_lag_seen 2, none dropped as stale.
Re-run at a4aaf98 (2026-12-07, later, the same machine; nothing on this in-process path changed): 0.97, 0.98, 0.85
alone, then alternating with 885f2b8's code (bb5e338's, from a worktree) 1.00, 1.13 against its 1.13, 0.82: the same
within this machine's noise (median 0.98, min 0.85 at a4aaf98); lending ceiling 1.16-1.25; max_lag_seen 2, none
dropped as stale.
Re-run at bbe8685 (2026-12-07, later; alone, three runs): ``async_speedup`` 0.93, 0.91, 0.97 (median 0.93, min 0.91)
against lending ceilings 1.15, 1.17, 1.27.
Re-run at 2b5d4e6 (2026-12-07, a later session; rollout servers get the run's device, the server reads its unsupported
boolean fields as flags: neither on this in-process path; alone, three runs): 0.95, 0.92, 1.12 (median 0.95, min 0.92)
against lending ceilings 1.21, 1.18, 1.28; max_lag_seen 2.
Re-run at 6003712 (2026-12-08, a later session: closing the pipeline interrupts the engine's batch in flight, which
these timed steps never do; the engine checks the interrupt once per decoding step; alone, seeds 0, 1, 2): 1.03, 1.12,
1.07 (median 1.07, min 1.03; sync 1.99-2.12 steps/s, async 2.15-2.23) against lending ceilings 1.24, 1.29, 1.26 (any
mix 1.58-1.70); max_lag_seen 2. With ``--servers 1`` (the server started by envs.workers.spawn), one run: 0.87 (sync
1.92, async 1.67), the trainer busy 99.6%; max_lag_seen 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stop_ids(model_dir: Path, k: int) -> list[int]:
    """``k`` ordinary token ids (the highest ids that are not special tokens) to stop on: a random
    policy samples one of them with probability about k/V per token, so response lengths follow a
    geometric distribution (mean about V/k tokens, capped by ``--new-tokens``), the long tail of real
    RL rollouts."""
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok) - 1, -1, -1) if i not in special][:k]


def trainer(model_dir: Path, seed: int, new_tokens: int, engine=None, stop=(), **rl_kw):
    import copy

    from envs.curriculum import Curriculum
    from train.engine import TorchEngine
    from train.model.hf_io import load_pretrained
    from train.optim import OptimConfig
    from train.rl.trainer import RLConfig, RLTrainer, SamplingConfig
    from train.tokenizer import load_tokenizer

    model, tok = load_pretrained(model_dir), load_tokenizer(model_dir)
    cfg = RLConfig(group_size=8, prompts_per_step=8, advantage="maxrl", loss="dppo_tv", chat_template=False,
                   dynamic_sampling=False, sampling=SamplingConfig(max_new_tokens=new_tokens, stop_token_ids=list(stop)),
                   optim=OptimConfig(lr=1e-4), micro_batch_size=64, seed=seed, **rl_kw)
    cur = Curriculum(["toy/max"], controller="fixed", seed=seed, controller_kwargs={"difficulty": 1})
    return RLTrainer(model, tok, engine or TorchEngine(copy.deepcopy(model), tok), cur, cfg)


class SideTimes:
    """Wall clock of each ``collect()`` and each ``train_on()`` (which ends with the engine's weight
    sync) of trainer ``rl`` while installed, measured here: instance attributes in front of the two
    methods, which ``rl.step()`` then calls. ``close()`` takes them away."""

    def __init__(self, rl):
        self.rl, self.rollout, self.update = rl, [], []

        def timed_call(fn, into):
            def call(*args, **kw):
                t = time.perf_counter()
                out = fn(*args, **kw)
                into.append(time.perf_counter() - t)
                return out
            return call

        rl.collect = timed_call(rl.collect, self.rollout)
        rl.train_on = timed_call(rl.train_on, self.update)

    def close(self) -> None:
        del self.rl.collect, self.rl.train_on  # the class's methods again


def step_apart(rl, rollout_threads: int, update_threads: int) -> tuple[float, float]:
    """(rollout s, update s) of one synchronous step, the rollout on ``rollout_threads`` intra-op
    threads and the update on ``update_threads``, each alone on the machine; timed as
    :class:`SideTimes` times them (around ``collect()``, and around ``train_on()`` with its weight sync)."""
    import torch

    torch.set_num_threads(rollout_threads)
    t = time.perf_counter()
    groups, _ = rl.collect()
    t1 = time.perf_counter()
    torch.set_num_threads(update_threads)
    rl.train_on(groups)
    return t1 - t, time.perf_counter() - t1


def timed(step, steps: int, warmup: int) -> tuple[float, list[dict]]:
    ms = []
    for _ in range(warmup):
        ms.append(step())
    t = time.perf_counter()
    for _ in range(steps):
        ms.append(step())
    return steps / (time.perf_counter() - t), ms[warmup:]


def lending_step(r_share: float, u_share: float, r_all: float, u_all: float) -> float:
    """The shortest step two sides can take on these cores at this mix: each alone takes ``*_share``
    seconds on its share of the threads and ``*_all`` on all of them; both run together until the
    shorter ends, then the longer runs what is left of it on all the threads."""
    if r_share <= u_share:
        return r_share + (1 - r_share / u_share) * u_all
    return u_share + (1 - u_share / r_share) * r_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-tokens", type=int, default=0,
                    help="stop on this many ordinary token ids (long-tailed response lengths, mean about "
                         "vocab/k, capped at --new-tokens); 0: every response runs to --new-tokens")
    ap.add_argument("--servers", type=int, default=0,
                    help="async run's rollouts on this many `cascade serve` processes (1 thread each) instead of "
                         "a thread of this process")
    a = ap.parse_args()
    import torch

    from train.presets import init_model
    from train.rl.pipeline import Pipeline

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as d:
        init_model("tiny-moe", Path(d), seed=a.seed)
        stop = stop_ids(Path(d), a.stop_tokens) if a.stop_tokens else []
        sync = trainer(Path(d), a.seed, a.new_tokens, stop=stop)
        sides = SideTimes(sync)
        sync_sps, sync_ms = timed(sync.step, a.steps, a.warmup)
        sides.close()
        sync_r = statistics.mean(sides.rollout[a.warmup:])  # the warm steps, as sync_ms
        sync_u = statistics.mean(sides.update[a.warmup:])
        apart_r = apart_u = None
        if not a.servers and a.threads >= 2:
            # what overlap can give at best on these cores: each side alone on its share of the threads
            # (the split the pipeline uses), one after the other; the pipeline's step can be no shorter
            # than the longer of the two
            apart = [step_apart(sync, a.threads // 2, a.threads - a.threads // 2) for _ in range(a.steps)]
            apart_r, apart_u = (statistics.mean(x) for x in zip(*apart))
            torch.set_num_threads(a.threads)
        engine = None
        if a.servers:
            from cascade.rollout import ServedEngine, ServerPool

            (Path(d) / "exchange").mkdir()
            pool = ServerPool(a.servers, Path(d), Path(d) / "exchange", "bench", 1, Path(d) / "logs")
            engine = ServedEngine(pool.urls, Path(d) / "exchange", "bench", pool)
        rl = trainer(Path(d), a.seed, a.new_tokens, engine, stop=stop, max_staleness=2, min_ready_batches=2, sync_every=1)
        pipe = Pipeline(rl)
        try:
            async_sps, async_ms = timed(pipe.step, a.steps, a.warmup)
        finally:
            pipe.close()
            if engine is not None:
                engine.close()
    print(json.dumps({
        "sync_steps_per_s": round(sync_sps, 3), "async_steps_per_s": round(async_sps, 3),
        "async_speedup": round(async_sps / sync_sps, 3),
        "max_lag_seen": max(m["version_lag_max"] for m in async_ms),
        "async_rollout_busy_frac": round(statistics.mean(m["rollout_busy_frac"] for m in async_ms), 3),
        "async_trainer_busy_frac": round(statistics.mean(m["trainer_busy_frac"] for m in async_ms), 3),
        "sync_rollout_s": round(sync_r, 3), "sync_train_s": round(sync_u, 3),
        # the trainer's own figures, for reference only (time_train_s leaves out the weight sync)
        "sync_rollout_s_reported": round(statistics.mean(m["time_rollout_s"] for m in sync_ms), 3),
        "sync_train_s_reported": round(statistics.mean(m["time_train_s"] for m in sync_ms), 3),
        "sync_response_len_mean": round(statistics.mean(m["response_len"] for m in sync_ms), 1),
        "sync_truncated_frac": round(statistics.mean(m["truncated_frac"] for m in sync_ms), 3),
        "async_response_len_mean": round(statistics.mean(m["response_len"] for m in async_ms), 1),
        "groups_dropped_stale": sum(m["groups_dropped_stale"] for m in async_ms),
        "async_threads": list(pipe.threads) if pipe.threads else None,
        # the pipeline's best: one step per max(rollout alone, update alone) on their thread shares
        "split_rollout_s": round(apart_r, 3) if apart_r else None,
        "split_train_s": round(apart_u, 3) if apart_u else None,
        "overlap_ceiling": round(1 / sync_sps / max(apart_r, apart_u), 3) if apart_r else None,
        # the best at this mix when a side that is done lends its threads (Pipeline.lend_threads): both
        # sides on their shares until the shorter ends, the rest of the longer on all the threads
        "overlap_ceiling_lending": round(1 / sync_sps / lending_step(apart_r, apart_u, sync_r, sync_u), 3)
        if apart_r else None,
        # the best over any rollout:update mix (at the mix where both sides take equally long alone):
        # 1/a + 1/b, a and b each side's speed-up from its thread share to all the threads
        "overlap_ceiling_any_mix": round(sync_r / apart_r + sync_u / apart_u, 3) if apart_r else None,
        "steps": a.steps, "warmup": a.warmup, "threads": a.threads, "model": "tiny-moe",
        "rollouts_per_step": 64, "new_tokens": a.new_tokens, "stop_tokens": a.stop_tokens, "async_rollout_servers": a.servers,
    }))


if __name__ == "__main__":
    main()
