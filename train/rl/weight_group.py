"""Weight versions over a process group: the trainer broadcasts a version's tensors to the rollout
servers (NCCL on GPU, gloo on CPU) instead of every server reading and hashing the version's files.

The group is the trainer (rank 0) and the servers' members (a torch server: 1; a vLLM server: one
per worker, ``rank_offset + worker rank``), rendezvousing through a ``TCPStore`` that the trainer
opens (``host``, a free port). It is separate from any trainer process group (its own
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a prefixed store), so a run's trainer ranks and its
servers need share nothing else.

One version on the wire: the trainer sends the layout (every tensor's name, dtype, shape, bucket and
byte offset: :func:`plan`) in the server's ``POST /v1/load_weights`` body, then broadcasts the tensors
packed as raw bytes into buckets of at most ``bucket_bytes`` (one collective per bucket, not per
tensor; memory on either side: one bucket), then one int64 tensor with each bucket's checksum (the
sum of its bytes as int32 words, exact on any device in any order). A server applies the version
only when every bucket arrived and every checksum matches; otherwise it refuses and keeps serving
the old weights, as with a file version whose sha256 does not match. The file path stays the
durable record (resume, servers that restart and catch up) and the fallback when the group fails.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import threading
from dataclasses import dataclass, field

import torch

from train.engine.remote import fan_out

ALIGN = 16  # every tensor starts at a multiple of this many bytes in its bucket (any dtype's view)
BUCKET_BYTES = 256 << 20
TRANSPORTS = ("files", "broadcast")  # how weight versions reach rollout servers (rollout.weight_transport)

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                      torch.int64, torch.int32, torch.int16, torch.int8,
                                                      torch.uint8, torch.bool)}


class WeightGroupError(RuntimeError):
    """The group could not be formed, a transfer failed, or a checksum did not match."""


class BackingOff(WeightGroupError):
    """Not tried: the group failed to form with the same servers a few versions ago."""


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def plan(state_dict: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> dict:
    """The layout of a state dict on the wire: ``{"tensors": [[name, dtype, shape, bucket, offset],
    ...], "buckets": [nbytes, ...]}`` (JSON-able; offsets aligned to 16 bytes, bucket sizes too)."""
    tensors, buckets, used = [], [], None
    for name, t in state_dict.items():
        dt = str(t.dtype).removeprefix("torch.")
        if dt not in _DTYPES:
            raise WeightGroupError(f"{name}: dtype {t.dtype} cannot travel over the weight group")
        n = -(-_nbytes(t.shape, t.dtype) // ALIGN) * ALIGN
        if used is None or (used + n > bucket_bytes and used > 0):
            buckets.append(0)
            used = 0
        tensors.append([name, dt, list(t.shape), len(buckets) - 1, used])
        used += n
        buckets[-1] = used
    return {"tensors": tensors, "buckets": [max(b, ALIGN) for b in buckets]}


def checksum(buf: torch.Tensor) -> torch.Tensor:
    """Sum of a byte buffer's int32 words, as int64 (exact and order-independent: < 2^63 for any
    buffer under 8 GiB)."""
    return buf.view(torch.int32).sum(dtype=torch.int64)


def join_request(body) -> tuple[str, int, int, int, str, float, str | None]:
    """(host, port, rank, world_size, name, timeout_s, backend) of a server's ``POST /v1/weights_group``
    body, or ValueError with a one-line message."""
    try:
        host, port, rank, world, name = (body[k] for k in ("host", "port", "rank", "world_size", "name"))
        timeout_s = float(body.get("timeout_s", 120))
        backend = body.get("backend")
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (port, rank, world)) and \
            0 < rank < world and isinstance(host, str) and isinstance(name, str) and timeout_s > 0 and \
            (backend is None or backend in BACKENDS)
    except (KeyError, TypeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise ValueError('weights_group needs "host", "port", "rank" (1 <= rank < world_size), "world_size" and '
                         f'"name" (and optionally "timeout_s" > 0 and "backend", one of {list(BACKENDS)})')
    return host, port, rank, world, name, timeout_s, backend


def _check_layout(layout) -> None:
    if not isinstance(layout, dict) or not isinstance(layout.get("tensors"), list) or \
            not isinstance(layout.get("buckets"), list) or not layout["buckets"]:
        raise WeightGroupError('the broadcast layout needs "tensors" and "buckets" lists')
    for b in layout["buckets"]:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % ALIGN:
            raise WeightGroupError(f"bad bucket size {b!r}")
    for entry in layout["tensors"]:
        try:
            name, dt, shape, bucket, off = entry
            end = off + _nbytes(shape, _DTYPES[dt])
            ok = isinstance(name, str) and 0 <= bucket < len(layout["buckets"]) and off % ALIGN == 0 \
                and 0 <= off and end <= layout["buckets"][bucket] and all(int(s) >= 0 for s in shape)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise WeightGroupError(f"bad tensor entry in the broadcast layout: {entry!r}"[:200])


@dataclass
class Group:
    """One member's handle on the weight group."""

    pg: object
    rank: int
    world_size: int
    device: torch.device
    name: str = ""
    # set when rank 0 gave up on a broadcast (POST /v1/weights_group/abort): a member stops waiting for it
    aborted: threading.Event = field(default_factory=threading.Event)

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def close(self) -> None:
        # NCCL: abort, not shutdown, which waits for the communicator's kernels to finish: a member that died
        # mid-transfer never lets them (nothing needs flushing: every close comes after a version ended)
        end = getattr(self.pg, "abort" if self.device.type == "cuda" else "shutdown", None)
        if end is not None:
            try:
                end()
            except Exception:  # noqa: BLE001 - a broken group is dropped either way
                pass


