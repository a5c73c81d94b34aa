"""Weight sync to rollout servers: versions as files vs broadcast over a process group.

A policy preset, ``--servers`` `cascade serve` processes (started as ``cascade run rollout.servers=N``
starts them), and the trainer side of each transport (:class:`cascade.rollout.ServedEngine`):

- ``files`` (``rollout.weight_transport=files``): the trainer publishes the version (safetensors write,
  sha256, fsync, completion marker), then every server reads it, re-hashes it and loads it;
- ``broadcast`` (``rollout.weight_transport=broadcast``): the trainer broadcasts the tensors over a
  gloo group in checksummed buckets and every server loads them; the durable files are written
  behind it on a background thread (``broadcast_files_done_s``: from the call until those files are
  complete).

Timed here, wall clock around ``load_weights(state_dict, version)``: the trainer's stall until every
server serves the version (both transports wait for all servers' answers). ``--repeats`` versions per
transport after one warm-up version each, alternating the transports so that drift hits both; each
version is new weights (perturbed), as in training.

The servers must serve the weights that were sent: after each load (outside the timing), every server
samples a few tokens (2 prompts, 4 tokens each, temperature 1, seed 0) and their log-probs as the server
records them are compared with a local model's holding the sent state dict (teacher-forced, fp32);
``served_logprob_max_abs_diff`` is the largest difference over versions (warm-up ones included), transports
and servers. Consecutive versions differ by 1e-3 in every weight, which moves these log-probs far more.

Prints ONE JSON line: ``files_sync_s`` and ``broadcast_sync_s`` (medians; min and max beside),
``sync_speedup`` (files / broadcast, of the medians; null when a broadcast fell back to files or the
log-prob check exceeds 1e-4), ``served_logprob_max_abs_diff``, the model's bytes, servers, preset.

    python benchmarks/weights.py                        # tiny-moe (6.6 MB), 2 servers
    python benchmarks/weights.py --preset small-moe     # 228 MB
    python benchmarks/weights.py --servers 1 --repeats 1   # a smoke test

Measured on this project's 2-core CPU (2026-12-02, a slower machine than the earlier figures in git history,
commit e925322, 2 servers, 5 warm versions per transport; tiny-moe 3 runs, small-moe 2 runs):

| preset | files_sync_s (median per run) | broadcast_sync_s | sync_speedup | files done behind |
| --- | --- | --- | --- | --- |
| tiny-moe (6.6 MB) | 0.036, 0.039, 0.033 | 0.047, 0.048, 0.031 | 0.75, 0.83, 1.04 | 0.050-0.072 s |
| small-moe (228 MB) | 0.85, 0.73 | 2.01, 0.98 | 0.42, 0.74 | 1.44-2.67 s |
| tiny-moe, at 2b5dded (2026-12-03) | 0.036, 0.033 | 0.036, 0.038 | 1.01, 0.87 | 0.056-0.057 s |
| small-moe, at 2b5dded | 0.59, 0.63 | 2.61, 1.46 | 0.23, 0.43 | 2.71-2.99 s |
| tiny-moe, at 6f2893e (2026-12-04: one push at a time, a catch-up re-forms the group) | 0.033, 0.034 | 0.049, 0.041 | 0.67, 0.83 | 0.065-0.070 s |
| tiny-moe, at c03259d (2026-12-04, later: reloads wait for a server when all are down, catch-ups loop to the newest) | 0.0253, 0.0255 | 0.0260, 0.0216 | 0.97, 1.18 | 0.037-0.044 s |
| tiny-moe, at e2e6beb (one ServedEngine class for Cascade's and vLLM's servers) | 0.0272, 0.0289 | 0.0231, 0.0273 | 1.18, 1.06 | 0.038-0.043 s |
| tiny-moe, at 53d95e8 (a closing pool restarts no server; a failed restart leaves the pool) | 0.0269, 0.0285 | 0.0271, 0.0236 | 0.99, 1.21 | 0.040-0.042 s |
| tiny-moe, at 481090f (a server moves each received bucket off its GPU: a no-op on CPU) | 0.0247, 0.0260 | 0.0230, 0.0316 | 1.07, 0.82 | 0.038-0.045 s |
| tiny-moe, at 55385e5 (2026-12-04, later: an idle server loads a version on its engine's thread; the model loads on one thread) | 0.0257, 0.0248 | 0.0274, 0.0238 | 0.94, 1.04 | 0.038-0.042 s |
| tiny-moe, at 7118453 (2026-12-05: before each version a `GET /v1/weights` per member finds one that died or restarted) | 0.0288, 0.0268, 0.0284, 0.0281 | 0.0314, 0.0306, 0.0288, 0.0266 | 0.92, 0.88, 0.99, 1.06 | 0.047-0.049 s (2 runs) |
| tiny-moe, at 9805191 (a failed collective closes the group before waiting: the success path unchanged) | 0.0286, 0.0279 | 0.0294, 0.0328 | 0.97, 0.85 | 0.046-0.050 s |
| tiny-moe, at f4356a2 (a group that fails to form is retried after doubling waits: the success path unchanged) | 0.0289, 0.0269 | 0.0278, 0.0355 | 1.04, 0.76 | 0.043-0.048 s |
| tiny-moe, at 9bbf71d (2026-12-05, later: an NCCL group's error mode and close, off this CPU path; the servers' bodies) | 0.0272, 0.0262 | 0.0275, 0.0277 | 0.99, 0.94 | 0.042-0.044 s |
| tiny-moe, at eb9ab54 (2026-12-05, later: a server receives on a thread of its own, which a rank 0 that gave up can leave behind) | 0.0284, 0.0268, 0.0300, 0.0273, 0.0276, 0.0272, 0.0274, 0.0271 | 0.0332, 0.0323, 0.0347, 0.0372, 0.0325, 0.0316, 0.0283, 0.0292 | 0.86, 0.83, 0.87, 0.73, 0.85, 0.86, 0.97, 0.93 | 0.048-0.052 s (3 runs) |
| tiny-moe, at 6f000cc (2026-12-05, later: the servers take min_tokens / logit_bias; the weight paths as at eb9ab54) | 0.0261, 0.0277, 0.0270 | 0.0284, 0.0288, 0.0297 | 0.92, 0.96, 0.91 | 0.044-0.046 s |
| tiny-moe, at c30840f (2026-12-06: a version loads only from its own directory, its manifest checked; a catch-up reloads the published target; a machine ~30% slower) | 0.0433, 0.0427, 0.0495 | 0.0429, 0.0650, 0.0484 | 1.01, 0.66, 1.02 | 0.068-0.086 s |
| tiny-moe, at 58f57a8 (2026-12-06, later: the engine's sampler, not its weight loads; a faster machine) | 0.0273 | 0.0294 | 0.93 | 0.044 s |
| tiny-moe, at 69fad46 (2026-12-06, later: versions fsynced, a version read once per check, a push on the members it took) | 0.0267 | 0.0258 | 1.04 | 0.043 s |
| tiny-moe, at bcfdc2d (2026-12-06, later: the rollout client's closing flag, off this path) | 0.0260 | 0.0291 | 0.89 | 0.045 s |
| tiny-moe, at 3a0a6c1 (2026-12-06, later: a version being published again is read again until it settles) | 0.0275 | 0.0275 | 1.00 | 0.043 s |
| tiny-moe, at 131d608 (2026-12-06, later: no ratio where a broadcast fell back to files; none did) | 0.0334 | 0.0311 | 0.93 | 0.050 s |
| tiny-moe, at fc73bd7 (2026-12-07, another machine: the served version pinned in weights/SERVING at each sync) | 0.0289 | 0.0281 | 1.03 | 0.043 s |
| tiny-moe, at fc4d7a5 (2026-12-07, later, another machine: each version's served log-probs checked, 4.77e-07, between the timed loads) | 0.0287, 0.0311, 0.0272 | 0.0412, 0.0312, 0.0356 | 0.70, 1.00, 0.76 | 0.049-0.056 s |
| tiny-moe, at bb5e338 (2026-12-07, later: a relative run directory's versions load; served log-probs within 4.77e-07) | 0.0298 | 0.0379 | 0.79 | 0.054 s |
| tiny-moe, at 9663526 (2026-12-07, later: the server reads chunked bodies, routes without the query; served log-probs within 4.77e-07) | 0.0309 | 0.0382 | 0.81 | 0.052 s |

(The eb9ab54 runs from the fourth on alternated with 6782a97's code (before that change, from a
worktree; the last three with ``--repeats 9``): broadcast 0.0279, 0.0296, 0.0266, 0.0304, 0.0321 s
(median 0.0296) against eb9ab54's 0.0372, 0.0325, 0.0316, 0.0283, 0.0292 (median 0.0316), files
0.0258-0.0286 against 0.0271-0.0276: at most a few milliseconds, within this machine's noise.
The last two 7118453 runs were interleaved with two without that check: broadcast 0.0304 and 0.0278 s, files 0.0284 and
0.0276 s: the check is within the noise. small-moe was not re-run at 6f2893e, c03259d, e2e6beb, 53d95e8, 481090f, 55385e5, 7118453, 9805191, f4356a2, 9bbf71d or eb9ab54: its figures are 2b5dded's, before the push lock, which adds one
uncontended lock per version. The 2b5dded rows: one session later, after the weight group's backend choice and absolute paths changed
``cascade/rollout.py``; the broadcast of 228 MB moved 1.8x between its two runs.)

On one host the files win at 228 MB: they pass through the page cache (written once, each server
maps and re-hashes them), while the broadcast copies every byte through loopback TCP to each server
(gloo's broadcast sends the whole bucket to each peer) with the packing, both checksums and the
snapshot for the files written behind on the same two cores. The broadcast is for what this machine
cannot show: servers on other hosts with no shared filesystem, and NCCL between GPUs.
Re-run at bbe8685 (2026-12-07, later; alone): files 0.0246 s, broadcast 0.0279 s a version, ``sync_speedup`` 0.88;
served log-probs within 4.8e-07.
Re-run at 6003712 (2026-12-08, a later session: the servers forked by envs.workers.spawn; alone): files 0.0245 s,
broadcast 0.0290 s a version, ``sync_speedup`` 0.84; served log-probs within 4.8e-07; no broadcast failure.
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

SERVED_TOL = 1e-4  # served_logprob_max_abs_diff above this: the servers did not serve the sent weights


def served_logprob_diff(servers, model, sd) -> float:
    """The largest |log-prob a server records for a token it sampled - the log-prob of that token under
    ``model`` holding ``sd``| over ``servers`` (one RemoteEngine each), tokens teacher-forced locally."""
    import torch

    from train.engine import SamplingParams

    model.load_state_dict(sd)
    model.eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0)
    worst = 0.0
    with torch.no_grad():
        for server in servers:
            for p, c in zip(prompts, server.generate(prompts, params)):
                ids = torch.tensor([list(p) + list(c.token_ids)])
                lp = torch.log_softmax(model(ids)[0, len(p) - 1:-1].float(), -1)
                ref = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-moe")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    import torch

    from cascade.rollout import ServedEngine, ServerPool
    from train.engine.remote import RemoteEngine
    from train.presets import init_model

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model, _ = init_model(a.preset, d / "model", seed=0)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        exchange = d / "exchange"
        exchange.mkdir()
        pool = ServerPool(a.servers, d / "model", exchange, "bench", 1, d / "logs")
        engines = {t: ServedEngine(pool.urls, exchange, "bench", transport=t) for t in ("files", "broadcast")}
        servers = [RemoteEngine(url, api_key="bench") for url in pool.urls]  # the check asks each server
        times: dict[str, list[float]] = {t: [] for t in engines}
        served = 0.0  # served_logprob_max_abs_diff
        behind: list[float] = []
        version = 0
        try:
            for r in range(a.repeats + 1):
                for t, eng in engines.items():
                    version += 1
                    for v in sd.values():  # new weights each version
                        v.add_(1e-3)
                    t0 = time.perf_counter()
                    eng.load_weights(sd, version=version)
                    dt = time.perf_counter() - t0
                    if t == "broadcast":
                        t1 = time.perf_counter()
                        eng.wait_published()
                        if r:
                            behind.append(time.perf_counter() - t1 + dt)
                    if r:  # the first version of each transport warms up (and forms the group)
                        times[t].append(dt)
                    served = max(served, served_logprob_diff(servers, model, sd))  # (not timed)
            failures = engines["broadcast"].broadcast_failures
        finally:
            for eng in engines.values():
                eng.close()
            pool.close()
    med = {t: statistics.median(v) for t, v in times.items()}
    print(json.dumps({
        "files_sync_s": round(med["files"], 4), "broadcast_sync_s": round(med["broadcast"], 4),
        # (a version the broadcast failed went by files: its timing would be a files timing, so no ratio then)
        # (and none unless the servers served the weights that were sent)
        "sync_speedup": round(med["files"] / med["broadcast"], 3) if not failures and served <= SERVED_TOL else None,
        "served_logprob_max_abs_diff": float(f"{served:.3g}"),
        "files_sync_s_min_max": [round(min(times["files"]), 4), round(max(times["files"]), 4)],
        "broadcast_sync_s_min_max": [round(min(times["broadcast"]), 4), round(max(times["broadcast"]), 4)],
        "broadcast_files_done_s": round(statistics.median(behind), 4),
        "broadcast_failures": failures, "model_bytes": nbytes, "servers": a.servers, "preset": a.preset,
        "repeats": a.repeats, "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
