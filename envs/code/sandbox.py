"""Run untrusted Python or C++ programs in layers of isolation, with limits, and report a :class:`Verdict`.

Layers (each detected once per process, see :func:`detect_layers`):

- ``namespaces``: bubblewrap (``bwrap``): new network namespace (nothing reachable, not even the
  host's 127.0.0.1), pid namespace (every process dies with the sandbox), mount namespace with a
  read-only view of ``/usr``, the libraries and the Python installation only (no ``/home``, no
  ``/root``, no ``/work``; every ``site-packages``/``dist-packages`` there an empty mount: runs are
  stdlib-only), a private size-capped tmpfs as the working directory and another at
  ``/dev/shm`` (POSIX shared memory and semaphores, as ``multiprocessing`` uses them; their files
  are memory of the start's cgroup), ipc and uts namespaces, a new session and death with its
  parent.
- ``uid``: the program runs as an unprivileged uid (65534 by default): as root, bwrap keeps only
  CAP_SETUID/CAP_SETGID/CAP_KILL for the supervisor, and each run drops to the uid (losing them
  all; no_new_privs keeps them lost) before any untrusted code runs; as a normal user the program
  already runs unprivileged (bwrap maps it to the uid in a user namespace).
- ``rlimits``: address space, CPU time, file size, open files, set per run; processes too where no
  pids cgroup caps them (RLIMIT_NPROC counts every process of the uid on the host, those of other
  starts included, so with the cgroup it stays at the hard limit the sandbox inherited).
- ``cgroup_pids`` / ``cgroup_memory``: a cgroup per sandbox start (v1, or v2 where a delegated
  subtree with the controllers exists) caps the number of processes and the total memory (runs
  of a start go one at a time, and nothing of one is left when the next begins), and gives each
  run's peak memory. bwrap and its sandbox child join it while bwrap holds the child after its
  namespaces and mounts (``--info-fd`` gives the child's pid, ``--block-fd`` holds it), before
  seccomp and the supervisor: nothing of the supervisor or a run ever runs outside it.
- ``seccomp``: a BPF filter (loaded by bwrap) makes ``socket()`` fail for every family but
  AF_UNIX, makes the kernel keyring calls (``add_key``, ``request_key``, ``keyctl``) fail with
  EPERM (keyrings belong to the uid, not to a namespace: a key stored by one run would be there
  for a later one), refuses a user namespace of the run's own (``unshare``/``clone`` with
  CLONE_NEWUSER: EPERM; ``clone3``: ENOSYS, so that glibc falls back to ``clone``) and kills
  foreign-ABI system calls. The same filter serves the C++ compile step: g++, cc1plus, as,
  collect2 and ld use no socket (g++ talks to its children through pipes and, with ``-pipe``, none
  through temporary files but the object file in ``/tmp``), no keyring, no namespace and no
  foreign-ABI call, so the compile needs nothing the runs do not get, and nothing is loosened for
  it.

One sandbox start serves a whole session (:meth:`Sandbox.run_many`: a program and all of its
tests): bwrap starts a small supervisor (:mod:`envs.code.supervisor`) inside every layer, and the
supervisor runs each run as its own child, forked from its clean interpreter: the child drops to
the uid (as root the supervisor keeps only CAP_SETUID/SETGID/KILL; the child loses them all),
empties ``/tmp`` (its working directory), ``/dev/shm``, the POSIX message queues and System V IPC
objects of earlier runs, sets the rlimits and runs the program. The supervisor enforces the run's
wall limit and, once its first process ends, SIGKILLs every process of the sandbox but itself; the
host reads the run's output directly (capped: over the limit it has the supervisor kill the run)
and takes the run's CPU time, memory peak, OOM and pids-limit events from the cgroup's counters.
A start is never used by a second session; a pool (``SandboxConfig.warm``) keeps starts ready
ahead, made by long-lived threads, so that a session rarely waits for bwrap and the interpreter.
Without root the supervisor would share the runs' uid (a run could signal it): then each run
gets a start of its own. Without bwrap (the weaker mode) each run is started directly, its
launcher's first process staying as the run's reaper (a child subreaper: once the program's
process ends, or the host stops the run, it kills whatever of the run is left, a daemon that
left the process group too); the host reads the pipes for at most a short grace after that
process ends, and counts none of it as the run's time.

C++ (``language="cpp"``; :meth:`Sandbox.run_many` has the details): the compiler (``g++``,
``SandboxConfig.cxx`` / ``cxx_flags``) runs as a run of the session, under every layer above and
the compile limits (``compile_time_limit``, ``compile_memory_mb``), reading the source from
``/box`` (read-only) and writing the binary into its ``/tmp``. The supervisor hands the binary to
the host, which puts it in ``/box`` beside the source (owned by the host, read-only to the runs),
and each test then ``execve``s it in a fresh child of the supervisor, with the run limits and an
emptied ``/tmp``, exactly like a Python run (but with SIGPIPE and SIGXFSZ at their default
actions, as in a shell: a write past the file-size limit ends it by SIGXFSZ, limit ``file_size``).
A compile that fails (compiler errors, or a compile limit) gives each run a ``compile_error``
verdict holding the compiler's message.

A missing layer is never silently skipped: :class:`Sandbox` refuses to run and names the
missing layers unless the config allows them (``allow_weaker=True``, or the layer names in
``allow_missing``, or the environment variable ``CASCADE_SANDBOX_ALLOW_WEAKER`` = ``1`` or a
comma-separated list of layer names). Without ``namespaces`` the program sees the host's files,
the hidden tests of :mod:`envs.code` included (``envs/code/seeds.py``), so a policy can learn to
read them: such a sandbox is for trying things, never for RL you trust; it says so (a logged
warning, once per process) when it runs so.

The program's environment is clean (``PATH``, ``HOME=/tmp``, ``LANG``, ``PYTHONHASHSEED=0``
and a few malloc/pyc settings only): nothing of the host's environment leaks in.
"""
from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import platform
import resource
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass, field

__all__ = [
    "LAYERS", "SandboxConfig", "Verdict", "Run", "Sandbox", "SandboxError", "SandboxUnavailable",
    "detect_layers", "run_program", "default_sandbox", "STATUSES", "LANGUAGES", "language_of",
]

LAYERS = ("namespaces", "uid", "rlimits", "cgroup_pids", "cgroup_memory", "seccomp")
STATUSES = ("ok", "runtime_error", "time_limit", "memory_limit", "output_limit", "killed", "compile_error")
LANGUAGES = ("python", "cpp")
ALLOW_ENV = "CASCADE_SANDBOX_ALLOW_WEAKER"

SETUP_TIMEOUT = 30.0  # seconds the sandbox itself may take to start a program
BOX = "/box"        # read-only directory holding the program inside the sandbox
WORKDIR = "/tmp"    # private writable tmpfs, the program's cwd
SHM_DIR = "/dev/shm"  # private writable tmpfs for POSIX shared memory (emptied between runs like /tmp)
# what running without the 'namespaces' layer loses (said where it is refused, and once per process where allowed)
NO_NAMESPACES = ("without the 'namespaces' layer the program sees the host's files, the hidden tests of envs/code "
                 "included (envs/code/seeds.py: every seed's tests and expected outputs), so a policy can learn to "
                 "read them and print the expected output: use such a sandbox only to try things, never for RL you "
                 "trust")

log = logging.getLogger(__name__)


def _readable(fd: int, timeout: float) -> bool:
    """Whether ``fd`` has input (or hung up) within ``timeout`` seconds (``poll``: ``select`` refuses a descriptor
    above 1,023, which a long-running process may hold)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0.0, timeout) * 1000))


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): setup error, launcher failure."""


class _StartupStall(SandboxError):
    """The sandbox never started the program before the wall limit (not the program's fault)."""


class SandboxUnavailable(SandboxError):
    """Isolation layers are missing and the config does not allow running without them."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation requirements of a sandbox. Times in seconds, sizes in MiB unless named."""

    time_limit: float = 5.0               # wall clock per run
    cpu_time_limit: float | None = None   # default: the wall limit, rounded up to a whole second
    memory_mb: int = 512                  # address space per process; cgroup memory for the run
    output_limit_bytes: int = 8 << 20     # stdout + stderr together; exceeding it kills the run
    stderr_keep_bytes: int = 16 << 10     # tail of stderr kept in the verdict
    file_size_mb: int = 16                # largest file the program may write
    tmpfs_mb: int = 64                    # size of the writable working directory (and of /dev/shm)
    max_processes: int = 32               # processes + threads of the run
    max_open_files: int = 256
    python: str | None = None             # interpreter run inside; default: the base interpreter of this one
    uid: int = 65534
    gid: int = 65534
    allow_weaker: bool = False
    allow_missing: tuple[str, ...] = ()
    cgroup_root: str | None = None        # a delegated cgroup v2 directory to create run cgroups in
    warm: int = 2                         # sandbox starts kept ready ahead (0: start each when needed)
    # C++ (``language="cpp"``): the compile step's own limits (the runs keep the ones above)
    cxx: str = "g++"                      # compiler, looked up on the host's PATH; must lie under /usr
    cxx_flags: tuple[str, ...] = ("-std=gnu++17", "-O2", "-pipe", "-fmax-errors=20", "-DONLINE_JUDGE")
    compile_time_limit: float = 20.0      # wall clock of the compile (CPU: the same, rounded up)
    compile_memory_mb: int = 1024         # address space per compiler process; cgroup memory of the compile

    def __post_init__(self):
        if self.time_limit <= 0 or self.memory_mb <= 0 or self.max_processes <= 0:
            raise ValueError("time_limit, memory_mb and max_processes must be positive")
        if self.warm < 0:
            raise ValueError("warm must be >= 0")
        if self.compile_time_limit <= 0 or self.compile_memory_mb <= 0:
            raise ValueError("compile_time_limit and compile_memory_mb must be positive")
        bad = [x for x in self.allow_missing if x not in LAYERS]
        if bad:
            raise ValueError(f"unknown sandbox layer(s) {bad}; choose from {', '.join(LAYERS)}")

    def allowed_missing(self) -> set[str]:
        allowed = set(LAYERS) if self.allow_weaker else set(self.allow_missing)
        env = os.environ.get(ALLOW_ENV, "").strip()
        if env in ("1", "all", "true", "yes"):
            allowed |= set(LAYERS)
        elif env:
            allowed |= {x.strip() for x in env.split(",") if x.strip() in LAYERS}
        return allowed


