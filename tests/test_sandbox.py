"""Acceptance tests of the code sandbox: each hostile program is contained with the right verdict,
and the host is unaffected (no process left, nothing written, no secret read)."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from envs.code import sandbox as sbx
from envs.code.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from tests.conftest import assert_no_processes_of, pids_of_uid

# a uid of our own (not the default 65534), so that sandboxes run concurrently by other test
# sessions on this machine cannot be mistaken for leftovers of ours
UID = 61000 + os.getpid() % 4000
CFG = SandboxConfig(time_limit=2.0, memory_mb=256, output_limit_bytes=1 << 20, max_processes=16, uid=UID, gid=UID)
LAYERS = sbx.detect_layers(CFG)
pytestmark = pytest.mark.skipif(
    LAYERS["namespaces"] is not None, reason=f"sandbox needs bubblewrap: {LAYERS['namespaces']}")


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    s = Sandbox(CFG)
    s.check()  # every layer present on the test machines (CI installs bubblewrap, runs as root)
    return s


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert_no_processes_of(CFG.uid)


def test_all_layers_present_and_plain_run(sb):
    assert sb.missing() == {}
    v = sb.run("import os, sys\nprint(os.getuid(), os.getgid(), os.getcwd())\nprint(sys.stdin.read().upper())",
               "hello")
    assert v.status == "ok" and v.exit_code == 0
    assert v.stdout.split() == [str(UID), str(UID), "/tmp", "HELLO"]
    assert v.peak_memory_bytes and v.peak_memory_bytes > 1 << 20
    assert set(v.layers) == set(sbx.LAYERS)


def test_runtime_error_and_exit_codes(sb):
    v = sb.run("raise ValueError('boom')")
    assert v.status == "runtime_error" and v.exit_code == 1 and "ValueError: boom" in v.stderr
    v = sb.run("import sys\nexit(3)")
    assert v.status == "runtime_error" and v.exit_code == 3
    v = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert v.status == "runtime_error" and v.signal == 11


# how a program ends: the sandbox runs it in a child forked from its supervisor, which ends the way
# ``python -S PROGRAM`` ends (checked against that, run bare on the same interpreter)
ENDINGS = {
    "plain": "print('a', end='')\n",
    "unflushed_file": "import os\nf = os.fdopen(1, 'w')\nf.write('unflushed')\n",
    "destructor": "class A:\n    def __del__(self):\n        print('del')\na = A()\nprint('main')\n",
    "cycle": "class A:\n    def __del__(self):\n        print('cyc')\na = A()\na.me = a\n",
    "atexit": "import atexit\natexit.register(print, 'bye')\nprint('x')\n",
    "exit_message": "import sys\nprint('o')\nsys.exit('msg')\n",
    "exit_codes": "import sys\nsys.exit(3)\n",
    "exit_wraps": "import sys\nsys.exit(256 + 7)\n",
    "exit_negative": "import sys\nsys.exit(-1)\n",
    "exit_none": "raise SystemExit(None)\n",
    "traceback": "def f():\n    raise ValueError('boom')\nprint('before')\nf()\n",
    "chained": "try:\n    1/0\nexcept Exception as e:\n    raise KeyError('k') from e\n",
    "thread_joined": ("import threading, time\ndef g():\n    time.sleep(0.2)\n    print('late')\n"
                      "threading.Thread(target=g).start()\nprint('early')\n"),
    "keyboard_interrupt": "print('x', flush=True)\nraise KeyboardInterrupt\n",
    "atexit_raises": "import atexit\ndef h():\n    raise RuntimeError('in atexit')\natexit.register(h)\n",
    "stdout_closed": "import sys\nprint('x')\nsys.stdout.close()\n",
    "del_after_atexit": ("import atexit\nclass A:\n    def __del__(self):\n        print('del')\n"
                         "a = A()\natexit.register(print, 'exit')\n"),
}


@pytest.mark.parametrize("name", sorted(ENDINGS))
def test_a_program_ends_as_bare_python_ends(sb, tmp_path, name):
    import subprocess
    import sys

    src = ENDINGS[name]
    (tmp_path / "p.py").write_text(src)
    py = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    b = subprocess.run([py, "-S", str(tmp_path / "p.py")], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    v = sb.run(src)
    assert v.stdout == b.stdout
    assert (v.exit_code, v.signal) == ((b.returncode, None) if b.returncode >= 0 else (None, -b.returncode))
    # the same traceback (frames counted from the program's own; paths differ) and last line
    assert v.stderr.count('File "') == b.stderr.count('File "'), v.stderr
    assert v.stderr.strip().splitlines()[-1:] == b.stderr.strip().splitlines()[-1:]


def test_socket_to_internet_blocked(sb):
    prog = """
