"""train/parallel/measure.py: the loopback counter sees a known all-reduce's bytes on 2 gloo ranks,
and the RSS high-water mark sees a transient allocation."""
from __future__ import annotations

import os

import pytest
import torch

from train.parallel.comm import free_port

N = 1 << 20  # float32 elements: 4 MiB per rank


def _worker(rank, world, port, barrier, q):
    import torch.distributed as dist

    from train.parallel.measure import wire_windows

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.ones(N)
    dist.all_reduce(x)  # warm: connections made
    busy, _ = wire_windows(lambda: dist.all_reduce(x), barrier, rank == 0, 3)
    idle, _ = wire_windows(lambda: None, barrier, rank == 0, 3)
    if rank == 0:
        q.put((min(busy), min(idle)))
    barrier.wait()
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_loopback_counter_sees_a_known_all_reduce():
    import torch.multiprocessing as mp

    from train.parallel.measure import net_tx_bytes

    try:
        net_tx_bytes("lo")
    except (OSError, RuntimeError):
        pytest.skip("no /proc/net/dev loopback counter")
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(2), ctx.SimpleQueue()
    mp.spawn(_worker, args=(2, free_port(), barrier, q), nprocs=2)
    busy, idle = q.get()
    want = 2 * (2 - 1) * N * 4  # ring all-reduce, all ranks together: 2 (D-1)/D N per rank x D ranks
    assert idle < 0.01 * want, (busy, idle)
    # headers (TCP/IP ~66 B per <= 64 KiB segment, ACKs, gloo's framing) stay within a few percent
    assert want <= busy - idle < 1.05 * want, (busy, idle, want)


PEAK_SCRIPT = """
import json, torch
from train.parallel.measure import rss_peak
n = 64 << 20
with rss_peak() as a:
    t = torch.ones(n // 4)
    del t
with rss_peak() as b:  # the high-water mark was reset: nothing allocated this time
    pass
print(json.dumps([a, b]))
"""


def test_rss_peak_sees_a_transient_tensor():
    """In a fresh process, as benchmarks/parallel.py measures (ranks of their own): inside this
    test process, after the suite's earlier tests, freed heap pages already resident could serve
    the allocation and hide it."""
    import json
    import subprocess
    import sys

    from train.parallel.measure import reset_hwm

    if not reset_hwm():
        pytest.skip("/proc/self/clear_refs not writable")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = json.loads(out.stdout.strip().splitlines()[-1])
    n = 64 << 20
    assert 0.95 * n < a["peak"] < 1.1 * n, a
    assert b["peak"] < 0.05 * n, b