@dataclass
class Verdict:
    """What happened to one run. ``stdout`` is complete up to the output limit; ``stderr`` is a tail.

    ``limits_hit``: ``wall_time``, ``cpu_time`` (the run's own time limits), ``total_time`` (its wall
    limit was cut to what was left of the session's deadline, and that ended it: see
    :meth:`Sandbox.run_many`), ``memory`` (address space or cgroup), ``processes`` (the pids
    cgroup refused a fork or thread; the run may have gone on), ``output``, ``file_size`` (a
    binary ended by SIGXFSZ; a Python program gets EFBIG instead). ``status`` is ``time_limit``
    for the three time limits."""

    status: str
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    wall_time: float
    cpu_time: float
    peak_memory_bytes: int | None
    limits_hit: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    compile: dict | None = None   # C++: the compile step (status, exit_code, wall/cpu time, peak memory, limits)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self, excerpt: int | None = 2000) -> dict:
        d = asdict(self)
        if excerpt is not None:
            for k in ("stdout", "stderr"):
                s = d[k]
                if len(s) > excerpt:
                    d[k] = s[:excerpt // 2] + f"\n...[{len(s) - excerpt} chars cut]...\n" + s[-excerpt // 2:]
        d["wall_time"] = round(d["wall_time"], 4)
        d["cpu_time"] = round(d["cpu_time"], 4)
        return d


# --------------------------------------------------------------------------------------------
# seccomp: a classic BPF program, handed to bwrap (--seccomp FD)
# --------------------------------------------------------------------------------------------
_SECCOMP_ARCH = {  # machine -> (AUDIT_ARCH_*, __NR_socket, x32 bit to refuse or 0, (add_key, request_key, keyctl),
                  #             (clone, unshare, clone3))
    "x86_64": (0xC000003E, 41, 0x40000000, (248, 249, 250), (56, 272, 435)),
    "aarch64": (0xC00000B7, 198, 0, (217, 218, 219), (220, 97, 435)),
}
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_CLONE_NEWUSER = 0x10000000


def seccomp_filter() -> bytes | None:
    """The BPF filter (struct sock_filter[]) for this machine, or None if the arch is unknown.

    Foreign-ABI calls kill the process; ``socket(family != AF_UNIX, ...)`` fails with EACCES;
    the kernel keyring calls (``add_key``, ``request_key``, ``keyctl``) fail with EPERM, as in
    Docker's default profile: keyrings are not namespaced, so a key one run stored in its uid's
    keyring would be there for a later run (of any start) to read; ``unshare`` and ``clone`` with
    CLONE_NEWUSER fail with EPERM (a user namespace of its own would give a run every capability
    inside it, and the kernel's namespaced-root code to attack), and ``clone3``, whose flags sit in
    memory a filter cannot read, fails with ENOSYS, as in Docker's default profile: glibc then falls
    back to ``clone`` (threads, ``fork``, ``posix_spawn`` work as before); everything else is allowed
    (the namespaces and limits do the rest).
    """
    spec = _SECCOMP_ARCH.get(platform.machine())
    if spec is None:
        return None
    arch, nr_socket, x32, nr_keys, (nr_clone, nr_unshare, nr_clone3) = spec
    # (code, jt-label, jf-label, k); labels resolved below
    prog = [
        ("ld", _LD_ABS, None, None, 4),                       # A = arch
        ("arch", _JEQ, None, "kill", arch),
        ("ld", _LD_ABS, None, None, 0),                       # A = syscall number
        ("x32", _JGE, "deny", None, x32 or 0xFFFFFFFF),
        *(("key", _JEQ, "eperm", None, nr) for nr in nr_keys),
        ("clone3", _JEQ, "enosys", None, nr_clone3),
        ("unshare", _JEQ, "flags", None, nr_unshare),
        ("clone", _JEQ, "flags", None, nr_clone),
        ("sock", _JEQ, None, "allow", nr_socket),
        ("ld", _LD_ABS, None, None, 16),                      # A = low word of args[0] (family)
        ("unix", _JEQ, "allow", "deny", 1),                   # AF_UNIX
        ("flags", _LD_ABS, None, None, 16),                   # A = low word of args[0] (the flags of both)
        ("newuser", _JSET, "eperm", "allow", _CLONE_NEWUSER),
        ("allow", _RET, None, None, _RET_ALLOW),
        ("deny", _RET, None, None, _RET_ERRNO | errno.EACCES),
        ("eperm", _RET, None, None, _RET_ERRNO | errno.EPERM),
        ("enosys", _RET, None, None, _RET_ERRNO | errno.ENOSYS),
        ("kill", _RET, None, None, _RET_KILL_PROCESS),
    ]
    where = {name: i for i, (name, *_rest) in enumerate(prog)
             if name in ("flags", "allow", "deny", "eperm", "enosys", "kill")}
    out = b""
    for pc, (_name, code, jt, jf, k) in enumerate(prog):
        jt_off = where[jt] - pc - 1 if jt else 0
        jf_off = where[jf] - pc - 1 if jf else 0
        out += struct.pack("=HBBI", code, jt_off, jf_off, k)
    return out


# --------------------------------------------------------------------------------------------
# cgroups
# --------------------------------------------------------------------------------------------
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def _kv(text: str | None) -> dict[str, int]:
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _cgroup_dirs() -> dict[str, tuple[str, str]]:
    """controller -> (version, directory of this process's cgroup) for pids, memory and cpuacct."""
    own_v1: dict[str, str] = {}
    own_v2 = None
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            own_v2 = path
        for c in ctrls.split(","):
            own_v1[c] = path
    out: dict[str, tuple[str, str]] = {}
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, mnt, fstype, opts = fields[3], fields[4], rfields[0], rfields[2].split(",")
        if fstype == "cgroup":
            for c in ("pids", "memory", "cpuacct"):
                if c in opts and c in own_v1 and c not in out:
                    rel = os.path.relpath(own_v1[c], root) if own_v1[c].startswith(root) else None
                    if rel is not None:
                        out[c] = ("v1", os.path.normpath(os.path.join(mnt, rel)))
        elif fstype == "cgroup2" and own_v2 is not None:
            avail = (_read(os.path.join(mnt, "cgroup.controllers")) or "").split()
            rel = os.path.relpath(own_v2, root) if own_v2.startswith(root) else None
            for c in ("pids", "memory"):
                if c in avail and c not in out and rel is not None:
                    out[c] = ("v2", os.path.normpath(os.path.join(mnt, rel)))
    return out


class _RunCgroup:
    """The cgroup(s) of one run: created with limits, read for stats, emptied and removed."""

    def __init__(self, dirs: dict[str, tuple[str, str]], memory_bytes: int, pids: int):
        self.dirs: dict[str, tuple[str, str]] = {}
        name = f"cascade-sbx-{uuid.uuid4().hex[:12]}"
        try:
            for ctrl, (ver, base) in dirs.items():
                path = os.path.join(base, name)
                if ctrl == "cpuacct":  # accounting only: best effort
                    try:
                        os.mkdir(path)
                        self.dirs[ctrl] = (ver, path)
                    except OSError:
                        pass
                    continue
                if not os.path.isdir(path):  # v2: one directory serves every controller
                    os.mkdir(path)
                self.dirs[ctrl] = (ver, path)
                if ctrl == "pids":
                    ok = _write(os.path.join(path, "pids.max"), str(pids))
                elif ver == "v1":
                    ok = _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                else:
                    ok = _write(os.path.join(path, "memory.max"), str(memory_bytes))
                    _write(os.path.join(path, "memory.swap.max"), "0")
                if not ok:
                    raise OSError(f"cannot set the {ctrl} limit in {path}")
        except OSError:
            self.remove()
            raise

    def procs_files(self) -> list[str]:
        seen, out = set(), []
        for _ver, path in self.dirs.values():
            if path not in seen:
                seen.add(path)
                out.append(os.path.join(path, "cgroup.procs"))
        return out

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files():
            out |= {int(x) for x in (_read(f) or "").split()}
        return out

    def kill_all(self, timeout: float = 2.0) -> None:
        end = time.monotonic() + timeout
        for _ver, path in self.dirs.values():
            if os.path.exists(os.path.join(path, "cgroup.kill")):
                _write(os.path.join(path, "cgroup.kill"), "1")
        while time.monotonic() < end:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.002)

    def stats(self, peak: bool = True) -> dict:
        out: dict = {}
        if "memory" in self.dirs:
            ver, path = self.dirs["memory"]
            if ver == "v1":
                top = _read(os.path.join(path, "memory.max_usage_in_bytes")) if peak else None
                oom = _kv(_read(os.path.join(path, "memory.oom_control"))).get("oom_kill", 0)
                fail = int((_read(os.path.join(path, "memory.failcnt")) or "0").strip() or 0)
            else:
                top = _read(os.path.join(path, "memory.peak")) if peak else None
                ev = _kv(_read(os.path.join(path, "memory.events")))
                oom, fail = ev.get("oom_kill", 0), ev.get("max", 0)
            if peak:
                out["peak_memory"] = int(top.strip()) if top and top.strip().isdigit() else None
            out["oom_kill"], out["memory_failcnt"] = oom, fail
        if "pids" in self.dirs:
            _ver, path = self.dirs["pids"]
            out["pids_max_hit"] = _kv(_read(os.path.join(path, "pids.events"))).get("max", 0)
        for ver, path in self.dirs.values():
            if ver == "v2":
                usec = _kv(_read(os.path.join(path, "cpu.stat"))).get("usage_usec")
                if usec is not None:
                    out["cpu_time"] = usec / 1e6
                break
        if "cpuacct" in self.dirs and "cpu_time" not in out:
            ns = (_read(os.path.join(self.dirs["cpuacct"][1], "cpuacct.usage")) or "").strip()
            if ns.isdigit():
                out["cpu_time"] = int(ns) / 1e9
        return out

    def pids_headroom(self, n: int) -> None:
        """Let ``n`` more tasks in than the cgroup holds now (the tasks of the start itself)."""
        if "pids" in self.dirs:
            path = self.dirs["pids"][1]
            cur = (_read(os.path.join(path, "pids.current")) or "").strip()
            if cur.isdigit():
                _write(os.path.join(path, "pids.max"), str(n + int(cur)))

    def set_memory(self, memory_bytes: int) -> bool:
        if "memory" not in self.dirs:
            return False
        ver, path = self.dirs["memory"]
        if ver == "v1":
            # memsw must stay >= the plain limit: lower the plain limit first when going down
            files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            cur = (_read(os.path.join(path, files[0])) or "").strip()
            if cur.isdigit() and int(cur) < memory_bytes:
                files.reverse()
            ok = [_write(os.path.join(path, f), str(memory_bytes)) for f in files]
            return ok[files.index("memory.limit_in_bytes")]
        return _write(os.path.join(path, "memory.max"), str(memory_bytes))

    def begin(self) -> dict:
        """Counters before one run of a session (and the memory peak reset to the current usage)."""
        st = self.stats(peak=False)
        if "memory" in self.dirs:
            ver, path = self.dirs["memory"]
            if ver == "v1":
                _write(os.path.join(path, "memory.max_usage_in_bytes"), "0")
            else:  # kernels >= 6.12: a write resets the peak seen through this descriptor
                try:
                    fd = os.open(os.path.join(path, "memory.peak"), os.O_RDWR)
                except OSError:
                    fd = None
                if fd is not None:
                    try:
                        os.write(fd, b"reset\n")
                        st["_peak_fd"] = fd
                    except OSError:
                        os.close(fd)
        return st

    def end(self, before: dict) -> dict:
        """The run's own figures: counters as differences from :meth:`begin`, its memory peak."""
        now = self.stats(peak=True)
        out = dict(now)
        for k in ("oom_kill", "memory_failcnt", "pids_max_hit", "cpu_time"):
            if k in now and k in before:
                out[k] = now[k] - before[k]
        fd = before.get("_peak_fd")
        if fd is not None:
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                txt = os.read(fd, 64).decode().strip()
                if txt.isdigit():
                    out["peak_memory"] = int(txt)
            except OSError:
                pass
            finally:
                os.close(fd)
        elif self.dirs.get("memory", ("v1",))[0] == "v2":
            out["peak_memory"] = None  # the whole start's peak is not this run's: rusage instead
        return out

    def remove(self) -> None:
        for _ver, path in dict.fromkeys(self.dirs.values()):
            for _ in range(500):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.004)
        self.dirs = {}