import socket
for fam, addr in ((socket.AF_INET, ("1.1.1.1", 80)), (socket.AF_INET6, ("2606:4700:4700::1111", 80))):
    try:
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(addr)
        print("CONNECTED")
    except OSError as e:
        print(type(e).__name__)
"""
    v = sb.run(prog)
    assert v.status == "ok", v.stderr
    assert "CONNECTED" not in v.stdout
    assert v.stdout.split() == ["PermissionError", "PermissionError"]  # seccomp refuses socket()


def test_host_loopback_server_unreachable(sb):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    accepted = []
    srv.settimeout(0.1)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                accepted.append(c)
            except (socket.timeout, OSError):
                pass

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    def prog(port: int) -> str:
        return f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    print("CONNECTED")
except OSError as e:
    print("refused", type(e).__name__)
"""
    try:
        v = sb.run(prog(port))
    finally:
        time.sleep(0.2)
        stop.set()
        th.join()
        srv.close()
    assert v.status == "ok" and "CONNECTED" not in v.stdout and "refused" in v.stdout
    assert accepted == []
    # without seccomp the network namespace alone must still keep the host out of reach
    weak_cfg = SandboxConfig(**{**CFG.__dict__, "allow_missing": ("seccomp",)})
    weak = Sandbox(weak_cfg, _layers={**LAYERS, "seccomp": "disabled for this test"})
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    srv.settimeout(0.5)
    v = weak.run(prog(port))
    try:
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()
    assert "CONNECTED" not in v.stdout and "ConnectionRefusedError" in v.stdout


def test_writes_outside_tmp_fail_and_host_untouched(sb, tmp_path):
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(host_dir, 0o777)
    repo_target = Path(__file__).resolve().parent / f"sandbox-escape-{uuid.uuid4().hex}"
    targets = ["/usr/escape", "/box/escape", "/etc/escape", "/escape", str(host_dir / "escape"),
               str(repo_target)]
    prog = f"""
import json
res = {{}}
for t in {targets!r}:
    try:
        with open(t, "w") as f:
            f.write("x")
        res[t] = "written"
    except OSError as e:
        res[t] = type(e).__name__
with open("inside.txt", "w") as f:
    f.write("ok")
res["cwd"] = open("inside.txt").read()
print(json.dumps(res))
"""
    v = sb.run(prog)
    assert v.status == "ok", v.stderr
    res = json.loads(v.stdout)
    assert res.pop("cwd") == "ok"
    assert "written" not in res.values(), res
    assert list(host_dir.iterdir()) == [] and not repo_target.exists()


def test_file_size_limit(sb):
    v = Sandbox(SandboxConfig(**{**CFG.__dict__, "file_size_mb": 1})).run(
        "try:\n    open('big', 'wb').write(b'x' * (4 << 20))\n    print('WROTE')\nexcept OSError as e:\n    print(e.errno)")
    assert v.status == "ok" and "WROTE" not in v.stdout and v.stdout.strip() == "27"  # EFBIG


def test_home_and_env_not_visible(sb, monkeypatch):
    secret = f"cascade-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("CASCADE_TEST_SECRET", secret)
    home = Path.home()
    secret_file = home / f".cascade-sandbox-test-{uuid.uuid4().hex}"
    secret_file.write_text(secret)
    try:
        prog = f"""
import os
print(sorted(os.environ.items()))
for p in ({str(secret_file)!r}, "/proc/1/environ", "/proc/self/environ"):
    try:
        print(open(p, "rb").read())
    except OSError as e:
        print(type(e).__name__)
for d in ({str(home)!r}, "/home", "/root", "/work"):
    try:
        print(d, os.listdir(d))
    except OSError as e:
        print(d, type(e).__name__)
"""
        v = sb.run(prog)
    finally:
        secret_file.unlink()
    assert v.status == "ok", v.stderr
    assert secret not in v.stdout and secret not in v.stderr
    assert "CASCADE_TEST_SECRET" not in v.stdout
    assert secret_file.name not in v.stdout
    assert os.environ["CASCADE_TEST_SECRET"] == secret


def test_fork_bomb_contained(sb):
    prog = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t = time.monotonic()
    v = sb.run(prog, time_limit=1.5)
    assert time.monotonic() - t < 6
    # the cgroup pids limit stopped it (the autouse fixture checks that nothing of it is left)
    assert v.status == "time_limit" and "processes" in v.limits_hit


def test_memory_bomb(sb):
    v = sb.run("x = []\nwhile True:\n    x.append(bytearray(8 << 20))\n")
    assert v.status == "memory_limit", v
    assert "memory" in v.limits_hit, v.limits_hit
    v = sb.run("x = bytearray(2 << 30)")
    assert v.status == "memory_limit" and v.limits_hit == ["memory"], v.limits_hit
    v = sb.run("x = bytearray(100 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\nprint('ok')")
    assert v.status == "ok" and v.peak_memory_bytes >= 100 << 20