BACKENDS = ("gloo", "nccl")


def backend_for(device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _indexed(device) -> torch.device:
    """``device`` with its index (``cuda`` alone means the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_tag(device) -> str:
    """What a member brings to a weight group: ``cpu``, or ``cuda:<GPU uuid>`` (which physical GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(_indexed(device).index).uuid}"


def choose_backend(own: str, members: list) -> str:
    """The weight group's backend, chosen by rank 0 for every member (one group has one backend):
    NCCL when every member, rank 0 included, is on its own GPU; else gloo (tensors staged on CPU),
    as when some member is on CPU, did not say (an older server), or shares a GPU with another (NCCL
    refuses two ranks on one GPU)."""
    tags = [own, *members]
    if all(isinstance(t, str) and t.startswith("cuda:") for t in tags) and len(set(tags)) == len(tags):
        return "nccl"
    return "gloo"


ASYNC_ERRORS = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_env_lock = threading.Lock()


@contextlib.contextmanager
def nccl_errors_raise():
    """Around a weight group's ``ProcessGroupNCCL`` construction, which reads ``TORCH_NCCL_ASYNC_ERROR_HANDLING``:
    2 (abort the communicator; the next operation raises) instead of torch's default 3, whose watchdog ends the
    process when a collective fails or times out. A failed version is one that goes by files (rank 0, the run's
    orchestrator) or is refused (a server, which goes on serving): neither process should die of it. A value the
    user set stays; the variable is restored after (a process's other groups keep torch's default)."""
    with _env_lock:
        before = os.environ.get(ASYNC_ERRORS)
        if before is None:
            os.environ[ASYNC_ERRORS] = "2"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ASYNC_ERRORS, None)


def join(host: str, port: int, rank: int, world_size: int, name: str, device="cpu", store=None,
         timeout_s: float = 300.0, backend: str | None = None) -> Group:
    """Become ``rank`` of the weight group ``name`` (rank 0 passes the ``TCPStore`` it opened; the
    others connect to ``host:port``). Blocks until all ``world_size`` members joined. ``backend``
    (rank 0's :func:`choose_backend`, sent to every member; default: the device's own) ``gloo``
    keeps the group's buffers on CPU whatever ``device`` is."""
    import torch.distributed as dist

    backend = backend or backend_for(device)
    if backend not in BACKENDS:
        raise ValueError(f"weight group backend must be one of {BACKENDS}, got {backend!r}")
    device = _indexed(device) if backend == "nccl" else torch.device("cpu")
    if device.type != ("cuda" if backend == "nccl" else "cpu"):
        raise ValueError(f"an NCCL weight group needs a CUDA device, this member is on {device}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, int(port), int(world_size), False, timeout=timeout)
    prefixed = dist.PrefixStore(f"cascade-weights/{name}", store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # as torch's own init does (NCCL's default is 10 minutes)
        with nccl_errors_raise():
            pg = dist.ProcessGroupNCCL(prefixed, int(rank), int(world_size), opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, int(rank), int(world_size), timeout)
    return Group(pg, int(rank), int(world_size), device, name)


def send(group: Group, state_dict: dict[str, torch.Tensor], layout: dict) -> None:
    """Rank 0: broadcast ``state_dict`` packed per ``layout`` (from :func:`plan`), then the checksums."""
    by_bucket: dict[int, list] = {}
    for (name, _, _, bucket, off) in layout["tensors"]:
        by_bucket.setdefault(bucket, []).append((name, off))
    sums = torch.zeros(len(layout["buckets"]), dtype=torch.int64, device=group.device)
    for b, nbytes in enumerate(layout["buckets"]):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=group.device)
        for name, off in by_bucket.get(b, []):
            src = state_dict[name].detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off:off + src.numel()].copy_(src)
        sums[b] = checksum(buf)
        group.broadcast(buf)
        del buf
    group.broadcast(sums)


