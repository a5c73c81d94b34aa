"""The supervisor that runs inside one sandbox start (bwrap + cgroup + seccomp) and runs many programs.

Not used by the host: :mod:`envs.code.sandbox` copies this file (with its bytecode, compiled
once per host process) into a private directory bound read-only at ``/sup``, and starts
``python -S -c`` :data:`STUB` inside the sandbox. Only C modules (``posix``, not ``os``: a run
that imports ``os`` pays for it as a bare ``python -S`` run would, and a start pays nothing).

argv: CONTROL_FD UID GID. The host talks to it over CONTROL_FD (an AF_UNIX SOCK_SEQPACKET socket):

- supervisor -> host ``ready T0``: started (T0: ``time.monotonic()`` when this script began).
- host -> supervisor ``R`` + NUL-separated ``wall cpu_s as_bytes fsize_bytes nproc nofile path args...``
  (a limit of -1: as high as the child may set it, the hard limit it inherited; nproc is -1 where
  the pids cgroup caps the run) with three descriptors (SCM_RIGHTS): the run's stdin, stdout and
  stderr. The supervisor forks a child, which takes those as 0/1/2, drops to UID/GID (as root;
  every capability goes with it), empties the writable places (``/tmp``, ``/dev/shm``, POSIX
  message queues, System V IPC) of whatever an earlier run left there, sets umask 022 (not the
  host's: see ``_child``) and the rlimits, closes every other descriptor and returns to the module
  level, which compiles and runs PATH as ``__main__`` (and ends the way a fresh ``python PATH``
  would: exit code, traceback, atexit, flushing).
- host -> supervisor ``X`` + the same fields: as ``R``, but the child ``execve``s PATH (a binary:
  the C++ compiler, or a program it built) with ARGS, in the same clean environment and with
  SIGPIPE and SIGXFSZ back at their default actions (Python ignores them, and an ignored signal
  would stay ignored in the binary), instead of running Python source.
- host -> supervisor ``F PATH`` with one descriptor (a file of the host's, open for writing):
  between runs, copy the regular file PATH (under ``/tmp``, not followed if a symlink) into it
  (how the host takes a compiled binary out of the start); answer ``F 0 SIZE`` or ``F 1 ERROR``.
- supervisor -> host ``S``: the child is set up; its wall clock starts now.
- host -> supervisor ``K``: kill the current run (output limit).
- supervisor -> host ``D status reason started wall cpu maxrss_kb``: the run is over and every
  process of it is gone (``kill(-1)`` until nothing is left: as root the supervisor holds
  CAP_KILL, the runs hold nothing). reason: ``-``, ``wall`` (wall limit), ``kill`` (host asked),
  ``setup`` (the child died or stalled before its program started).
- host closes the socket: the supervisor kills what is left and exits.

Each run is its own process forked from this clean interpreter (never from an earlier run), so no
global survives from one run to the next, and nothing an earlier run wrote survives the sweep.
"""
import builtins
import gc
import posix as os  # the functions of os used here, without importing os (and its imports)
import resource
import select
import sys
import time

import _socket

# run with python -S -c inside the sandbox: in a run's child, ``serve`` returns the function that runs
# the program and ends the process (see ``_run_main``)
STUB = ("import time; _t0 = time.monotonic(); import sys; sys.path.insert(0, '/sup'); "
        "import cascade_supervisor as _s; _r = _s.serve(_t0); del _s, _t0; _r()")

_SETUP_S = 30.0     # a child must be set up within this (a loaded machine may be slow)
_SWEEP_S = 10.0     # give up killing after this (a process stuck in the kernel)
_WRITABLE = ("/tmp", "/dev/shm", "/dev/mqueue")


def _sweep() -> bool:
    """SIGKILL every process of the sandbox but this one and pid 1, until none is left."""
    end = time.monotonic() + _SWEEP_S
    while time.monotonic() < end:
        try:
            os.kill(-1, 9)
        except ProcessLookupError:
            return True
        except PermissionError:  # nothing we may signal is left (only others' processes)
            return True
        try:  # our own children (the run's first process) must be reaped by us
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.0005)
    return False


def _isdir(path: str) -> bool:
    try:
        return os.stat(path).st_mode & 0o170000 == 0o040000
    except OSError:
        return False


def _wipe(top: str) -> None:
    """Remove everything under ``top`` this uid may remove (iteratively: any depth)."""
    stack, dirs = [top], []
    while stack:
        d = stack.pop()
        try:
            it = list(os.scandir(d))
        except OSError:
            continue
        for e in it:
            try:
                if e.is_dir(follow_symlinks=False):
                    os.chmod(e.path, 0o700)
                    stack.append(e.path)
                    dirs.append(e.path)
                else:
                    os.unlink(e.path)
            except OSError:
                pass
    for d in reversed(dirs):
        try:
            os.rmdir(d)
        except OSError:
            pass
    left = os.listdir(top) if _isdir(top) else []
    if left:
        raise OSError(f"cannot empty {top}: {left[:3]} left")