def test_memory_bomb_across_processes_hits_cgroup(sb):
    # each process stays under its address-space limit; together they exceed the cgroup limit
    prog = """
import os
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        x = bytearray(200 << 20)
        for i in range(0, len(x), 4096):
            x[i] = 1
        os._exit(0)
    kids.append(pid)
bad = 0
for k in kids:
    _, st = os.waitpid(k, 0)
    bad += st != 0
print(bad)
"""
    v = Sandbox(SandboxConfig(**{**CFG.__dict__, "time_limit": 5.0})).run(prog)
    assert "memory" in v.limits_hit and int(v.stdout.strip() or 6) > 0
    assert v.peak_memory_bytes <= (256 + 64 + 32 + 8) << 20


def test_infinite_loop(sb):
    v = sb.run("while True:\n    pass\n", time_limit=1.0)
    assert v.status == "time_limit"
    assert 0.9 <= v.wall_time < 3.0


def test_cpu_limit_with_threads_and_sigxcpu_ignored(sb):
    prog = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    # the soft limit (1 s) is ignored, so the hard one (2 s of CPU) kills it, well before the wall limit
    v = Sandbox(SandboxConfig(**{**CFG.__dict__, "time_limit": 30.0, "cpu_time_limit": 1.0})).run(prog)
    assert v.status == "time_limit" and v.limits_hit == ["cpu_time"] and v.signal == 9
    assert v.cpu_time >= 1.9


def test_infinite_print(sb):
    v = sb.run("while True:\n    print('spam' * 100)\n")
    assert v.status == "output_limit"
    assert len(v.stdout) <= CFG.output_limit_bytes + (1 << 16)
    v = sb.run("import sys\nwhile True:\n    sys.stderr.write('e' * 1000)\n")
    assert v.status == "output_limit" and len(v.stderr) <= CFG.stderr_keep_bytes


def test_sleep_past_wall_limit(sb):
    t = time.monotonic()
    v = sb.run("import time\ntime.sleep(100)\n", time_limit=1.0)
    assert v.status == "time_limit" and "wall_time" in v.limits_hit
    assert time.monotonic() - t < 3.0