def _cgroup_bases(cfg: SandboxConfig) -> dict[str, tuple[str, str]]:
    if cfg.cgroup_root:
        avail = (_read(os.path.join(cfg.cgroup_root, "cgroup.subtree_control")) or "").split()
        return {c: ("v2", cfg.cgroup_root) for c in ("pids", "memory") if c in avail}
    bases = _cgroup_dirs()
    out = {}
    for ctrl, (ver, path) in bases.items():
        if ctrl == "cpuacct" and not os.access(path, os.W_OK):
            continue
        if ver == "v2":
            # v2: children may only use controllers enabled in the parent's subtree_control;
            # a non-root cgroup that holds processes cannot enable them (no internal processes).
            enabled = (_read(os.path.join(path, "cgroup.subtree_control")) or "").split()
            if ctrl not in enabled and not _write(os.path.join(path, "cgroup.subtree_control"), f"+{ctrl}"):
                continue
        out[ctrl] = (ver, path)
    return out


# --------------------------------------------------------------------------------------------
# the launcher: runs inside the sandbox, before any untrusted code
# --------------------------------------------------------------------------------------------
# argv: LIMITS UID GID READY_FD PROGRAM [ARGS...] (or ``-x BINARY [ARGS...]``: exec it),
# LIMITS = "AS:soft:hard,CPU:soft:hard,..." (-1: the highest it may set, the inherited hard limit).
# Sets rlimits, drops to the uid when root, then forks: the first process stays as the run's reaper
# (a child subreaper: every orphan of the run comes to it, a daemon that left the process group
# too; when the program's process ends, or on SIGTERM from the host, it stops, SIGKILLs and reaps
# whatever of the run is left, then ends as the program's process ended); the child tells the host
# it is ready on READY_FD, closes every inherited descriptor but 0-2 and runs PROGRAM as module
# __main__. No json or runpy here: their imports (re, enum, importlib.util) would double the
# start-up time.
_LAUNCHER = r"""
import os, sys, resource, builtins, _signal
def _reap(pid):
    try:
        import ctypes
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass
    import time
    def tree():  # every descendant (the run's orphans are children of this process)
        out, todo = [], [os.getpid()]
        while todo:
            p = todo.pop()
            try:
                tids = os.listdir('/proc/%d/task' % p)
            except OSError:
                continue
            for t in tids:
                try:
                    with open('/proc/%d/task/%s/children' % (p, t)) as f:
                        kids = [int(k) for k in f.read().split()]
                except (OSError, ValueError):
                    continue
                out += kids
                todo += kids
        return out
    def rest():  # stop them all (a stopped process forks no more), kill them, reap them
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            seen = set()
            while time.monotonic() < end:
                new = [p for p in tree() if p not in seen]
                if not new:
                    break
                for p in new:
                    seen.add(p)
                    try:
                        os.kill(p, 19)
                    except OSError:
                        pass
            for p in seen:
                try:
                    os.kill(p, 9)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                return
            time.sleep(0.001)
    def term(*_):
        try:
            os.kill(pid, 9)
        except OSError:
            pass
        rest()
        os.kill(os.getpid(), 9)
    keep = {_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD, _signal.SIGSEGV, _signal.SIGBUS,
            _signal.SIGFPE, _signal.SIGILL, _signal.SIGABRT, _signal.SIGTRAP, _signal.SIGSYS}
    for s in range(1, _signal.NSIG):  # what the program sends its process group is not for the reaper
        if s not in keep:
            try:
                _signal.signal(s, term if s == _signal.SIGTERM else _signal.SIG_IGN)
            except (OSError, ValueError, RuntimeError):
                pass
    os.closerange(0, 65536)  # (the go-ahead pipe too: the program's process starts now)
    while True:
        got, st = os.waitpid(-1, 0)
        if got == pid:
            break
    rest()
    rc = os.waitstatus_to_exitcode(st)
    if rc < 0:
        try:
            _signal.signal(-rc, _signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), -rc)
        rc = 128 - rc
    os._exit(rc)
def _launch(a):
    for item in a[1].split(','):
        name, soft, hard = item.split(':')
        res, soft, hard = getattr(resource, 'RLIMIT_' + name), int(soft), int(hard)
        if hard == resource.RLIM_INFINITY:  # as high as it may be: the inherited hard limit
            hard = resource.getrlimit(res)[1]
            soft = hard if soft == resource.RLIM_INFINITY else soft
        resource.setrlimit(res, (soft, hard))
    uid, gid = int(a[2]), int(a[3])
    if os.getuid() == 0:
        os.setgroups([]); os.setresgid(gid, gid, gid); os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit('cascade-sandbox: could not drop root')
    os.umask(0o022)  # not the host's (077 would make the compiled program the uid's alone)
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(go_r)
        _reap(pid)
    os.close(go_w)
    os.read(go_r, 1)  # until the reaper is one
    os.write(int(a[4]), b'R')
    os.closerange(3, 65536)
    if a[5] == '-x':  # a binary (C++): exec it in the clean environment, with the default actions of
        for s in (_signal.SIGPIPE, _signal.SIGXFSZ):  # these two (Python ignores them; ignored, they
            _signal.signal(s, _signal.SIG_DFL)        # would stay so across execv)
        os.execv(a[6], a[6:])
    sys.argv = a[5:]
    sys.path[0] = os.path.dirname(a[5])
    builtins.exit = builtins.quit = sys.exit
    with open(a[5], 'rb') as f:
        code = compile(f.read(), a[5], 'exec')
    m = type(sys)('__main__')
    m.__file__ = a[5]
    m.__builtins__ = builtins
    sys.modules['__main__'] = m
    return code, m.__dict__
_c, _g = _launch(sys.argv)
del _launch, _reap
exec(_c, _g)
"""


def _python_install(cfg: SandboxConfig) -> tuple[str, str]:
    """(interpreter path, installation prefix) of the Python run inside the sandbox."""
    if cfg.python:
        exe = shutil.which(cfg.python) or cfg.python
        exe = os.path.realpath(exe)
        if not os.path.exists(exe):
            raise ValueError(f"sandbox python {cfg.python!r} not found")
        return exe, os.path.dirname(os.path.dirname(exe))
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


def _world_readable(path: str) -> bool:
    """Whether a user with no ownership of ``path`` could read it (every parent searchable)."""
    import stat

    p = os.path.realpath(path)
    try:
        if not os.stat(p).st_mode & stat.S_IROTH:
            return False
        while p != "/":
            p = os.path.dirname(p)
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def _weak_python(exe: str, prefix: str) -> tuple[str, str]:
    """Without bwrap the interpreter is used in place: it must be readable by the sandbox uid."""
    if os.getuid() != 0 or _world_readable(exe) and _world_readable(os.path.join(prefix, "lib")):
        return exe, prefix
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and _world_readable(cand):
            real = os.path.realpath(cand)
            return real, os.path.dirname(os.path.dirname(real))
    raise SandboxError(f"python {exe} is not readable by uid 65534 and no system python3 is; "
                       "install bubblewrap or set SandboxConfig(python=...)")


def _bwrap() -> str | None:
    return shutil.which("bwrap")


@functools.lru_cache(maxsize=None)
def _site_packages(roots: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    """The site-packages / dist-packages directories under ``roots`` (what the sandbox binds: /usr
    and the interpreter's installation), as real paths, none inside another."""
    import glob
    import sysconfig

    found = set()
    for key in ("purelib", "platlib"):  # this interpreter's layout, applied to the sandbox's prefix
        try:
            found.add(sysconfig.get_path(key, vars={"base": prefix, "platbase": prefix}))
        except KeyError:
            pass
    for root in roots:  # any other Python's there: lib/python3.X, lib64/..., Debian's dist-packages
        for pat in ("lib*/python*/site-packages", "lib*/python*/dist-packages", "local/lib*/python*/*-packages"):
            found.update(glob.glob(os.path.join(root, pat)))
    real = {os.path.realpath(d) for d in found if os.path.isdir(d)}
    real = {d for d in real if any(d.startswith(r + "/") for r in roots)}  # (what the sandbox sees)
    return tuple(sorted(d for d in real if not any(d.startswith(o + "/") for o in real)))


def _bind_args(exe: str, prefix: str, box: str, tmpfs_bytes: int, size_ok: bool) -> list[str]:
    a = ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(d):
            a += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            a += ["--ro-bind", d, d]
    a += ["--perms", "0755", "--dir", "/etc"]  # (bwrap would make it 0700: root's alone, unreadable to runs)
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(f):
            a += ["--ro-bind", f, f]
    roots = {prefix, os.path.dirname(exe)}
    bound = ["/usr"]
    for root in sorted(roots):
        if root == "/usr" or root.startswith("/usr/") or any(root.startswith(r + "/") for r in roots):
            continue  # under /usr, or inside the other root (the interpreter in its prefix's bin)
        parts = root.strip("/").split("/")
        for i in range(1, len(parts)):  # traversable parents (bwrap would make them 0700 otherwise)
            a += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        a += ["--ro-bind", root, root]
        bound.append(root)
    # runs are stdlib-only (python -S -s; the supervisor too): every site-packages under what is bound
    # is an empty read-only mount, so that nothing installed there (this project itself, if installed
    # as a package: its seeds' hidden tests and reference programs) can be read from inside
    for d in _site_packages(tuple(bound), prefix):
        a += ["--perms", "0555", "--tmpfs", d, "--remount-ro", d]
    a += ["--ro-bind", box, BOX, "--proc", "/proc", "--dev", "/dev"]
    # /tmp (the working directory) and /dev/shm (POSIX shared memory and semaphores: multiprocessing's
    # locks and queues need it): private tmpfs, world-writable and sticky, each capped at tmpfs_bytes
    # (where bwrap has --size); what they hold is memory of the start's cgroup
    for d in (SHM_DIR, WORKDIR):
        if size_ok:
            a += ["--size", str(tmpfs_bytes)]
        a += ["--perms", "1777", "--tmpfs", d]
    a += ["--chdir", WORKDIR]
    return a


def _nproc_limit(cfg: SandboxConfig, layers: list[str]) -> int:
    """RLIMIT_NPROC of a run. The kernel counts it over every process of the uid on the host (every
    sandbox start of this uid, and anything else running as it), so it only serves where no pids
    cgroup caps the run: with one, -1 (RLIM_INFINITY), which the run sets as the highest limit it
    may (the hard limit it inherited: it cannot raise it)."""
    return cfg.max_processes if "cgroup_pids" not in layers else resource.RLIM_INFINITY


def _put_files(box: str, files: dict[str, str | bytes]) -> None:
    """Write the session's files: text (source) 0644, bytes (a compiled program) 0755, owned by the host."""
    for name, data in files.items():
        path = os.path.join(box, name)
        if isinstance(data, (bytes, bytearray)):
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, 0o755)
        else:
            with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:  # (a lone surrogate: bytes as they are)
                f.write(data)
            os.chmod(path, 0o644)