def _wipe_ipc() -> None:
    used = False
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                used = used or len(f.read().splitlines()) > 1
        except OSError:
            pass
    if used and os.access("/usr/bin/ipcrm", os.X_OK):
        args = ["ipcrm"]
        for kind, flag in (("shm", "-m"), ("msg", "-q"), ("sem", "-s")):
            try:
                with open(f"/proc/sysvipc/{kind}") as f:
                    args += [x for line in f.read().splitlines()[1:] for x in (flag, line.split()[1])]
            except (OSError, IndexError):
                pass
        pid = os.posix_spawn("/usr/bin/ipcrm", args, {"PATH": "/usr/bin"})
        os.waitpid(pid, 0)


def _fetch(ctl, msg, fds):
    """Copy the file named in ``msg`` (``F PATH``) into the host's descriptor; answer the host."""
    out = fds[0] if fds else -1
    for fd in fds[1:]:
        os.close(fd)
    try:
        path = msg[2:].decode("utf-8", "surrogateescape")
        if out < 0 or not path.startswith("/tmp/") or "/../" in path + "/":
            raise OSError("bad fetch request")
        src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if os.fstat(src).st_mode & 0o170000 != 0o100000:
                raise OSError(f"{path} is not a regular file")
            n = 0
            while True:
                chunk = os.read(src, 1 << 20)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    k = os.write(out, view)
                    view = view[k:]
                n += len(chunk)
        finally:
            os.close(src)
        ctl.send(b"F 0 %d" % n)
    except OSError as e:
        ctl.send(b"F 1 " + str(e).encode("utf-8", "replace")[:500])
    finally:
        if out >= 0:
            os.close(out)


def _child(ctl, fds, sync_w, limits, argv, uid, gid, drop, execute=False):
    ctl.detach()  # closed below with the rest; its finalizer must not close a later descriptor
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        try:  # the host's pipes (owned by root, mode 0600): reopenable as /dev/stdin etc. by the run
            os.fchmod(i, 0o666)
        except OSError:
            pass
    if drop:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit("could not drop root")
    try:  # out of memory, the kernel picks the run's processes, never the supervisor
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
    except OSError:
        pass
    for d in _WRITABLE:
        if _isdir(d):
            _wipe(d)
    _wipe_ipc()
    # files it makes get 0644/0755 whatever the host's umask (inherited through bwrap): under 077 the
    # compiled program would be 0700, the uid's, which the supervisor (no CAP_DAC_OVERRIDE) cannot fetch
    os.umask(0o022)
    os.chdir("/tmp")
    for name, soft, hard in limits:
        res = getattr(resource, "RLIMIT_" + name)
        if hard == resource.RLIM_INFINITY:  # as high as it may be: the hard limit inherited (no raising it)
            hard = resource.getrlimit(res)[1]
            soft = hard if soft == resource.RLIM_INFINITY else soft
        resource.setrlimit(res, (soft, hard))
    os.write(sync_w, b"S")
    os.closerange(3, 65536)
    if execute:  # a binary: nothing of this interpreter goes with it but the clean environment
        import _signal

        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # ignored by Python, and an ignored signal stays
            _signal.signal(sig, _signal.SIG_DFL)        # ignored across execve: back to their defaults
        os.execve(argv[0], argv, os.environ)
    sys.argv = argv
    sys.path[0] = argv[0].rpartition("/")[0] or "/"
    builtins.exit = builtins.quit = sys.exit
    return argv[0]


