"""Executions per second of a trivial Python program in the code sandbox vs a bare subprocess.

Prints one JSON line. Usage: python benchmarks/sandbox.py [--n 40] [--workers 2]
Both sides run the same interpreter on the same program file; the sandbox side pays for bwrap,
the cgroups, the launcher and the host-side loop. Measured sequentially and with a thread pool.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs.code.sandbox import Sandbox, SandboxConfig, _python_install  # noqa: E402

PROGRAM = "print(sum(range(10)))\n"


def rate(fn, n: int, workers: int) -> float:
    fn()  # warm up
    t = time.perf_counter()
    if workers == 1:
        for _ in range(n):
            fn()
    else:
        with ThreadPoolExecutor(workers) as ex:
            list(ex.map(lambda _: fn(), range(n)))
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    sb = Sandbox(SandboxConfig(time_limit=10))
    sb.check()
    exe, _ = _python_install(sb.config)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(PROGRAM)
    try:
        def bare():
            r = subprocess.run([exe, "-S", "-s", "-B", f.name], capture_output=True, env={"PATH": "/usr/bin"})
            assert r.stdout.strip() == b"45"

        def boxed():
            v = sb.run(PROGRAM)
            assert v.status == "ok" and v.stdout.strip() == "45", v

        out = {"benchmark": "sandbox", "n": a.n, "workers": a.workers,
               "layers": [k for k, v in sb.layers.items() if v is None]}
        for label, w in (("seq", 1), ("par", a.workers)):
            b = rate(bare, a.n, w)
            s = rate(boxed, a.n, w)
            out[f"bare_per_s_{label}"] = round(b, 2)
            out[f"sandbox_per_s_{label}"] = round(s, 2)
            out[f"ratio_{label}"] = round(b / s, 2)
            out[f"overhead_ms_{label}"] = round(1000 * (1 / s - 1 / b), 1)
        out["loadavg_1m"] = os.getloadavg()[0]
    finally:
        os.unlink(f.name)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