def language_of(path: str, default: str = "python") -> str:
    """The language of a program file by its extension (``.cpp``/``.cc``/``.cxx``/``.c++`` -> cpp)."""
    ext = os.path.splitext(path)[1].lower()
    return "cpp" if ext in (".cpp", ".cc", ".cxx", ".c++", ".hpp") else ("python" if ext == ".py" else default)


def _compiler(cfg: SandboxConfig) -> str:
    """The C++ compiler's path as the sandbox sees it (it must lie in the read-only /usr view)."""
    found = shutil.which(cfg.cxx)
    if found is None:
        raise SandboxUnavailable(f"C++ needs the compiler {cfg.cxx!r}, which is not installed "
                                 "(apt-get install g++), or set SandboxConfig(cxx=...)")
    for cand in (found, os.path.realpath(found)):
        if cand.startswith(("/usr/", "/bin/")):
            return cand
    raise SandboxUnavailable(f"the C++ compiler {found} lies outside /usr, which is all the sandbox sees; "
                             "use a system compiler (SandboxConfig(cxx=...))")


def _check_exec_dir() -> None:
    """The compiled programs live in the box directories under the temporary directory: they
    could not run from a ``noexec`` mount (every test would fail), so refuse that up front."""
    tmp = tempfile.gettempdir()
    try:
        noexec = bool(os.statvfs(tmp).f_flag & getattr(os, "ST_NOEXEC", 0))
    except OSError:
        noexec = False
    if noexec:
        raise SandboxUnavailable(f"C++ programs cannot run from {tmp}: it is mounted noexec; point TMPDIR "
                                 "at a directory that allows executables")


def _compile_argv(cfg: SandboxConfig, cxx: str, source: str, output: str) -> list[str]:
    return [cxx, *cfg.cxx_flags, "-o", output, source]


_BIN_SUFFIX = ".bin"   # the compiled program of source X is the session file X + ".bin"
_BUILD_OUT = "/tmp/cascade-build.bin"   # where the compile writes it, inside the start


def _compile_message(v: Verdict, cfg: SandboxConfig) -> str:
    """The compiler's message for a failed compile (paths inside the sandbox shortened)."""
    if "total_time" in v.limits_hit:
        why = (f"compilation was stopped after {v.wall_time:.2f} s, when the session's time ran out "
               f"(its total time budget; the compile time limit is {cfg.compile_time_limit:g} s)")
        text = (v.stderr or v.stdout).replace(BOX + "/", "").replace(WORKDIR + "/", "").strip()
        return "\n".join(x for x in (why, text) if x)
    why = {"time_limit": f"compilation exceeded the compile time limit ({cfg.compile_time_limit:g} s)",
           "memory_limit": f"compilation exceeded the compile memory limit ({cfg.compile_memory_mb} MiB)",
           "output_limit": "the compiler's messages exceeded the output limit",
           "killed": f"the compiler was killed (signal {v.signal})"}.get(v.status, "")
    text = (v.stderr or v.stdout).replace(BOX + "/", "").replace(WORKDIR + "/", "").strip()
    return "\n".join(x for x in (why, text) if x) or f"compilation failed (exit {v.exit_code})"


def _clean_env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", "MALLOC_ARENA_MAX": "2",
    }


# --------------------------------------------------------------------------------------------
# layer detection
# --------------------------------------------------------------------------------------------
_DETECT_LOCK = threading.Lock()
_DETECTED: dict[tuple, dict[str, str | None]] = {}


def detect_layers(cfg: SandboxConfig | None = None, refresh: bool = False) -> dict[str, str | None]:
    """layer -> None if present, else the reason it is missing. Probed once per process and key."""
    cfg = cfg or SandboxConfig()
    key = (cfg.python, cfg.uid, cfg.gid, cfg.cgroup_root)
    with _DETECT_LOCK:
        if key in _DETECTED and not refresh:
            return dict(_DETECTED[key])
        res = _probe(cfg)
        _DETECTED[key] = res
        return dict(res)


def _probe(cfg: SandboxConfig) -> dict[str, str | None]:
    res: dict[str, str | None] = {k: None for k in LAYERS}
    if not hasattr(os, "setgroups") or sys.platform != "linux":
        return {k: "needs Linux" for k in LAYERS}
    bw = _bwrap()
    if bw is None:
        res["namespaces"] = "bwrap (bubblewrap) is not installed (apt-get install bubblewrap)"
        res["seccomp"] = "needs bwrap to load the filter"
    elif seccomp_filter() is None:
        res["seccomp"] = f"no seccomp filter for machine {platform.machine()!r}"
    if os.geteuid() != 0 and os.getuid() == 0:
        res["uid"] = "running setuid-root is not supported"
    try:
        bases = _cgroup_bases(cfg)
    except OSError as e:
        bases = {}
        why = str(e)
    else:
        why = "no writable cgroup hierarchy with this controller"
    for ctrl in ("pids", "memory"):
        layer = f"cgroup_{ctrl}"
        if ctrl not in bases:
            res[layer] = why
            continue
        try:
            cg = _RunCgroup({ctrl: bases[ctrl]}, 64 << 20, 8)
            cg.remove()
        except OSError as e:
            res[layer] = f"cannot create a cgroup under {bases[ctrl][1]}: {e}"
    if bw is not None:
        # the real thing: run a program with every layer this machine claims to have
        probe_cfg = SandboxConfig(time_limit=20.0, python=cfg.python, uid=cfg.uid, gid=cfg.gid,
                                  allow_weaker=True, cgroup_root=cfg.cgroup_root, warm=0)
        sb = Sandbox(probe_cfg, _layers=res)
        try:
            v = sb.run("import os\nprint(os.getuid())\n")
            if v.status != "ok" or v.stdout.strip() != str(cfg.uid):
                raise SandboxError(f"probe program gave {v.status}: {v.stderr.strip()[-300:]}")
        except SandboxError as e:
            res["namespaces"] = f"bwrap does not work here: {e}"[:500]
            if res["seccomp"] is None:
                res["seccomp"] = "needs bwrap to load the filter"
    return res


# --------------------------------------------------------------------------------------------
# sandbox starts ("cells"): bwrap + cgroup + seccomp around the supervisor, which runs many programs
# --------------------------------------------------------------------------------------------
from envs.code.supervisor import STUB as _SUP_STUB  # noqa: E402

_SUP_LOCK = threading.Lock()
_SUP_DIR: list[str] = []


def _supervisor_dir() -> str:
    """A private directory holding the supervisor and its bytecode (bound read-only at /sup), made
    once per process: the sandbox's interpreter loads the bytecode instead of compiling each start."""
    import py_compile

    from envs.code import supervisor

    with _SUP_LOCK:
        if _SUP_DIR and os.path.isdir(_SUP_DIR[0]):
            return _SUP_DIR[0]
        d = tempfile.mkdtemp(prefix="cascade-sup-")
        src = os.path.join(d, "cascade_supervisor.py")
        shutil.copyfile(supervisor.__file__, src)
        py_compile.compile(src, doraise=True)  # this interpreter's tag; another one compiles the source
        for root, dirs, names in os.walk(d):
            os.chmod(root, 0o755)
            for n in names:
                os.chmod(os.path.join(root, n), 0o644)
        _SUP_DIR[:] = [d]
        atexit.register(shutil.rmtree, d, True)
        return d


_CELL_TASKS = 3      # a start's tasks besides its runs: bwrap, its pid 1 (the namespace's init), the supervisor
WARM_IDLE_S = 30.0   # ready sandboxes unused for this long are closed (and refilled on the next run)
_RUN_GRACE_S = 5.0   # the host gives the supervisor this long past a run's wall limit before it acts
_PIPE_GRACE_S = 0.5  # weaker mode: how long the host still reads the pipes once the run's process is gone
_REAPER_GRACE_S = 0.5  # weaker mode: how long the launcher's reaper gets to kill a run the host stops


@dataclass
class Run:
    """One program run of a session: ``entry`` (a file of the session) run with ``stdin`` and ``args``.

    ``language``: ``"python"`` (``entry`` is Python source) or ``"cpp"`` (``entry`` is C++ source,
    compiled once per session in the same start before its first run; see :meth:`Sandbox.run_many`)."""

    entry: str = "main.py"
    stdin: str | bytes = b""
    args: tuple = ()
    time_limit: float | None = None
    memory_mb: int | None = None
    language: str = "python"


class _CellDead(SandboxError):
    """The sandbox start ended in the middle of a run. ``verdict``: that run's, if it started;
    ``retry``: the run may be run again in a fresh start (it cannot have caused this)."""

    def __init__(self, msg: str, verdict: Verdict | None = None, retry: bool = False):
        super().__init__(msg)
        self.verdict = verdict
        self.retry = retry or verdict is None