def _wait_run(ctl, pid, sync_r, wall):
    """Watch one run: set-up, then its wall clock; returns (status, reason, started, wall, rusage)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    poll = select.poll()
    poll.register(sync_r, select.POLLIN)
    poll.register(ctl.fileno(), select.POLLIN)
    if pidfd is not None:
        poll.register(pidfd, select.POLLIN)
    started, t0, reason = False, time.monotonic(), b"-"
    deadline = t0 + _SETUP_S
    status = ru = None
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = b"wall" if started else b"setup"
            break
        step = left if pidfd is not None else min(left, 0.002)
        events = dict(poll.poll(max(1, int(step * 1000) + 1)))
        if sync_r in events and not started:
            if os.read(sync_r, 1) == b"S":
                started, t0 = True, time.monotonic()
                deadline = t0 + wall
                ctl.send(b"S")
            poll.unregister(sync_r)
        if ctl.fileno() in events:
            msg = ctl.recv(4096)
            if not msg:
                _sweep()
                os._exit(0)
            if msg[:1] == b"K":
                reason = b"kill"
                break
        if pidfd is None or pidfd in events:
            got, st, r = os.wait4(pid, os.WNOHANG)
            if got == pid:
                status, ru = st, r
    t1 = time.monotonic()
    if status is None:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        _pid, status, ru = os.wait4(pid, 0)
    if not started:  # it may have got ready just before it ended
        try:
            os.set_blocking(sync_r, False)
            started = os.read(sync_r, 1) == b"S"
            if started:
                t0 = t1
        except OSError:
            pass
    if pidfd is not None:
        os.close(pidfd)
    os.close(sync_r)
    return status, reason, started, (t1 - t0) if started else 0.0, ru


def serve(t0: float):
    """Serve runs until the host closes the socket (then exit); in each run's child, return the
    function that runs the program as ``__main__`` and ends the process (:func:`_run_main`)."""
    path = _serve(t0, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    sys.modules.pop("cascade_supervisor", None)
    if "/sup" in sys.path:
        sys.path.remove("/sup")
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    m = type(sys)("__main__")
    m.__file__ = path
    m.__builtins__ = builtins
    sys.modules["__main__"] = m
    return lambda: _run_main(code, m)


def _exit_status(e: SystemExit) -> int:
    """The exit status ``python PROGRAM`` gives an uncaught SystemExit (as CPython's handler does)."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except BaseException:
        pass
    return 1


def _flush_std() -> bool:
    ok = True
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None and not f.closed:
                f.flush()
        except BaseException:
            ok = False
    return ok


def _run_main(code, m) -> None:
    """Run the program's code in module ``m`` (``__main__``), then end this process the way ``python
    PROGRAM`` ends, in the same order: an uncaught exception's traceback (from the program's own frame)
    and status 1, SystemExit's status; non-daemon threads joined (``threading._shutdown``); atexit
    callbacks; stdout/stderr flushed (a failed flush: status 120); the program's globals released as
    module teardown releases them (underscored names first; destructors run, unclosed files flush), a
    collection, the streams flushed again; a KeyboardInterrupt ends by SIGINT. What is skipped is the
    teardown of the interpreter itself: its objects are the supervisor's, shared with this forked
    child page by page, and freeing them one by one (writing every page they sit on) costs more than
    the whole run of a small program."""
    sigint = False
    try:
        exec(code, m.__dict__)
        status = 0
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:
        sigint = isinstance(e, KeyboardInterrupt)
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # from the program's frame
        try:
            sys.excepthook(type(e), e.with_traceback(tb), tb)
        except BaseException:
            pass
        status = 1
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    import atexit

    atexit._run_exitfuncs()
    if not _flush_std():
        status = 120
    d = m.__dict__
    for names in ([k for k in d if k.startswith("_") and k != "__builtins__"],
                  [k for k in d if not k.startswith("_")]):
        for k in names:
            try:
                d[k] = None
            except BaseException:
                pass
    gc.collect()
    if not _flush_std():
        status = 120
    if sigint:
        import _signal

        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
        os.kill(os.getpid(), _signal.SIGINT)
    os._exit(status)


def _serve(t0, ctl_fd, uid, gid):
    os.closerange(3, ctl_fd)
    os.closerange(ctl_fd + 1, 65536)
    ctl = _socket.socket(fileno=ctl_fd)
    ctl.send(b"ready %r" % t0)
    drop = os.getuid() == 0
    space = _socket.CMSG_SPACE(3 * 4)
    while True:
        msg, anc, _flags, _addr = ctl.recvmsg(1 << 16, space)
        if not msg:
            _sweep()
            os._exit(0)
        fds = []
        for level, kind, data in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4)]
        if msg[:1] == b"F":
            _fetch(ctl, msg, fds)
            continue
        if msg[:1] not in (b"R", b"X") or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        parts = msg[2:].split(b"\0")
        wall = float(parts[0])
        cpu_s, as_b, fsize, nproc, nofile = (int(x) for x in parts[1:6])
        limits = [("AS", as_b, as_b), ("CPU", cpu_s, cpu_s + 1), ("FSIZE", fsize, fsize),
                  ("NPROC", nproc, nproc), ("NOFILE", nofile, nofile), ("CORE", 0, 0)]
        argv = [p.decode("utf-8", "surrogateescape") for p in parts[6:]]
        sync_r, sync_w = os.pipe()
        gc.freeze()  # the child's collections (and exit) then leave the supervisor's objects untouched
        pid = os.fork()
        if pid == 0:
            try:
                os.close(sync_r)
                return _child(ctl, fds, sync_w, limits, argv, uid, gid, drop, msg[:1] == b"X")
            except BaseException as e:  # never back into the serving loop
                try:
                    os.write(2, b"cascade-sandbox: run setup failed: %s\n" % str(e).encode())
                finally:
                    os._exit(125)
        os.close(sync_w)
        for fd in fds:
            os.close(fd)
        status, reason, started, wall_s, ru = _wait_run(ctl, pid, sync_r, wall)
        clean = _sweep()
        if not clean:
            reason = b"setup"
        ctl.send(b"D %d %s %d %r %r %d" % (status, reason, started, wall_s, ru.ru_utime + ru.ru_stime,
                                          ru.ru_maxrss))
        if not clean:
            os._exit(3)