def test_kill_parent_and_everything(sb):
    v = sb.run("import os\ntry:\n    os.kill(os.getppid(), 9)\n    print('sent')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    assert v.status == "ok" and v.stdout.strip() in ("PermissionError", "sent")
    # kill(-1) reaches every process the caller may signal: only its own, inside the namespace
    v = sb.run("import os, time\nif os.fork() == 0:\n    time.sleep(5)\n    os._exit(0)\n"
               "os.kill(-1, 9)\nprint('survived')\nprint(os.wait()[1])\n")
    assert v.status == "ok" and v.stdout.split() == ["survived", "9"]
    assert os.getpid() > 0  # we are still here


def test_detached_background_process_dies(sb, tmp_path):
    os.chmod(tmp_path, 0o777)
    marker = tmp_path / "marker"
    token = uuid.uuid4().hex
    prog = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sys.argv[0] = "{token}"
        time.sleep(2)
        for p in ({str(marker)!r}, "/tmp/marker"):
            try:
                open(p, "w").write("{token}")
            except OSError:
                pass
        os._exit(0)
    os._exit(0)
print("parent done")
"""
    t = time.monotonic()
    v = sb.run(prog, time_limit=5.0)
    assert v.status == "ok" and v.stdout.strip() == "parent done"
    assert time.monotonic() - t < 2.0  # did not wait for the daemon
    assert pids_of_uid(UID) == []
    time.sleep(2.3)
    assert not marker.exists()
    assert pids_of_uid(UID) == []


def test_a_program_may_reopen_its_standard_streams(sb):
    """The host's pipes were root's with mode 0600: a program reading /dev/stdin (or writing /dev/stdout) as many
    competitive programmers' do failed with EACCES, a right answer scored as a runtime error."""
    v = sb.run("print(open('/dev/stdin').read().split(), flush=True)\nopen('/dev/stdout', 'w').write('out\\n')\n", "3 4\n")
    assert v.status == "ok" and v.stdout == "['3', '4']\nout\n", v.stderr[-300:]


def test_large_stdin(sb):
    data = b"0123456789" * (5 << 20)  # 50 MiB
    v = sb.run("import sys\nprint(len(sys.stdin.buffer.read()))\n", data, time_limit=10.0)
    assert v.status == "ok" and v.stdout.strip() == str(len(data))
    t = time.monotonic()
    v = sb.run("print('ignored stdin')\n", data, time_limit=10.0)
    assert v.status == "ok" and time.monotonic() - t < 5.0


def test_missing_layer_refused_unless_allowed(monkeypatch):
    fake = {**LAYERS, "seccomp": "pretend the kernel lacks it", "cgroup_pids": "pretend"}
    strict = Sandbox(CFG, _layers=fake)
    with pytest.raises(SandboxUnavailable) as e:
        strict.run("print(1)")
    assert "seccomp" in str(e.value) and "cgroup_pids" in str(e.value)
    part = Sandbox(SandboxConfig(**{**CFG.__dict__, "allow_missing": ("seccomp",)}), _layers=fake)
    with pytest.raises(SandboxUnavailable) as e:
        part.run("print(1)")
    assert "cgroup_pids" in str(e.value) and "seccomp" not in str(e.value).split("(")[0]
    weak = Sandbox(SandboxConfig(**{**CFG.__dict__, "allow_weaker": True}), _layers=fake)
    v = weak.run("import socket\ns = socket.socket()\nprint('socket ok')")
    assert v.status == "ok" and "socket ok" in v.stdout and "seccomp" not in v.layers
    monkeypatch.setenv(sbx.ALLOW_ENV, "seccomp,cgroup_pids")
    assert strict.run("print(2)").stdout.strip() == "2"


def test_detection_without_bwrap(monkeypatch):
    monkeypatch.setattr(sbx, "_bwrap", lambda: None)
    layers = sbx._probe(CFG)
    assert "bubblewrap" in layers["namespaces"] and layers["seccomp"] is not None
    assert layers["uid"] is None and layers["rlimits"] is None
    with pytest.raises(SandboxUnavailable, match="namespaces"):
        Sandbox(CFG, _layers=layers).run("print(1)")
    # the weaker mode still runs, unprivileged, with limits and a clean environment
    weak = Sandbox(SandboxConfig(**{**CFG.__dict__, "allow_weaker": True}), _layers=layers)
    v = weak.run("import os\nprint(os.getuid(), 'PATH' in os.environ, 'CASCADE_TEST' in os.environ)")
    assert v.status == "ok" and v.stdout.split()[1:] == ["True", "False"]
    assert v.stdout.split()[0] == (str(CFG.uid) if os.getuid() == 0 else str(os.getuid()))
    assert weak.run("while True: pass", time_limit=0.5).status == "time_limit"


def test_seccomp_filter_shape():
    bpf = sbx.seccomp_filter()
    assert bpf is not None and len(bpf) % 8 == 0 and len(bpf) // 8 == 20


KEYS = r"""
import ctypes, os, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
add_key, request_key, keyctl = {nrs}
USER_KEYRING, KEYCTL_SEARCH, KEYCTL_READ = -4, 10, 11
if sys.argv[1] == "write":
    r = libc.syscall(add_key, b"user", b"cascade-leak-{tag}", b"left by run 1", 13, USER_KEYRING)
else:
    r = libc.syscall(keyctl, KEYCTL_SEARCH, USER_KEYRING, b"user", b"cascade-leak-{tag}", 0)
    if r >= 0:
        buf = ctypes.create_string_buffer(64)
        print("READ", buf.raw[:libc.syscall(keyctl, KEYCTL_READ, r, buf, 64)])
print(r, ctypes.get_errno(), libc.syscall(request_key, b"user", b"cascade-leak-{tag}", None, 0), ctypes.get_errno())
"""


@pytest.mark.skipif(LAYERS["seccomp"] is not None, reason=f"needs the seccomp layer: {LAYERS['seccomp']}")
def test_kernel_keyrings_are_refused(sb):
    """Keyrings belong to the uid, not to a namespace: a key one run stored would be there for a
    later run, in a later start. The seccomp filter refuses the keyring calls (EPERM)."""
    nrs = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[sbx.platform.machine()]
    prog = KEYS.format(nrs=nrs, tag=uuid.uuid4().hex[:8])
    w = sb.run_many({"k.py": prog}, [sbx.Run("k.py", args=("write",))])[0]
    r = sb.run_many({"k.py": prog}, [sbx.Run("k.py", args=("read",))])[0]  # a second start
    assert w.status == r.status == "ok", (w.stderr, r.stderr)
    assert w.stdout.split() == ["-1", "1", "-1", "1"], w.stdout  # EPERM, for add_key and request_key
    assert "READ" not in r.stdout and r.stdout.split() == ["-1", "1", "-1", "1"], r.stdout


NAMESPACES = r"""
import ctypes, errno, os, platform, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
NEWUSER, SIGCHLD = 0x10000000, 17
nr_clone = {"x86_64": 56, "aarch64": 220}[platform.machine()]
def call(f, *a):
    ctypes.set_errno(0)
    r = f(*a)
    return r, errno.errorcode.get(ctypes.get_errno(), "0") if r < 0 else "0"
# clone first: once in a user namespace of its own (after an unshare let through), the uid has no
# mapping for a further one, and clone would fail whatever the filter
r = libc.syscall(nr_clone, NEWUSER | SIGCHLD, None, None, None, None)
if r == 0:  # the child of a clone let through
    os._exit(0)
err = errno.errorcode.get(ctypes.get_errno(), "0") if r < 0 else "0"
if r > 0:
    os.waitpid(r, 0)
print("clone", r if r < 0 else "child", err)
print("unshare", *call(libc.unshare, NEWUSER))
print("clone3", *call(libc.syscall, 435, None, ctypes.c_size_t(0)))  # (EINVAL, were it let through)
out = []
t = threading.Thread(target=out.append, args=("thread",))
t.start()
t.join()
out.append(subprocess.run(["/bin/echo", "spawned"], capture_output=True, text=True).stdout.strip())
pid = os.fork()
if pid == 0:
    os._exit(7)
out.append("forked %d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(*out)
"""


@pytest.mark.skipif(LAYERS["seccomp"] is not None, reason=f"needs the seccomp layer: {LAYERS['seccomp']}")
def test_no_nested_user_namespace(sb):
    """A run could create a user namespace of its own (unshare or clone with CLONE_NEWUSER), holding every
    capability inside it: the filter refuses both (EPERM), and clone3, whose flags it cannot read, is
    ENOSYS (as in Docker's default profile), so that glibc falls back to clone: threads, subprocesses
    and fork still work."""
    v = sb.run(NAMESPACES)
    assert v.status == "ok", v.stderr
    assert v.stdout.splitlines() == ["clone -1 EPERM", "unshare -1 EPERM", "clone3 -1 ENOSYS",
                                     "thread spawned forked 7"], v.stdout


def test_bound_etc_files_are_readable_by_runs(sb):
    """bwrap made /etc 0700 (root's), so the runs (another uid) could not read the files bound there."""
    binds = [f for f in ("/etc/ld.so.cache", "/etc/localtime") if os.path.exists(f)]
    if "/etc/localtime" not in binds:
        pytest.skip("the host has no /etc/localtime")
    v = sb.run(f"import os\nprint(oct(os.stat('/etc').st_mode & 0o777))\n"
               f"for f in {binds!r}:\n    print(len(open(f, 'rb').read()) > 0)\n")
    assert v.status == "ok", v.stderr
    assert v.stdout.split() == ["0o755"] + ["True"] * len(binds), v.stdout


def _site_dirs_of_host() -> list[str]:
    """The host's non-empty site-packages / dist-packages directories of the interpreter and /usr."""
    import glob
    import sysconfig

    prefix = sbx._python_install(CFG)[1]
    found = {sysconfig.get_path(k, vars={"base": prefix, "platbase": prefix}) for k in ("purelib", "platlib")}
    found.update(glob.glob("/usr/local/lib/python3*/dist-packages") + glob.glob("/usr/lib/python3/dist-packages"))
    return sorted(d for d in found if os.path.isdir(d) and os.listdir(d))


def test_site_packages_are_masked(sb):
    """Runs are stdlib-only (python -S -s), yet the interpreter's whole prefix is bound: a non-editable
    install of this project (its seeds: hidden tests, expected outputs, references) would be readable
    in its site-packages. Every site-packages / dist-packages directory is an empty mount instead."""
    dirs = _site_dirs_of_host()
    if not dirs:
        pytest.skip("no non-empty site-packages on this host")
    prog = f"""
import json, os
out = {{}}
for d in {dirs!r}:
    try:
        out[d] = os.listdir(d)
    except OSError as e:
        out[d] = type(e).__name__
print(json.dumps(out))
"""
    v = sb.run(prog)
    assert v.status == "ok", v.stderr
    seen = json.loads(v.stdout)
    assert all(seen[d] in ([], "FileNotFoundError") for d in dirs), {d: seen[d][:5] for d in dirs}


def test_classify_rules():
    c = sbx.classify
    assert c(0, None, [], "") == "ok"
    assert c(1, None, [], "Traceback\nMemoryError\n") == "memory_limit"
    assert c(None, 6, [], "terminate called after throwing an instance of 'std::bad_alloc'") == "memory_limit"
    # a run that succeeded is ok, whatever it wrote to stderr (a debug line naming an error)
    assert c(0, None, [], "MemoryError: debug note\n") == c(0, None, [], "std::bad_alloc seen") == "ok"
    assert c(None, 9, ["wall_time"], "") == "time_limit"
    assert c(None, 9, ["output"], "") == "output_limit"
    assert c(None, 9, [], "") == "killed"
    assert c(None, 11, [], "") == "runtime_error"
    assert c(2, None, [], "x") == "runtime_error"


def test_parallel_runs_from_threads(sb):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as ex:
        vs = list(ex.map(lambda i: sb.run(f"print({i} * {i})"), range(12)))
    assert [v.stdout.strip() for v in vs] == [str(i * i) for i in range(12)]


THREADS = r"""
import threading, time
n = 1  # this one
try:
    for _ in range(100):
        threading.Thread(target=time.sleep, args=(0.5,), daemon=True).start()
        n += 1
except RuntimeError:
    pass
print(n)
"""


@pytest.mark.skipif(LAYERS["cgroup_pids"] is not None, reason=f"needs a pids cgroup: {LAYERS['cgroup_pids']}")
def test_a_run_gets_exactly_max_processes_tasks():
    """The start's own tasks (bwrap, its pid 1, the supervisor) are not taken from the run's budget."""
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "max_processes": 8}))
    v = s.run(THREADS)
    assert v.status == "ok" and v.stdout.split() == ["8"] and "processes" in v.limits_hit, (v.stdout, v.stderr)