def receive(group: Group, layout: dict) -> dict[str, torch.Tensor]:
    """A server member: the state dict broadcast per ``layout``, on the host (each bucket leaves the GPU
    as it arrives: a server's GPU is given to its model and KV cache, with no room for a second, unsharded
    copy of the policy); raises :class:`WeightGroupError` if a checksum does not match (nothing is applied
    by this function)."""
    _check_layout(layout)
    bufs, got = [], []
    for nbytes in layout["buckets"]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buf)
        got.append(checksum(buf))
        bufs.append(buf.cpu())
        del buf
    sums = torch.empty(len(bufs), dtype=torch.int64, device=group.device)
    group.broadcast(sums)
    got, sums = torch.stack(got).cpu(), sums.cpu()
    if not torch.equal(got, sums):
        bad = [i for i, ok in enumerate((got == sums).tolist()) if not ok]
        raise WeightGroupError(f"checksum mismatch in bucket(s) {bad} of the broadcast version")
    out = {}
    for (name, dt, shape, bucket, off) in layout["tensors"]:
        dtype = _DTYPES[dt]
        out[name] = bufs[bucket][off:off + _nbytes(shape, dtype)].view(dtype).reshape(shape)
    return out


class Broadcaster:
    """The trainer's side (rank 0) of a weight group with the live servers of a
    :class:`train.engine.remote.RemoteEngine`: :meth:`push` sends one version to all of them. The group
    is formed on first use and again whenever the set of live servers changed (a server restarted or
    left); any failure closes it and raises :class:`WeightGroupError` (the caller falls back to files)."""

    def __init__(self, remote, host: str = "127.0.0.1", device="cpu", timeout_s: float = 120.0,
                 bucket_bytes: int = BUCKET_BYTES):
        self.remote, self.host, self.device = remote, host, torch.device(device)
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.group: Group | None = None
        self.members: tuple[str, ...] = ()
        self._instances: dict[str, str | None] = {}  # url -> the server process (its ``instance``) in the group
        # the servers the group last failed to form with, the versions to send by files before the next try,
        # and the wait set at that failure (doubled at each failure with the same servers)
        self._failed_with: tuple[str, ...] = ()
        self._skip = self._backoff = 0
        self.formed = 0  # groups formed so far (also names them)
        self._stale = False  # reform() asked for a new group at the next push
        self._pushing = threading.Lock()  # one push at a time (a server's catch-up runs on another thread)

    def _call(self, url: str, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> dict:
        # by default as long as a collective may take: the server answers once it is done
        c = self.remote._conn(url, timeout=self.timeout_s + 30 if timeout_s is None else timeout_s)
        try:
            return c.call(method, path, body)
        finally:
            c.close()

    def _finish(self, out: dict, threads, what: str) -> dict:
        for t in threads:
            t.join()
        bad = {u: r for u, r in out.items() if isinstance(r, Exception)}
        if bad:
            self.close()
            raise WeightGroupError(f"{what}: " + "; ".join(f"{u}: {str(e).strip()[:200]}" for u, e in bad.items()))
        return out

    def _form(self, urls: tuple[str, ...]) -> None:
        import secrets

        import torch.distributed as dist

        self.close()
        self._stale = False  # (a reform() from here on is for the next push)
        if not urls:
            raise WeightGroupError("no live server to form a weight group with")
        info = self._finish(*fan_out(urls, lambda u: self._call(u, "GET", "/v1/weights")), "weight group sizes")
        members = {u: int(i.get("group_members", 0)) for u, i in info.items()}
        devices = [d for u in urls for d in (info[u].get("group_devices") or ["?"] * max(members[u], 1))]
        backend = choose_backend(device_tag(self.device), devices)
        if any(k < 1 for k in members.values()):
            raise WeightGroupError(f"servers without weight-group support: {[u for u, k in members.items() if k < 1]}")
        world = 1 + sum(members.values())
        store = dist.TCPStore(self.host, 0, world, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.timeout_s))
        name = f"{self.formed}-{secrets.token_hex(4)}"
        self.formed += 1
        offsets, r = {}, 1
        for u in urls:
            offsets[u], r = r, r + members[u]
        body = {"host": self.host, "port": store.port, "world_size": world, "name": name, "timeout_s": self.timeout_s,
                "backend": backend}
        pending = fan_out(urls, lambda u: self._call(u, "POST", "/v1/weights_group", {**body, "rank": offsets[u]}),
                          wait=False)  # they block until rank 0 joins
        try:
            group = join(self.host, store.port, 0, world, name, self.device, store=store, timeout_s=self.timeout_s,
                         backend=backend)
        except Exception as e:
            self._finish(*pending, "joining the weight group")
            raise WeightGroupError(f"forming the weight group: {e}") from None
        self._finish(*pending, "joining the weight group")
        self.group, self.members, self._store = group, urls, store
        self._instances = {u: info[u].get("instance") for u in urls}

    def _check_members(self) -> None:
        """Every member still answers, as the process that joined the group. A member that died (or was
        restarted at its URL) since the last version would fail the collective, and the others, already
        receiving, would wait until rank 0 closes the group: one ``GET /v1/weights`` each (a millisecond
        here; at most 10 s for a host that no longer answers, where a collective would wait out
        ``rollout.group_timeout_s``) finds it first. One that dies during the transfer fails the collective
        on rank 0, which closes the group before waiting for the others (:meth:`_push`)."""
        info, threads = fan_out(self.members, lambda u: self._call(u, "GET", "/v1/weights",
                                                                    timeout_s=min(self.timeout_s, 10.0)), wait=False)
        self._finish(info, threads, "a weight group member is down")
        moved = [u for u in self.members if info[u].get("instance") != self._instances.get(u)]
        if moved:
            self.close()
            raise WeightGroupError(f"a weight group member restarted since the group formed: {', '.join(moved)}")

    def push(self, state_dict: dict[str, torch.Tensor], version: int, urls=None) -> dict[str, int]:
        """Every live server (or those at ``urls``) loads ``state_dict`` as ``version``; {url: version
        it reports}."""
        with self._pushing:
            return self._push(state_dict, version, urls)

    def _push(self, state_dict, version: int, urls) -> dict[str, int]:
        urls = tuple(sorted(self.remote.alive if urls is None else urls))
        if self.group is None or self._stale or self.members != urls:
            self._form_or_back_off(urls)  # (refuses an empty set of servers)
        else:
            self._check_members()
        # this push's group and members, whatever reform() on another thread asks of the next push
        group, members = self.group, self.members
        if group is None or not members:  # (close() on another thread: the run is ending)
            raise WeightGroupError("no weight group to broadcast on: it was closed")
        layout = plan(state_dict, self.bucket_bytes)
        body = {"version": int(version), "broadcast": layout}
        pending = fan_out(members, lambda u: self._call(u, "POST", "/v1/load_weights", body), wait=False)
        error = None
        try:
            send(group, state_dict, layout)  # packed into buckets on the group's device
        except Exception as e:  # noqa: BLE001 - kept as text: its traceback would hold the group
            error = f"broadcasting weights: {e}"
        if error is not None:
            self.close()  # first: the members still receiving fail at once, not at the group's timeout
            # ... which gloo does not always make them see (a closed rank 0 can leave a member waiting for data
            # until the group's timeout): Cascade's servers are told to give the broadcast up (vLLM's server has no
            # such route: its members wait the timeout out)
            fan_out(members, lambda u: self._call(u, "POST", "/v1/weights_group/abort", {"name": group.name},
                                                  timeout_s=min(self.timeout_s, 10.0)))
            self._finish(*pending, "broadcasting weights")
            raise WeightGroupError(error)
        out = self._finish(*pending, "broadcasting weights")
        return {u: int(r["version"]) for u, r in out.items()}

    def _form_or_back_off(self, urls: tuple[str, ...]) -> None:
        """Form the group, unless it failed to form with the same servers lately. A member that cannot join
        (its NCCL cannot reach this host, say) leaves the others waiting in the rendezvous for the group's
        timeout, at every version if nothing changes: each failure with the same servers doubles the versions
        that go by files before the next try (1, 2, 4, ... at most 32); any change of the servers (one
        restarted, gone, or back) tries at once."""
        if urls == self._failed_with and self._skip > 0:
            self._skip -= 1
            raise BackingOff(f"not tried: the weight group failed to form with these servers; the next try in "
                             f"{self._skip + 1} version(s)")
        try:
            self._form(urls)
        except WeightGroupError:
            self._backoff = min(2 * self._backoff, 32) if urls == self._failed_with else 1
            self._failed_with, self._skip = urls, self._backoff
            raise
        self._failed_with, self._skip, self._backoff = (), 0, 0

    def reform(self) -> None:
        """The next :meth:`push` forms the group again (a member is a new process at the same URL), also
        where it lately failed to. Safe from another thread than the one pushing: it only marks the group
        stale, and a push under way finishes on the group and members it took."""
        self._stale = True
        self._failed_with = ()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.members = None, ()
