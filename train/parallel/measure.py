"""Measurement helpers: per-rank tensor bytes (parameters, gradients, optimizer state, the
activations autograd saves for backward), the process's resident memory and its high-water mark
(/proc/self/status, /proc/self/clear_refs), and bytes on the wire counted by the kernel on the
loopback interface (/proc/net/dev) around a job's steps."""
from __future__ import annotations

import contextlib
import time

import torch


def tensor_bytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def saved_activations(params=()):
    """``with saved_activations(model.parameters()) as box:`` ... ``box["bytes"]``: bytes of the
    unique storages saved for backward inside the block, parameters' storages excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    box = {"bytes": 0}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box
    box["bytes"] = sum(seen.values())


def optimizer_bytes(opt) -> int:
    return tensor_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


# ------------------------------------------------------------------ process memory (Linux /proc)
# glibc raises its mmap threshold each time a large mmapped block is freed, after which blocks of
# that size come from the heap and stay resident when freed: the RSS then no longer falls when
# tensors die and a later phase's high-water mark hides in pages a previous phase left behind.
# A FIXED threshold (set in the environment before the process starts) keeps every allocation
# above 4 KiB in its own mapping, returned to the OS on free (a higher one let a layout's small
# parameter shards reuse heap pages an earlier layout had freed, hiding them from RssAnon).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """The process's resident set size now (VmRSS)."""
    return _status_bytes("VmRSS")


def anon_bytes() -> int:
    """The process's resident ANONYMOUS memory now (RssAnon: heap and mmapped tensors, not the
    shared libraries' code pages that the first call of a kernel pages in)."""
    return _status_bytes("RssAnon")


def hwm_bytes() -> int:
    """The process's resident set high-water mark (VmHWM) since start or the last :func:`reset_hwm`."""
    return _status_bytes("VmHWM")


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (write 5 to /proc/self/clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def rss_peak():
    """``with rss_peak() as box:`` ... ``box["before"]`` (RSS at entry, after a gc), ``box["anon"]``
    (RssAnon at entry), ``box["hwm"]`` (RSS high-water mark inside the block, transients included)
    and ``box["peak"] = hwm - before``. Run the block's code once before (warm), so that the
    kernels' code pages are already resident and ``peak`` is memory the block allocated."""
    import gc

    gc.collect()
    box = {"before": rss_bytes(), "anon": anon_bytes()}
    if not reset_hwm():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs not writable)")
    yield box
    box["hwm"] = max(hwm_bytes(), box["before"])
    box["peak"] = box["hwm"] - box["before"]


# --------------------------------------------------------------------- bytes on the wire (loopback)


def net_tx_bytes(iface: str = "lo") -> int:
    """Bytes the kernel has transmitted on ``iface`` (/proc/net/dev; for ``lo`` every byte one local
    process sends another over TCP, with its TCP/IP and link headers, ACKs included)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    raise RuntimeError(f"no interface {iface!r} in /proc/net/dev")


def wire_windows(run, barrier, reader: bool, reps: int, iface: str = "lo") -> tuple[list[int], list[float]]:
    """Run ``run()`` ``reps`` times on every rank of a job whose ranks share ``barrier`` (a
    ``multiprocessing`` barrier: shared memory, so synchronising sends nothing on the network), each
    time between two barriers with the reader rank reading ``iface``'s transmit counter just outside
    them. Returns (the counter's increase per window on the reader, [] elsewhere; this rank's
    seconds inside ``run`` per window). The counter is the machine's: it also sees any other
    process talking on ``iface`` during the window, so take the minimum over windows."""
    deltas, secs = [], []
    for _ in range(reps):
        barrier.wait()
        c0 = net_tx_bytes(iface) if reader else 0
        barrier.wait()
        t0 = time.perf_counter()
        run()
        secs.append(time.perf_counter() - t0)
        barrier.wait()
        if reader:
            deltas.append(net_tx_bytes(iface) - c0)
    barrier.wait()
    return deltas, secs