@pytest.mark.skipif(LAYERS["cgroup_pids"] is not None or os.getuid() != 0,
                    reason="needs a pids cgroup, and root to run a process as the sandbox uid")
def test_other_processes_of_the_uid_do_not_count_against_a_run(sb):
    """RLIMIT_NPROC counts every process of the uid on the host (every start of the uid): with the pids
    cgroup capping each run, a run is not refused threads because other tasks of its uid exist."""
    import subprocess

    try:
        py = sbx._weak_python(*sbx._python_install(CFG))[0]  # one the sandbox uid may run
    except sbx.SandboxError as e:
        pytest.skip(str(e))
    hog = ("import _thread, sys, time\n_thread.stack_size(1 << 16)\n"
           "for _ in range(600):\n    _thread.start_new_thread(time.sleep, (30,))\n"
           "print('up', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([py, "-S", "-c", hog], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         user=UID, group=UID, extra_groups=[], cwd="/")
    try:
        assert p.stdout.readline().strip() == "up"
        v = sb.run(THREADS.replace("range(100)", "range(4)"))
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
    assert v.status == "ok" and v.stdout.split() == ["5"], (v.stdout, v.stderr)


OOM_AFTER_CPU = r"""
import os, time
r, w = os.pipe()
for _ in range(2):  # children that use CPU (together past the CPU limit of 1 s) and some memory, then wait
    if os.fork() == 0:
        t = time.process_time()
        while time.process_time() - t < 0.6:
            pass
        b = bytearray(40 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        os.write(w, b"x")
        time.sleep(10)
        os._exit(0)
os.read(r, 1), os.read(r, 1)
for i in range(4):  # files in /tmp: memory of the cgroup, nobody's to kill
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"x" * (15 << 20))
chunks = []
while True:  # then this process grows past the cgroup's memory (under its own address-space limit)
    c = bytearray(1 << 20)
    for i in range(0, len(c), 4096):
        c[i] = 1
    chunks.append(c)
"""


@pytest.mark.skipif(LAYERS["cgroup_memory"] is not None, reason=f"needs a memory cgroup: {LAYERS['cgroup_memory']}")
def test_an_oom_kill_is_a_memory_limit_not_a_time_limit():
    """The OOM killer's SIGKILL of the first process is not its CPU limit's, though the run's processes
    together used more CPU than that limit (RLIMIT_CPU counts each process alone). (The wall limit leaves
    room for a busy machine: with a 4 s limit the 1.2 s of CPU took past it beside other test processes.)"""
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "memory_mb": 160, "time_limit": 20.0, "cpu_time_limit": 1.0}))
    v = s.run(OOM_AFTER_CPU)
    assert v.status == "memory_limit" and v.signal == 9 and v.limits_hit == ["memory"], (v.limits_hit, v.stderr)
    assert v.cpu_time >= 1.0  # the run's CPU, all processes