class _Cell:
    """One sandbox start: a cgroup, a box directory, bwrap with every layer, and the supervisor inside,
    ready for runs. Used by one session (one solution), then closed; never reused across sessions."""

    def __init__(self, sb: "Sandbox"):
        cfg = sb.config
        self.phases: dict[str, float] = {}
        t = time.perf_counter()
        self.layers = [k for k, v in sb.layers.items() if v is None]
        self.box = tempfile.mkdtemp(prefix="cascade-box-")
        self.cgroup: _RunCgroup | None = None
        self.proc: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.errf = None
        self.runs = 0
        self.mem_limit = None
        self.run_phases: dict[str, float] = {}  # of the last run: host-side steps (seconds)
        fds: list[int] = []  # the sandbox's ends (closed here once bwrap has them)
        host_fds: list[int] = []  # ours (closed when the start is made)
        try:
            os.chmod(self.box, 0o755)
            exe, prefix = _python_install(cfg)
            t1 = time.perf_counter()
            self.phases["box_dir"] = t1 - t
            argv: list[str] = []
            ctrl_bases = {c: v for c, v in _cgroup_bases(cfg).items()
                          if f"cgroup_{c}" in self.layers or c == "cpuacct"}
            if ctrl_bases:
                self.mem_limit = (cfg.memory_mb + cfg.tmpfs_mb + 32) << 20
                # the start's own tasks (bwrap, bwrap's pid 1 in the namespace, the supervisor) on top of
                # the run's max_processes; set to what is there once the supervisor is ready
                self.cgroup = _RunCgroup(ctrl_bases, self.mem_limit, cfg.max_processes + _CELL_TASKS)
            t2 = time.perf_counter()
            self.phases["cgroup_create"] = t2 - t1
            self.ctl, inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fds.append(inner.detach())
            argv += [_bwrap(), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                     "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
            join = None
            if self.cgroup is not None:
                # bwrap reports its sandbox child's pid (--info-fd) and holds it (--block-fd) after
                # its namespaces and mounts, before seccomp and the supervisor: the host moves bwrap
                # and that child into the cgroup(s), then lets it go, so nothing it runs is outside
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                join = (info_r, block_w)
                host_fds.extend(join)
                fds += [info_w, block_r]
                argv += ["--info-fd", str(info_w), "--block-fd", str(block_r)]
            if os.getuid() == 0:
                # the supervisor stays root with these three only; each run drops to the uid (and loses them)
                argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                         "--cap-add", "CAP_KILL"]
            else:
                argv += ["--unshare-user", "--uid", str(cfg.uid), "--gid", str(cfg.gid)]
            argv += _bind_args(exe, prefix, self.box, cfg.tmpfs_mb << 20, sb._bwrap_has_size())
            argv += ["--ro-bind", _supervisor_dir(), "/sup", "--mqueue", "/dev/mqueue"]
            for k, v in _clean_env().items():
                argv += ["--setenv", k, v]
            if "seccomp" in self.layers:
                sr, sw = os.pipe()
                fds.append(sr)
                os.write(sw, seccomp_filter())
                os.close(sw)
                argv += ["--seccomp", str(sr)]
            argv += ["--", exe, "-S", "-s", "-B", "-c", _SUP_STUB, str(fds[0]), str(cfg.uid), str(cfg.gid)]
            self.errf = tempfile.TemporaryFile()
            t3 = time.perf_counter()
            self.phases["argv"] = t3 - t2
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=self.errf, env=_clean_env(), cwd="/", pass_fds=fds,
                                         start_new_session=True, close_fds=True)
            t4 = time.perf_counter()
            self.phases["spawn"] = t4 - t3
            for fd in fds:
                os.close(fd)
            fds = []
            if join is not None:
                self._join_cgroup(*join)
            msg = self._recv(SETUP_TIMEOUT)
            t5 = time.perf_counter()
            if not msg.startswith(b"ready "):
                raise SandboxError(f"the sandbox did not start: {self._errors() or msg[:200]!r}")
            # the supervisor's first line ran at T0 (same monotonic clock): before it, bwrap, the
            # cgroup join and the interpreter start; after it, the supervisor's imports
            t0_in = float(msg.split()[1])
            now_mono, now_perf = time.monotonic(), time.perf_counter()
            t0_perf = now_perf - (now_mono - t0_in)
            self.phases["bwrap_and_interpreter"] = max(0.0, t0_perf - t4)
            self.phases["supervisor_ready"] = max(0.0, t5 - t0_perf)
            self.phases["total"] = t5 - t
            if self.cgroup is not None:
                self.cgroup.pids_headroom(cfg.max_processes)  # the run's budget on top of what is there
                # CPU from the join (bwrap's set-up before it is not counted) to the supervisor being
                # ready, all cores
                cpu = self.cgroup.stats(peak=False).get("cpu_time")
                if cpu is not None:
                    self.phases["cpu_in_sandbox"] = cpu
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.close()
            raise
        finally:
            for fd in host_fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _join_cgroup(self, info_r: int, block_w: int) -> None:
        """Read bwrap's ``child-pid`` from its info descriptor, write bwrap's pid and that child's into
        every ``cgroup.procs`` of the start, then release the child (a byte on its block descriptor)."""
        import json

        buf, end, info = b"", time.monotonic() + SETUP_TIMEOUT, None
        while info is None:
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise SandboxError(f"the sandbox did not start: no child pid from bwrap ({self._errors()})")
            if _readable(info_r, min(left, 0.5)):
                chunk = os.read(info_r, 4096)
                if not chunk:
                    raise SandboxError(f"the sandbox did not start: {self._errors() or 'bwrap ended'}")
                buf += chunk
                try:
                    info = json.loads(buf)
                except ValueError:
                    continue
        for f in self.cgroup.procs_files():
            for pid in (self.proc.pid, int(info["child-pid"])):
                if not _write(f, str(pid)):
                    raise SandboxError(f"cannot move the sandbox ({pid}) into {f}")
        os.write(block_w, b"x")

    def _errors(self) -> str:
        if self.errf is None:
            return ""
        try:
            self.errf.seek(0)
            return self.errf.read()[-2000:].decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def _recv(self, timeout: float) -> bytes:
        """The next message from the supervisor (b"" if it is gone)."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise SandboxError(f"the sandbox did not answer within {timeout:g} s")
            if _readable(self.ctl.fileno(), left):
                try:
                    return self.ctl.recv(4096)
                except OSError:
                    return b""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.ctl is not None

    def close(self) -> None:
        """End the start: the supervisor kills what is left; then the cgroup and the box go."""
        if self.ctl is not None:
            try:
                self.ctl.close()
            except OSError:
                pass
            self.ctl = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                if self.cgroup is not None:
                    self.cgroup.kill_all(1.0)
                try:
                    self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            self.proc = None
        if self.cgroup is not None:
            self.cgroup.kill_all()
            self.cgroup.remove()
            self.cgroup = None
        if self.errf is not None:
            self.errf.close()
            self.errf = None
        if self.box:
            shutil.rmtree(self.box, ignore_errors=True)
            self.box = ""

    def put_files(self, files: dict[str, str | bytes]) -> None:
        _put_files(self.box, files)

    def fetch(self, path: str) -> bytes:
        """The file ``path`` of the start (its ``/tmp``, between runs), handed over by the supervisor."""
        with tempfile.TemporaryFile() as f:
            try:
                self.ctl.sendmsg([b"F " + path.encode()],
                                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", f.fileno()))])
                m = self._recv(SETUP_TIMEOUT)
            except (OSError, SandboxError) as e:
                raise _CellDead(f"the sandbox is gone: {e}; {self._errors()}") from None
            if not m.startswith(b"F "):
                raise _CellDead(f"the sandbox did not hand over {path}: {m[:200]!r}; {self._errors()}")
            code, _, rest = m[2:].partition(b" ")
            if code != b"0":
                raise SandboxError(f"cannot take {path} out of the sandbox: {rest.decode('utf-8', 'replace')}")
            f.seek(0)
            return f.read()


class _Pool:
    """Sandbox starts made ahead so that a session finds one ready. ``size`` long-lived threads
    each keep one start ready (bwrap dies with the thread that started it, so these threads live
    as long as the pool); one more closes used starts off the callers' path. Each start still
    serves a single session."""

    def __init__(self, sb: "Sandbox", size: int):
        self.sb = sb
        self.size = size
        self.ready: list[_Cell] = []
        self.dead: list[_Cell] = []
        self.starting = 0
        self.waiting = 0
        self.cv = threading.Condition()
        self.threads: list[threading.Thread] = []
        self.closed = False
        self.last_take = time.monotonic()
        self.failures = 0

    def take(self) -> _Cell | None:
        with self.cv:
            if self.closed:
                return None
            if not self.threads:
                for k in range(self.size):
                    self.threads.append(threading.Thread(target=self._fill, name=f"cascade-sandbox-warm-{k}",
                                                         daemon=True))
                self.threads.append(threading.Thread(target=self._reap, name="cascade-sandbox-reap", daemon=True))
                for th in self.threads:
                    th.start()
            self.last_take = time.monotonic()
            self.cv.notify_all()
            end = time.monotonic() + SETUP_TIMEOUT
            while True:
                while self.ready:
                    cell = self.ready.pop(0)
                    if cell.alive():
                        self.cv.notify_all()
                        return cell
                    self.dead.append(cell)
                # a start under way finishes sooner than a new one (and costs no more CPU): wait for
                # it, unless enough callers already wait for the ones under way
                if self.closed or self.starting <= self.waiting or time.monotonic() >= end:
                    return None
                self.waiting += 1
                try:
                    self.cv.wait(timeout=end - time.monotonic())
                finally:
                    self.waiting -= 1

    def discard(self, cell: _Cell) -> bool:
        """Close ``cell`` in the background; False when the pool cannot (closed, or never started)."""
        with self.cv:
            if self.closed or not self.threads:
                return False
            self.dead.append(cell)
            self.cv.notify_all()
            return True

    def _idle(self) -> bool:
        return time.monotonic() - self.last_take > WARM_IDLE_S

    def _fill(self) -> None:
        while True:
            with self.cv:
                while not self.closed and (self._idle() or len(self.ready) + self.starting >= self.size):
                    if self._idle() and self.ready:  # unused for long: close them (refilled on the next run)
                        self.dead += self.ready
                        self.ready = []
                        self.cv.notify_all()
                    self.cv.wait(timeout=WARM_IDLE_S / 4)
                if self.closed:
                    return
                self.starting += 1
            cell = None
            try:
                cell = _Cell(self.sb)
                self.failures = 0
            except Exception:  # the next session starts its own and reports the error
                self.failures += 1
            with self.cv:
                self.starting -= 1
                if cell is not None:
                    (self.dead if self.closed else self.ready).append(cell)
                self.cv.notify_all()
            if cell is None:
                time.sleep(min(30.0, 0.5 * 2 ** self.failures))

    def _reap(self) -> None:
        while True:
            with self.cv:
                while not self.dead and not self.closed:
                    self.cv.wait()
                dead, self.dead = self.dead, []
                if self.closed and not dead:
                    return
            for c in dead:
                c.close()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            cells, self.ready = self.ready, []
            self.cv.notify_all()
            threads = list(self.threads)
        for c in cells:
            c.close()
        for th in threads:
            if th is not threading.current_thread():
                th.join(timeout=5.0)
        with self.cv:  # a start that finished while closing
            cells, self.dead = self.dead, []
        for c in cells:
            c.close()


_POOLS: "weakref.WeakSet[_Pool]" = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for p in list(_POOLS):
        p.close()


def _forget_pools() -> None:
    """In a forked child: the parent's starts and pool threads are not this process's."""
    for p in list(_POOLS):
        p.closed, p.ready, p.dead, p.threads, p.starting, p.waiting = True, [], [], [], 0, 0
    _POOLS.clear()


os.register_at_fork(after_in_child=_forget_pools)


# --------------------------------------------------------------------------------------------
# the sandbox
# --------------------------------------------------------------------------------------------
class Sandbox:
    """Runs programs under ``config``. Thread-safe: one sandbox serves a pool of threads."""

    def __init__(self, config: SandboxConfig | None = None, *, _layers: dict | None = None):
        self.config = config or SandboxConfig()
        self._layers = _layers
        self._size_ok: bool | None = None
        self._pool: _Pool | None = None
        self._pool_lock = threading.Lock()

    @property
    def layers(self) -> dict[str, str | None]:
        if self._layers is None:
            self._layers = detect_layers(self.config)
        return self._layers

    def missing(self) -> dict[str, str]:
        return {k: v for k, v in self.layers.items() if v is not None}

    def check(self) -> None:
        """Raise :class:`SandboxUnavailable` naming every missing layer the config does not allow; where the
        ``namespaces`` layer is missing but allowed, warn (once per process) what that loses."""
        missing = self.missing()
        refused = {k: v for k, v in missing.items() if k not in self.config.allowed_missing()}
        if refused:
            detail = "; ".join(f"{k}: {v}" for k, v in refused.items())
            raise SandboxUnavailable(
                f"sandbox refuses to run without layer(s) {', '.join(refused)} ({detail}); "
                f"allow a weaker sandbox with SandboxConfig(allow_weaker=True) or allow_missing=(...), "
                f"or {ALLOW_ENV}=1" + (f"; but {NO_NAMESPACES}" if "namespaces" in refused else ""))
        if "namespaces" in missing:
            _warn_no_namespaces(missing["namespaces"])

    def describe(self) -> dict:
        return {"layers": {k: (v is None) for k, v in self.layers.items()},
                "missing": self.missing(), "config": asdict(self.config)}

    # ---------------------------------------------------------------------------------------
    def run(self, program: str, stdin: str | bytes = b"", *, files: dict[str, str] | None = None,
            args: list[str] | tuple = (), time_limit: float | None = None,
            memory_mb: int | None = None, language: str = "python") -> Verdict:
        """Run ``program`` (Python source, or C++ source with ``language="cpp"``: compiled in the
        sandbox first, see :meth:`run_many`) with ``stdin``; ``files`` are extra read-only files
        beside it (in ``/box``)."""
        entry = {"python": "main.py", "cpp": "main.cpp"}.get(language)
        if entry is None:
            raise ValueError(f"unknown language {language!r}; choose from {', '.join(LANGUAGES)}")
        return self.run_many({**(files or {}), entry: program},
                             [Run(entry, stdin, tuple(args), time_limit, memory_mb, language)])[0]

    def run_many(self, files: dict[str, str], runs: list[Run], *, deadline: float | None = None,
                 on_verdict=None) -> list[Verdict | None]:
        """Run each of ``runs`` (a file of ``files``, with its stdin and limits) inside one sandbox
        start: each run is its own process with its own limits, output cap and emptied ``/tmp``;
        nothing of one run (process, file, global) is left for the next.

        ``deadline`` (``time.monotonic()``): runs not started before it are not run, and a run's
        wall limit is cut to what is left. ``on_verdict(i, verdict)`` returning False stops the
        session. Runs not run are None. A run that hits a wall (or CPU) limit cut short that way is
        a ``time_limit`` verdict whose ``limits_hit`` names ``total_time`` (not ``wall_time``: the
        deadline ended it, not its own limit). Without bubblewrap (the weaker mode) each run gets
        its own start; as a non-root user too (the supervisor then shares the runs' uid, so a run could
        signal it: one run per start keeps each run's verdict its own).

        C++ (``Run(language="cpp")``, ``entry`` a C++ source): before the first run of an entry,
        the compiler runs once, as a run of its own in the same start, with every layer (uid,
        rlimits, cgroup, seccomp, network and mount namespaces) and the compile limits
        (``compile_time_limit``, ``compile_memory_mb``; the file size, process and output limits
        of a run). It reads ``/box/ENTRY`` and writes the binary into the run's ``/tmp``; the
        supervisor hands the binary to the host (``F``), which puts it beside the sources as
        ``ENTRY.bin`` (host-owned, read-only to the runs), and the runs ``execve`` it, each in a
        fresh child with the run limits and an emptied ``/tmp`` as for Python. A failed compile
        (compiler errors, or a compile limit) makes every run of the entry a ``compile_error``
        verdict whose ``stderr`` is the compiler's message; ``Verdict.compile`` gives the compile
        step's figures. Like a run, the compile starts only before ``deadline`` and is cut by it."""
        self.check()
        cfg = self.config
        for name in files:
            if "/" in name or name.startswith(".") or not name:
                raise ValueError(f"bad sandbox file name {name!r}")
        for r in runs:
            if r.entry not in files:
                raise ValueError(f"run entry {r.entry!r} is not one of the files")
            if r.language not in LANGUAGES:
                raise ValueError(f"unknown language {r.language!r}; choose from {', '.join(LANGUAGES)}")
            # before any run (a negative memory_mb reached setrlimit as no address-space limit at all)
            if r.time_limit is not None and not r.time_limit > 0:
                raise ValueError(f"time_limit must be positive, got {r.time_limit!r}")
            if r.memory_mb is not None and not r.memory_mb > 0:
                raise ValueError(f"memory_mb must be positive, got {r.memory_mb!r}")
        cxx = None
        if any(r.language == "cpp" for r in runs):
            cxx = _compiler(cfg)
            _check_exec_dir()
        files = dict(files)  # compiled programs join the session's files
        built: dict[str, Verdict] = {}  # C++ entry -> the verdict its runs copy (status ok: built)
        out: list[Verdict | None] = [None] * len(runs)
        use_cells = "namespaces" in [k for k, v in self.layers.items() if v is None]
        per_cell = 1 << 30 if os.getuid() == 0 else 1
        cell: _Cell | None = None
        retried = False
        i = 0
        try:
            while i < len(runs):
                r = runs[i]
                kind = "python" if r.language == "python" else ("compile" if r.entry not in built else "binary")
                if kind == "binary" and built[r.entry].status != "ok":  # did not compile: nothing to run
                    v = Verdict(**asdict(built[r.entry]))
                    out[i] = v
                    i += 1
                    if on_verdict is not None and on_verdict(i - 1, v) is False:
                        break
                    continue
                if kind == "compile":
                    wall, cpu = float(cfg.compile_time_limit), float(cfg.compile_time_limit)
                    rr = Run(r.entry, b"", (), wall, cfg.compile_memory_mb, r.language)
                else:
                    wall, cpu, rr = float(r.time_limit if r.time_limit is not None else cfg.time_limit), None, r
                if wall <= 0:
                    raise ValueError("time_limit must be positive")
                own_wall = wall
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0.05:
                        break
                    wall = min(wall, left)
                binary = None
                if not use_cells:
                    got: list[bytes] = []
                    v = self._run_direct(files, rr, wall, kind, cxx, cpu, got)
                    binary = got[0] if got else None
                else:
                    if cell is not None and cell.runs >= per_cell:
                        self._release(cell)
                        cell = None
                    if cell is None:
                        cell = self._acquire()
                        cell.put_files(files)
                    try:
                        v = self._cell_run(cell, rr, wall, self._exec_argv(kind, rr, BOX, WORKDIR, cxx), cpu)
                        if kind == "compile" and v.status == "ok":
                            binary = cell.fetch(_BUILD_OUT)
                    except _CellDead as e:
                        self._release(cell)
                        cell = None
                        if e.retry and not retried:  # not the run's doing: once more in a fresh start
                            retried = True
                            continue
                        if e.verdict is None:
                            raise SandboxError(str(e)) from None
                        v = e.verdict
                retried = False
                if wall < own_wall:
                    _blame_deadline(v, own_wall, cpu is None and cfg.cpu_time_limit is None)
                if kind == "compile":
                    built[r.entry] = self._built(v, binary is not None)
                    if binary is not None:
                        files[r.entry + _BIN_SUFFIX] = binary
                        if cell is not None:
                            cell.put_files({r.entry + _BIN_SUFFIX: binary})
                    continue  # now the run itself
                if kind == "binary":
                    v.compile = dict(built[r.entry].compile or {})
                out[i] = v
                i += 1
                if on_verdict is not None and on_verdict(i - 1, v) is False:
                    break
        finally:
            if cell is not None:
                self._release(cell)
        return out

    def _built(self, v: Verdict, ok: bool) -> Verdict:
        """From the compile's verdict: what the runs of the entry get (a compile_error) or carry."""
        info = {"status": v.status if ok or v.status != "ok" else "runtime_error", "exit_code": v.exit_code,
                "wall_time": round(v.wall_time, 4), "cpu_time": round(v.cpu_time, 4),
                "peak_memory_bytes": v.peak_memory_bytes, "limits_hit": list(v.limits_hit)}
        if ok:
            return Verdict("ok", 0, None, "", "", 0.0, 0.0, None, [], list(v.layers), info)
        msg = _compile_message(v, self.config) if v.status != "ok" else "the compiler produced no program"
        return Verdict("compile_error", v.exit_code, v.signal, "", msg, 0.0, 0.0, None, [], list(v.layers), info)

    def _exec_argv(self, kind: str, r: Run, box: str, work: str, cxx: str | None) -> list[str] | None:
        """The argv of a binary run (None: Python source). ``box``/``work``: where the session's files
        and the writable working directory are, as the run sees them."""
        if kind == "compile":
            return _compile_argv(self.config, cxx, os.path.join(box, r.entry),
                                 os.path.join(work, os.path.basename(_BUILD_OUT)))
        if kind == "binary":
            return [os.path.join(box, r.entry + _BIN_SUFFIX), *map(str, r.args)]
        return None

    def close(self) -> None:
        """Close the sandbox starts made ahead (also done at exit)."""
        if self._pool is not None:
            self._pool.close()

    def _acquire(self) -> _Cell:
        if self.config.warm > 0:
            with self._pool_lock:
                if self._pool is None or self._pool.closed:
                    self._pool = _Pool(self, self.config.warm)
                    _POOLS.add(self._pool)
            cell = self._pool.take()
            if cell is not None:
                return cell
        try:
            return _Cell(self)
        except SandboxUnavailable:
            raise
        except SandboxError:  # a start that stalled or failed on a loaded machine: once more
            return _Cell(self)

    def _release(self, cell: _Cell) -> None:
        if self._pool is None or not self._pool.discard(cell):
            cell.close()

    def _cell_run(self, cell: _Cell, r: Run, wall: float, argv: list[str] | None = None,
                  cpu: float | None = None) -> Verdict:
        """One run in ``cell``: Python source ``r.entry``, or, with ``argv``, the binary ``argv[0]``."""
        cfg = self.config
        mem_mb = int(r.memory_mb if r.memory_mb is not None else cfg.memory_mb)
        if cpu is None:
            cpu = cfg.cpu_time_limit if cfg.cpu_time_limit is not None else wall
        cpu_s = max(1, int(-(-cpu // 1)))
        mem_bytes = mem_mb << 20
        layers = cell.layers
        nproc = _nproc_limit(cfg, layers)
        cg = cell.cgroup
        before: dict = {}
        t_begin = time.perf_counter()
        if cg is not None:
            want = (mem_mb + cfg.tmpfs_mb + 32) << 20
            if want != cell.mem_limit and cg.set_memory(want):
                cell.mem_limit = want
            before = cg.begin()
        data = r.stdin.encode("utf-8", "surrogatepass") if isinstance(r.stdin, str) else bytes(r.stdin)
        fields = [repr(wall), str(cpu_s), str(mem_bytes), str(cfg.file_size_mb << 20), str(nproc),
                  str(cfg.max_open_files), *(argv if argv is not None else [f"{BOX}/{r.entry}", *map(str, r.args)])]
        msg = (b"X " if argv is not None else b"R ") + b"\0".join(f.encode("utf-8", "surrogateescape") for f in fields)
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            cell.ctl.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", in_r, out_w, err_w))])
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            raise _CellDead(f"the sandbox is gone: {e}; {cell._errors()}") from None
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        t_sent = time.perf_counter()
        t_started = t_done = t_sent
        cell.runs += 1
        out, err = bytearray(), bytearray()
        total = 0
        limits: list[str] = []
        keep_err = cfg.stderr_keep_bytes
        sel = selectors.DefaultSelector()
        sel.register(cell.ctl, selectors.EVENT_READ, "ctl")
        sel.register(out_r, selectors.EVENT_READ, "out")
        sel.register(err_r, selectors.EVENT_READ, "err")
        open_fds = {in_w, out_r, err_r}
        if data:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE, "in")
        else:
            os.close(in_w)
            open_fds.discard(in_w)
        view = memoryview(data)
        sent = 0
        started = False
        done: list[bytes] | None = None
        dead = ""
        t_send = time.monotonic()
        deadline = t_send + SETUP_TIMEOUT
        try:
            while done is None or open_fds - {in_w}:
                now = time.monotonic()
                if now >= deadline:
                    if done is not None:  # the run is over and swept: nothing can hold its pipes
                        break
                    dead = "wall" if started else "setup"
                    break
                for key, _ev in sel.select(deadline - now):
                    if key.data == "ctl":
                        try:
                            m = cell.ctl.recv(4096)
                        except OSError:
                            m = b""
                        if not m:
                            dead = "gone"
                            break
                        if m == b"S":
                            started = True
                            t_started = time.perf_counter()
                            deadline = time.monotonic() + wall + _RUN_GRACE_S
                        elif m.startswith(b"D "):
                            done = m.split()
                            t_done = time.perf_counter()
                            sel.unregister(cell.ctl)
                            deadline = time.monotonic() + 2.0
                    elif key.data == "in":
                        try:
                            sent += os.write(in_w, view[sent:sent + (1 << 16)])
                        except (BrokenPipeError, ConnectionResetError):
                            sent = len(data)
                        except BlockingIOError:
                            continue
                        if sent >= len(data):
                            sel.unregister(in_w)
                            os.close(in_w)
                            open_fds.discard(in_w)
                    else:
                        fd = key.fileobj
                        chunk = os.read(fd, 1 << 16)
                        if not chunk:
                            sel.unregister(fd)
                            os.close(fd)
                            open_fds.discard(fd)
                            continue
                        if "output" in limits:
                            continue
                        total += len(chunk)
                        if key.data == "out":
                            out += chunk
                        else:
                            err += chunk
                            if len(err) > 2 * keep_err:
                                del err[:len(err) - keep_err]
                        if total > cfg.output_limit_bytes:
                            limits.append("output")
                            try:
                                cell.ctl.send(b"K")
                            except OSError:
                                pass
                if dead:
                    break
        finally:
            for k in list(sel.get_map().values()):
                sel.unregister(k.fileobj)
            sel.close()
            view.release()
            for fd in open_fds:
                os.close(fd)
        stderr_text = bytes(err[-keep_err:]).decode("utf-8", "replace")
        if done is None and "_peak_fd" in before:
            os.close(before.pop("_peak_fd"))
        if done is None:  # the start itself failed or hung: it is not used again
            if dead == "wall":
                limits.append("wall_time")
                v = Verdict("time_limit", None, signal.SIGKILL, bytes(out).decode("utf-8", "replace"),
                            stderr_text, wall, wall, None, sorted(set(limits)), layers)
                raise _CellDead("the supervisor did not end the run", v)
            if started and dead == "gone":
                # as root a run cannot signal the supervisor: something else ended the start, so the
                # run goes again in a fresh one; without root (one run per start) it may have
                v = Verdict("killed", None, signal.SIGKILL, bytes(out).decode("utf-8", "replace"),
                            stderr_text, time.monotonic() - t_send, 0.0, None, sorted(set(limits)), layers)
                raise _CellDead("the supervisor died during the run", v, retry=os.getuid() == 0)
            raise _CellDead(f"the sandbox failed before the program started ({dead}): "
                            f"{(stderr_text.strip() or cell._errors())[-500:]}")
        status, reason, ok_start = int(done[1]), done[2].decode(), done[3] == b"1"
        wall_time, ru_cpu, maxrss = float(done[4]), float(done[5]), int(done[6])
        if not ok_start:
            if "_peak_fd" in before:
                os.close(before.pop("_peak_fd"))
            raise _CellDead(f"the sandbox failed to start the program: {(stderr_text.strip() or cell._errors())[-500:]}")
        if reason == "wall":
            limits.append("wall_time")
        stats = cg.end(before) if cg is not None else {}
        # the cgroup counts every process of the run (the supervisor's share is small); the first
        # process's rusage (with its waited children) is the fallback without a cpuacct cgroup
        cpu_time = max(stats.get("cpu_time", 0.0), ru_cpu)
        peak = stats.get("peak_memory") or maxrss * 1024
        if stats.get("pids_max_hit"):
            limits.append("processes")
        if stats.get("oom_kill"):
            limits.append("memory")
        rc = os.waitstatus_to_exitcode(status)
        exit_code, sig = (None, -rc) if rc < 0 else (rc, None)
        # RLIMIT_CPU is per process: a SIGKILL of the first process is its hard limit only when that
        # process (its rusage, with the children it waited for; not the cgroup's total of every
        # process) used the CPU, and the OOM killer did not send it
        rlimit_kill = (sig == signal.SIGKILL and not stats.get("oom_kill")
                       and ru_cpu >= min(cpu_s, 0.85 * (cpu_s + 1)))
        if rlimit_kill and reason == "-" and ru_cpu >= 0.85 * (cpu_s + 1):
            # The kernel counts CPU for that limit by ticks, which on a VM with steal time run
            # ahead of the precise count read above: report what the limit saw
            cpu_time = max(cpu_time, float(cpu_s + 1))
        t_end = time.perf_counter()
        cell.run_phases = {"cgroup_begin_and_send": t_sent - t_begin, "fork_and_setup": t_started - t_sent,
                           "program": wall_time, "exit_and_sweep": max(0.0, t_done - t_started - wall_time),
                           "drain_and_stats": t_end - t_done, "total": t_end - t_begin}
        if sig == signal.SIGXCPU or rlimit_kill:
            limits.append("cpu_time")
        if sig == signal.SIGXFSZ:
            limits.append("file_size")
        status = classify(rc_exit=exit_code, sig=sig, limits=limits, stderr=stderr_text)
        if status == "memory_limit":  # the address-space limit (MemoryError, bad_alloc), not only an OOM kill
            limits.append("memory")
        return Verdict(status=status, exit_code=exit_code, signal=sig, stdout=bytes(out).decode("utf-8", "replace"),
                       stderr=stderr_text, wall_time=wall_time, cpu_time=cpu_time, peak_memory_bytes=peak,
                       limits_hit=sorted(set(limits)), layers=layers)

    def _run_direct(self, files: dict[str, str], r: Run, wall: float, kind: str = "python",
                    cxx: str | None = None, cpu: float | None = None, got: list | None = None) -> Verdict:
        """The weaker mode (no bubblewrap): one start per run, the launcher run directly. ``kind``:
        python, compile (the binary built is appended to ``got``) or binary."""
        try:
            return self._run_once(files, r, wall, kind, cxx, cpu, got)
        except _StartupStall:
            try:
                return self._run_once(files, r, wall, kind, cxx, cpu, got)
            except _StartupStall as e:
                raise SandboxError(str(e)) from None

    def _run_once(self, files: dict[str, str], r: Run, wall: float, kind: str = "python",
                  cxx: str | None = None, cpu: float | None = None, got: list | None = None) -> Verdict:
        cfg = self.config
        mem_mb = int(r.memory_mb if r.memory_mb is not None else cfg.memory_mb)
        if cpu is None:
            cpu = cfg.cpu_time_limit if cfg.cpu_time_limit is not None else wall
        cpu_s = max(1, int(-(-cpu // 1)))
        layers = [k for k, v in self.layers.items() if v is None]
        exe, prefix = _weak_python(*_python_install(cfg))
        box = tempfile.mkdtemp(prefix="cascade-box-")
        cgroup = None
        fds_to_close: list[int] = []
        try:
            os.chmod(box, 0o755)
            _put_files(box, files)
            if os.getuid() == 0:  # the box itself is the working directory
                os.chown(box, cfg.uid, cfg.gid)
            mem_bytes = mem_mb << 20
            nproc = _nproc_limit(cfg, layers)
            if nproc != resource.RLIM_INFINITY:
                nproc += 1  # the launcher's reaper
            # (soft, hard): the CPU soft limit sends SIGXCPU, the hard one a second later SIGKILL
            rl = {"AS": [mem_bytes] * 2, "CPU": [cpu_s, cpu_s + 1], "FSIZE": [cfg.file_size_mb << 20] * 2,
                  "NPROC": [nproc] * 2, "NOFILE": [cfg.max_open_files] * 2, "CORE": [0, 0]}
            launch = ",".join(f"{k}:{a}:{b}" for k, (a, b) in rl.items())
            ready_r, ready_w = os.pipe()
            fds_to_close += [ready_r, ready_w]
            # -S: no site (stdlib only, and 3x faster start here); the launcher restores exit()/quit()
            argv: list[str] = []
            ctrl_bases = {c: v for c, v in _cgroup_bases(cfg).items()
                          if f"cgroup_{c}" in layers or c == "cpuacct"}
            if ctrl_bases:
                # +1: the launcher's reaper
                cgroup = _RunCgroup(ctrl_bases, mem_bytes + ((cfg.tmpfs_mb + 32) << 20), cfg.max_processes + 1)
                argv += ["/bin/sh", "-c", 'p=$$; while [ "$1" != -- ]; do echo $p > "$1" || exit 125; shift; done; '
                         'shift; exec "$@"', "sh", *cgroup.procs_files(), "--"]
            binary = self._exec_argv(kind, r, box, box, cxx)
            argv += [exe, "-S", "-s", "-B", "-c", _LAUNCHER, launch, str(cfg.uid), str(cfg.gid), str(ready_w),
                     *(["-x", *binary] if binary else [f"{box}/{r.entry}", *map(str, r.args)])]
            env = _clean_env()
            env.update(HOME=box, TMPDIR=box)
            data = r.stdin.encode("utf-8", "surrogatepass") if isinstance(r.stdin, str) else bytes(r.stdin)
            v = self._execute(argv, env, box, data, wall, cpu_s, mem_bytes,
                              ready_r, ready_w, [ready_w], fds_to_close, cgroup, layers)
            built = os.path.join(box, os.path.basename(_BUILD_OUT))
            if kind == "compile" and v.status == "ok" and got is not None and os.path.isfile(built) \
                    and not os.path.islink(built):
                with open(built, "rb") as f:
                    got.append(f.read())
            return v
        finally:
            for fd in fds_to_close:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if cgroup is not None:
                cgroup.kill_all()
                cgroup.remove()
            shutil.rmtree(box, ignore_errors=True)

    def _bwrap_has_size(self) -> bool:
        if self._size_ok is None:
            try:
                h = subprocess.run([_bwrap(), "--help"], capture_output=True, text=True, timeout=10)
                self._size_ok = "--size" in (h.stdout + h.stderr)
            except (OSError, subprocess.SubprocessError):
                self._size_ok = False
        return self._size_ok

    def _execute(self, argv, env, cwd, data, wall, cpu_s, mem_bytes, ready_r, ready_w, pass_fds,
                 fds_to_close, cgroup, layers) -> Verdict:
        cfg = self.config
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=cwd, pass_fds=pass_fds, start_new_session=True, close_fds=True)
        os.close(ready_w)
        fds_to_close.remove(ready_w)
        # the wall limit counts from the moment the launcher is ready: a slow sandbox setup on a
        # loaded machine is not the program's time (setup gets its own, generous budget)
        deadline = t0 + max(wall, SETUP_TIMEOUT)
        ready = False
        t_ready = t0
        out = bytearray()
        err = bytearray()
        total = 0
        limits: list[str] = []
        killed = False
        t_kill = t0

        def sweep() -> None:
            # kill the whole group and cgroup. Also used once the main process is gone: nothing may
            # outlive it (a background process holding the pipes would otherwise keep the run open).
            # Its group id stays valid until we reap it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            if cgroup is not None:
                cgroup.kill_all(0.5)

        def kill() -> None:
            nonlocal killed, t_kill
            killed, t_kill = True, time.monotonic()
            if ready and not exited:
                # the launcher's reaper (ready: it is set up) kills the whole run, what left the
                # process group too (a new session), then itself; the group kill then finds nothing
                try:
                    os.kill(proc.pid, signal.SIGTERM)
                    end = time.monotonic() + _REAPER_GRACE_S
                    while time.monotonic() < end and os.waitid(
                            os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                        time.sleep(0.002)
                except OSError:
                    pass
            sweep()

        sel = selectors.DefaultSelector()
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        if pidfd is not None:
            fds_to_close.append(pidfd)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        sel.register(proc.stdout, selectors.EVENT_READ, "out")
        sel.register(proc.stderr, selectors.EVENT_READ, "err")
        sel.register(ready_r, selectors.EVENT_READ, "ready")
        sent = 0
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE, "in")
        else:
            proc.stdin.close()
        view = memoryview(data)
        exited = False
        t_exit = t0
        keep_err = cfg.stderr_keep_bytes
        while not (exited and not [k for k in sel.get_map().values() if k.data not in ("exit", "ready")]):
            now = time.monotonic()
            if now >= deadline:
                if exited:  # something that escaped the sweep still holds the pipes: not the run's time
                    break
                if ready:
                    limits.append("wall_time")
                kill()
                break
            timeout = deadline - now if pidfd is not None else min(deadline - now, 0.005)
            for key, _ev in sel.select(timeout):
                if key.data == "ready":
                    sel.unregister(ready_r)
                    if os.read(ready_r, 1) == b"R":
                        ready = True
                        t_ready = time.monotonic()
                        deadline = t_ready + wall
                elif key.data == "exit":
                    exited, t_exit = True, time.monotonic()
                    deadline = min(deadline, t_exit + _PIPE_GRACE_S)
                    sel.unregister(key.fileobj)
                    sweep()
                elif key.data == "in":
                    try:
                        sent += os.write(proc.stdin.fileno(), view[sent:sent + (1 << 16)])
                    except (BrokenPipeError, ConnectionResetError):
                        sent = len(data)
                    except BlockingIOError:
                        continue
                    if sent >= len(data):
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                else:
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(chunk)
                    if key.data == "out":
                        out += chunk
                    else:
                        err += chunk
                        if len(err) > 2 * keep_err:
                            del err[:len(err) - keep_err]
                    if total > cfg.output_limit_bytes:
                        limits.append("output")
                        kill()
                        break
            if "output" in limits:
                break
            if pidfd is None and not exited:
                info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None:
                    exited, t_exit = True, time.monotonic()
                    deadline = min(deadline, t_exit + _PIPE_GRACE_S)
                    sweep()
        for k in list(sel.get_map().values()):
            sel.unregister(k.fileobj)
        sel.close()
        view.release()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        _pid, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall_time = (t_exit if exited else t_kill if killed else time.monotonic()) - t_ready
        if cgroup is not None:
            cgroup.kill_all()
        if not ready:
            try:
                os.set_blocking(ready_r, False)
                ready = os.read(ready_r, 1) == b"R"
            except OSError:
                ready = False
        stats = cgroup.stats() if cgroup is not None else {}
        cpu_time = stats.get("cpu_time", ru.ru_utime + ru.ru_stime)
        peak = stats.get("peak_memory")
        if peak is None and ru is not None:
            peak = int(ru.ru_maxrss) * 1024
        rc = proc.returncode
        stderr_text = bytes(err[-keep_err:]).decode("utf-8", "replace")
        if not ready and killed and not limits:
            raise _StartupStall(f"the sandbox did not start the program within {max(wall, SETUP_TIMEOUT):g} s")
        if not ready and not killed:
            raise SandboxError(f"the sandbox failed to start the program (exit {rc}): {stderr_text.strip()[-500:]}")
        if stats.get("pids_max_hit"):
            limits.append("processes")
        if stats.get("oom_kill"):
            limits.append("memory")
        exit_code, sig = _split_exit(rc, False)
        if sig == signal.SIGXCPU or (cpu_time >= cpu_s and sig == signal.SIGKILL and not stats.get("oom_kill")):
            limits.append("cpu_time")
        if sig == signal.SIGXFSZ:
            limits.append("file_size")
        status = classify(rc_exit=exit_code, sig=sig, limits=limits, stderr=stderr_text)
        if status == "memory_limit":
            limits.append("memory")
        return Verdict(status=status, exit_code=exit_code, signal=sig,
                       stdout=bytes(out).decode("utf-8", "replace"), stderr=stderr_text,
                       wall_time=wall_time, cpu_time=cpu_time, peak_memory_bytes=peak,
                       limits_hit=sorted(set(limits)), layers=layers)


def _blame_deadline(v: Verdict, own_wall: float, cpu_from_wall: bool) -> None:
    """A run whose wall limit (and the CPU limit made from it) was cut to what was left of the
    session's ``deadline``: a time limit it hit is the deadline's (``total_time``), not its own."""
    hit = set(v.limits_hit)
    cut = hit & {"wall_time"}
    if "cpu_time" in hit and cpu_from_wall and v.cpu_time < max(1, -(-own_wall // 1)):
        cut.add("cpu_time")  # its own CPU limit (made from its own wall limit) was not reached
    if cut:
        v.limits_hit = sorted((hit - cut) | {"total_time"})


def _split_exit(rc: int | None, via_bwrap: bool) -> tuple[int | None, int | None]:
    """(exit code, signal). bwrap reports a child killed by signal N as exit code 128 + N."""
    if rc is None:
        return None, signal.SIGKILL
    if rc < 0:
        return None, -rc
    if via_bwrap and 128 < rc < 128 + 65:
        return None, rc - 128
    return rc, None


_RUNTIME_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGFPE, signal.SIGBUS, signal.SIGILL}


def classify(rc_exit: int | None, sig: int | None, limits: list[str], stderr: str) -> str:
    """The status of a finished run from how it ended and which limits it hit."""
    if "output" in limits:
        return "output_limit"
    if "wall_time" in limits or "cpu_time" in limits or "total_time" in limits:
        return "time_limit"
    if "memory" in limits:
        return "memory_limit"
    if sig is None and rc_exit == 0:  # what a run that succeeded wrote to stderr is its business
        return "ok"
    tail = stderr.rstrip().rsplit("\n", 1)[-1] if stderr.strip() else ""
    if tail.startswith("MemoryError") or "std::bad_alloc" in stderr[-4096:]:
        return "memory_limit"
    if sig is not None:
        return "runtime_error" if sig in _RUNTIME_SIGNALS else "killed"
    return "ok" if rc_exit == 0 else "runtime_error"


@functools.cache
def _warn_no_namespaces(why: str) -> None:
    """Say loudly, once per process (per reason), that programs run without the mount namespace, and what it loses."""
    log.warning("the sandbox runs programs WITHOUT bubblewrap (%s; allowed by the config or %s): %s",
                why, ALLOW_ENV, NO_NAMESPACES)


_DEFAULT: dict[SandboxConfig, Sandbox] = {}
_DEFAULT_LOCK = threading.Lock()


def default_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """A shared :class:`Sandbox` per config (layer detection runs once)."""
    config = config or SandboxConfig()
    with _DEFAULT_LOCK:
        if config not in _DEFAULT:
            _DEFAULT[config] = Sandbox(config)
        return _DEFAULT[config]


def run_program(program: str, stdin: str | bytes = b"", config: SandboxConfig | None = None, **kw) -> Verdict:
    """Run ``program`` once in the default sandbox of ``config`` (``language="cpp"`` for C++)."""
    return default_sandbox(config).run(program, stdin, **kw)