ESCAPING_DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()  # out of the process group
    if os.fork() == 0:
        time.sleep(1.5)
        open(sys.argv[2], "w").write("late")
        os._exit(0)
    os._exit(0)
print("42", flush=True)
if sys.argv[1] == "hang":
    time.sleep(30)
"""


def test_weaker_mode_kills_what_left_the_process_group(monkeypatch):
    """Without bwrap or a cgroup, a daemon (setsid, double fork) of the run neither outlives it nor holds
    its pipes open: a correct program is not a time limit, and nothing of the run writes after it."""
    import shutil
    import tempfile

    monkeypatch.setattr(sbx, "_bwrap", lambda: None)
    monkeypatch.setattr(sbx, "_cgroup_bases", lambda cfg: {})
    layers = sbx._probe(CFG)
    weak = Sandbox(SandboxConfig(**{**CFG.__dict__, "allow_weaker": True}), _layers=layers)
    d = tempfile.mkdtemp(prefix="cascade-weak-")
    os.chmod(d, 0o777)
    try:
        t = time.monotonic()
        v = weak.run(ESCAPING_DAEMON, args=["exit", f"{d}/a"], time_limit=1.2)
        took = time.monotonic() - t
        assert v.status == "ok" and v.stdout == "42\n" and v.wall_time < 1.0, (v.status, v.limits_hit, v.wall_time)
        assert took < 1.0  # (it used to wait for the daemon's pipes until the wall limit)
        t = time.monotonic()
        v = weak.run(ESCAPING_DAEMON, args=["hang", f"{d}/b"], time_limit=0.5)
        assert v.status == "time_limit" and v.limits_hit == ["wall_time"] and time.monotonic() - t < 2.0
        time.sleep(1.2)
        assert os.listdir(d) == []  # the daemons were killed with their runs
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- limits and refusals a user relies on, at their boundaries -------------------------------------
def test_output_limit_is_inclusive_and_counts_stdout_and_stderr_together(sb):
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "output_limit_bytes": 1000, "warm": 0}))
    v = s.run("import sys\nsys.stdout.write('x' * 1000)\n")
    assert v.status == "ok" and v.stdout == "x" * 1000 and v.limits_hit == []
    v = s.run("import sys\nsys.stdout.write('x' * 1001)\n")
    assert v.status == "output_limit" and v.limits_hit == ["output"]
    # 600 + 600 bytes: each stream under the limit, together over it
    v = s.run("import sys\nsys.stdout.write('o' * 600)\nsys.stdout.flush()\nsys.stderr.write('e' * 600)\n")
    assert v.status == "output_limit", v


def test_reaching_the_output_limit_ends_the_run_at_once(sb):
    v = sb.run("while True:\n    print('spam' * 100)\n", time_limit=20.0)
    assert v.status == "output_limit" and v.limits_hit == ["output"]
    assert v.wall_time < 5.0, v.wall_time  # killed when the limit was crossed, not at the wall limit


def test_stderr_keeps_the_tail(sb):
    for n in (20000, 50000):  # over the kept 16 KiB: a little, and by more than twice as much
        v = sb.run(f"import sys\nsys.stderr.write('a' * {n} + 'END')\nsys.exit(2)\n")
        assert v.status == "runtime_error" and v.exit_code == 2
        assert len(v.stderr) == CFG.stderr_keep_bytes and v.stderr.endswith("aEND"), (n, v.stderr[-20:])


def test_cpu_limit_rounds_up_to_whole_seconds(sb):
    # cpu_time_limit 1.01 s is a 2 s CPU rlimit: a run using 1.2 s of CPU is within it
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "time_limit": 20.0, "cpu_time_limit": 1.01, "warm": 0}))
    v = s.run("import time\nwhile time.process_time() < 1.2:\n    pass\nprint('done')\n")
    assert v.status == "ok" and v.stdout.strip() == "done", v


def test_open_files_limit(sb):
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "max_open_files": 40, "warm": 0}))
    prog = ("import errno\nfs = []\ntry:\n    while len(fs) < 1000:\n        fs.append(open('/dev/null'))\n"
            "except OSError as e:\n    print(len(fs), e.errno == errno.EMFILE)\n")
    v = s.run(prog)
    # descriptors 0-2 are the run's stdin/stdout/stderr: 37 more fit under a limit of 40
    assert v.status == "ok" and v.stdout.split() == ["37", "True"], v


def test_a_run_inherits_no_descriptor_but_its_standard_streams(sb):
    prog = ("import os\nopen_fds = []\nfor fd in range(3, 1024):\n    try:\n        os.fstat(fd)\n"
            "        open_fds.append(fd)\n    except OSError:\n        pass\nprint(open_fds)\n")
    v = sb.run(prog)
    assert v.status == "ok" and v.stdout.strip() == "[]", v.stdout


def test_a_runs_own_wall_limit_is_kept_to(sb):
    v = sb.run("import time\ntime.sleep(30)\n", time_limit=1.0)
    assert v.status == "time_limit" and v.limits_hit == ["wall_time"] and v.signal == 9
    assert 0.95 <= v.wall_time < 1.8, v.wall_time  # (room for a busy machine; a doubled deadline is 2 s)


def test_a_runs_own_memory_limit_is_kept_to(sb):
    prog = "x = bytearray(100 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\nprint('ok')\n"
    v = sb.run(prog, memory_mb=64)
    assert v.status == "memory_limit" and "memory" in v.limits_hit, v
    assert sb.run(prog).status == "ok"  # the config's 256 MiB hold it


def test_bad_runs_and_configs_are_refused(sb):
    for name in ("../evil.py", "sub/main.py", ".hidden.py", ""):
        with pytest.raises(ValueError, match="bad sandbox file name"):
            sb.run_many({name: "print(1)"}, [sbx.Run(name)])
    with pytest.raises(ValueError, match="not one of the files"):
        sb.run_many({"main.py": "print(1)"}, [sbx.Run("other.py")])
    for t in (0, -1.0):
        with pytest.raises(ValueError, match="time_limit must be positive"):
            sb.run("print(1)", time_limit=t)
    for m in (0, -1, -5):  # a negative memory_mb reached setrlimit as no address-space limit (8 GiB mapped)
        with pytest.raises(ValueError, match=f"memory_mb must be positive, got {m}"):
            sb.run("print(1)", memory_mb=m)
    ran = []  # refused before any run of the session: the good first run is not run either
    with pytest.raises(ValueError, match="time_limit must be positive"):
        sb.run_many({"main.py": "print(1)"}, [sbx.Run("main.py"), sbx.Run("main.py", time_limit=0)],
                    on_verdict=lambda i, v: ran.append(i))
    assert ran == []
    for bad in ({"time_limit": 0}, {"memory_mb": 0}, {"max_processes": 0}, {"warm": -1},
                {"compile_time_limit": 0}, {"compile_memory_mb": 0}, {"allow_missing": ("network",)}):
        with pytest.raises(ValueError):
            SandboxConfig(**bad)


def test_allowed_missing_from_the_environment(monkeypatch):
    monkeypatch.delenv(sbx.ALLOW_ENV, raising=False)
    assert SandboxConfig().allowed_missing() == set()
    assert SandboxConfig(allow_missing=("seccomp",)).allowed_missing() == {"seccomp"}
    assert SandboxConfig(allow_weaker=True).allowed_missing() == set(sbx.LAYERS)
    monkeypatch.setenv(sbx.ALLOW_ENV, " uid , bogus,cgroup_memory")
    assert SandboxConfig().allowed_missing() == {"uid", "cgroup_memory"}
    monkeypatch.setenv(sbx.ALLOW_ENV, "1")
    assert SandboxConfig().allowed_missing() == set(sbx.LAYERS)


def test_verdict_to_dict_cuts_only_longer_output():
    v = sbx.Verdict("ok", 0, None, "a" * 10, "b" * 14, 0.123456, 0.5, None)
    d = v.to_dict(excerpt=10)
    assert d["stdout"] == "a" * 10
    assert d["stderr"] == "bbbbb\n...[4 chars cut]...\nbbbbb"
    assert d["wall_time"] == 0.1235 and v.to_dict(excerpt=None)["stderr"] == "b" * 14


def test_arithmetic_signal_is_a_runtime_error_and_a_foreign_one_a_kill(sb):
    v = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGFPE)\n")
    assert v.status == "runtime_error" and v.signal == 8 and v.exit_code is None
    v = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert v.status == "killed" and v.signal == 15 and v.exit_code is None


def test_unknown_language_of_a_run_is_refused(sb):
    with pytest.raises(ValueError, match="unknown language"):
        sb.run_many({"main.py": "print(1)"}, [sbx.Run("main.py", language="rust")])


def test_text_stdin_arrives_as_utf8(sb):
    v = sb.run("import sys\nd = sys.stdin.buffer.read()\nprint(len(d), d.decode())\n", "h\u00e9 \u2713")
    assert v.status == "ok" and v.stdout == "7 h\u00e9 \u2713\n"  # 1 + 2 + 1 + 3 bytes


def test_the_working_directory_is_capped_at_tmpfs_mb(sb):
    if not sb._bwrap_has_size():
        pytest.skip("bwrap without --size: the cgroup alone bounds /tmp")
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "tmpfs_mb": 8, "warm": 0}))
    prog = ("n = 0\ntry:\n    for i in range(64):\n        with open(f'/tmp/f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (1 << 20))\n        n += 1\nexcept OSError as e:\n    print('stopped', e.errno)\n"
            "print(n)\n")
    v = s.run(prog)
    stopped, n = v.stdout.split("\n")[:2]
    assert v.status == "ok" and stopped == "stopped 28" and 7 <= int(n) <= 8, v.stdout  # ENOSPC past 8 MiB


def test_the_program_directory_and_system_are_read_only_mounts(sb):
    # not only unwritable to the run's uid: read-only mounts (a root-owned 0755 /box would refuse writes too)
    v = sb.run("import os\nprint([bool(os.statvfs(d).f_flag & os.ST_RDONLY) for d in ('/box', '/usr', '/tmp')])\n")
    assert v.status == "ok" and v.stdout == "[True, True, False]\n", v


def test_the_cpu_limit_ends_a_busy_run_by_sigxcpu(sb):
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "time_limit": 20.0, "cpu_time_limit": 1.0, "warm": 0}))
    v = s.run("while True:\n    pass\n")
    assert v.status == "time_limit" and v.limits_hit == ["cpu_time"] and v.signal == 24, v  # SIGXCPU
    assert 0.9 <= v.cpu_time < 2.0  # (the kernel counts that limit in ticks)


def test_memory_mb_caps_each_processs_address_space(sb):
    # an untouched 1 GiB mapping uses no memory, yet is refused under a 256 MiB address space
    v = sb.run("import mmap\ntry:\n    mmap.mmap(-1, 1 << 30)\n    print('mapped')\nexcept OSError as e:\n    print(e.errno)\n")
    assert v.status == "ok" and v.stdout == "12\n", v  # ENOMEM
