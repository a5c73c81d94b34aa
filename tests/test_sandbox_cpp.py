"""C++ in the code sandbox: g++ compiles inside the same layers under its own limits, then the
binary runs each test in a fresh child with the run limits. The hostile programs of
test_sandbox.py, in C++ (one program, compiled once for the module, reads what to do from stdin):
each is contained with the right verdict, and the host is unaffected. Then the compile step's own
escapes and limits, the judge's verdicts for C++, and the weaker mode."""
from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from envs.code import sandbox as sbx
from envs.code.judge import Judge
from envs.code.sandbox import Run, Sandbox, SandboxConfig
from tests.conftest import assert_no_processes_of

# a uid of our own, so that concurrent test sessions' sandboxes are not taken for our leftovers
UID = 53000 + os.getpid() % 4000
CFG = SandboxConfig(time_limit=2.0, memory_mb=256, output_limit_bytes=1 << 20, max_processes=16, uid=UID, gid=UID,
                    warm=0, compile_time_limit=20.0, compile_memory_mb=768)
LAYERS = sbx.detect_layers(CFG)
pytestmark = [
    pytest.mark.skipif(LAYERS["namespaces"] is not None, reason=f"sandbox needs bubblewrap: {LAYERS['namespaces']}"),
    pytest.mark.skipif(not sbx.shutil.which("g++"), reason="C++ needs g++ (apt-get install g++)"),
]

# one program, many behaviours: the first word of stdin says which; the rest are its arguments
HOSTILE = r"""
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/ipc.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static std::string ns() {
    char buf[128] = {0};
    ssize_t n = readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    return n > 0 ? std::string(buf, n) : "?";
}

int main(int argc, char** argv) {
    std::string cmd, arg;
    std::cin >> cmd;
    std::vector<std::string> args;
    while (std::cin >> arg) args.push_back(arg);
    if (cmd == "fork") { for (;;) fork(); }
    if (cmd == "loop") { volatile unsigned long x = 0; for (;;) x = x + 1; }
    if (cmd == "sleep") { sleep(100); }
    if (cmd == "mem") {  // allocates and touches 8 MiB at a time until something stops it
        std::vector<char*> keep;
        for (;;) { char* p = new char[8 << 20]; memset(p, 1, 8 << 20); keep.push_back(p); }
    }
    if (cmd == "forkmem") {  // each process under its address-space limit, together over the cgroup's
        for (int k = 0; k < 6; k++) if (fork() == 0) {
            char* p = (char*)malloc(200 << 20);
            if (p) for (long i = 0; i < (200L << 20); i += 4096) p[i] = 1;
            _exit(0);
        }
        int st, bad = 0;
        while (wait(&st) > 0) bad += st != 0;
        printf("%d\n", bad);
        return 0;
    }
    if (cmd == "ok100") {  // 100 MiB, touched: within the limit
        char* p = (char*)malloc(100 << 20);
        for (long i = 0; i < (100L << 20); i += 4096) p[i] = 1;
        puts("ok");
        return 0;
    }
    if (cmd == "spam") { for (;;) fputs("spamspamspamspamspamspamspamspamspamspam\n", stdout); }
    if (cmd == "errspam") { for (;;) fputs("eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee", stderr); }
    if (cmd == "segv") { volatile int* p = nullptr; *p = 1; }
    if (cmd == "exit") { return std::atoi(args.at(0).c_str()); }
    if (cmd == "abort") { abort(); }
    if (cmd == "net") {  // socket() of the internet families, then a connect to the host's loopback
        for (int fam : {AF_INET, AF_INET6}) {
            int s = socket(fam, SOCK_STREAM, 0);
            printf("%s ", s < 0 ? (errno == EACCES ? "EACCES" : strerror(errno)) : "SOCKET");
        }
        int s = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(std::atoi(args.at(0).c_str()));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        printf("%s\n", s >= 0 && connect(s, (sockaddr*)&a, sizeof a) == 0 ? "CONNECTED" : "refused");
        return 0;
    }
    if (cmd == "write") {  // each target: written or why not
        for (auto& t : args) {
            int fd = open(t.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
            printf("%s %s\n", t.c_str(), fd >= 0 && write(fd, "x", 1) == 1 ? "written" : "refused");
        }
        FILE* f = fopen("inside.txt", "w");
        printf("cwd %s\n", f && fputs("ok", f) >= 0 ? "written" : "refused");
        return 0;
    }
    if (cmd == "read") {  // each path: its first bytes, or why not; then the environment
        for (auto& t : args) {
            FILE* f = fopen(t.c_str(), "r");
            char buf[256] = {0};
            if (f && fread(buf, 1, sizeof buf - 1, f) > 0) printf("%s READ %s\n", t.c_str(), buf);
            else printf("%s %s\n", t.c_str(), f ? "empty" : strerror(errno));
            DIR* d = opendir(t.c_str());
            if (d) { struct dirent* e; while ((e = readdir(d))) printf("  %s\n", e->d_name); closedir(d); }
        }
        extern char** environ;
        for (char** e = environ; *e; e++) printf("ENV %s\n", *e);
        return 0;
    }
    if (cmd == "leak") {  // leave things behind for the next test
        FILE* f = fopen("/tmp/leak.txt", "w"); fputs("secret", f); fclose(f);
        mkdir("/tmp/d", 0700); mkdir("/tmp/d/e", 0700);
        f = fopen("/tmp/d/e/f", "w"); fputs("y", f); fclose(f);
        chmod("/tmp/d", 0);
        mkfifo("/tmp/fifo", 0666);
        printf("shm %d\n", shmget(0x5EED, 4096, IPC_CREAT | 0666) >= 0);
        if (fork() == 0) { setsid(); usleep(400000); FILE* g = fopen("/tmp/late.txt", "w"); if (g) fclose(g); _exit(0); }
        printf("%s\n", ns().c_str());
        return 0;
    }
    if (cmd == "look") {  // what is left of earlier tests
        usleep(600000);
        DIR* d = opendir("/tmp");
        struct dirent* e;
        int n = 0;
        while ((e = readdir(d))) if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) { printf("LEFT %s\n", e->d_name); n++; }
        char cwd[256];
        printf("left=%d shm=%d cwd=%s uid=%d euid=%d\n", n, shmget(0x5EED, 0, 0) >= 0, getcwd(cwd, sizeof cwd),
               (int)getuid(), (int)geteuid());
        printf("%s\n", ns().c_str());
        return 0;
    }
    if (cmd == "tamper") {  // the compiled program itself: read-only to the runs
        struct stat st;
        stat("/box/main.cpp.bin", &st);
        printf("%d %o %d %d\n", (int)st.st_uid, st.st_mode & 0777, chmod("/box/main.cpp.bin", 0777) == 0,
               open("/box/main.cpp.bin", O_WRONLY) >= 0);
        return 0;
    }
    long long v = std::stoll(cmd);
    std::cout << 2 * v << " " << ns() << "\n";
    return 0;
}
"""


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert_no_processes_of(UID)


@pytest.fixture(scope="module")
def sb():
    s = Sandbox(CFG)
    s.check()
    yield s
    s.close()


class _Server:
    """A TCP server on the host's 127.0.0.1 that records every connection it accepts."""

    def __init__(self):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.1)
        self.port = self.srv.getsockname()[1]
        self.accepted: list = []
        self.stop = threading.Event()
        self.th = threading.Thread(target=self._serve, daemon=True)
        self.th.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                self.accepted.append(self.srv.accept()[0])
            except OSError:
                pass

    def close(self):
        time.sleep(0.2)
        self.stop.set()
        self.th.join()
        self.srv.close()


@pytest.fixture(scope="module")
def session(sb, tmp_path_factory):
    """The hostile program compiled once and run on every command, all in one sandbox start."""
    host_dir = tmp_path_factory.mktemp("host")
    os.chmod(host_dir.parent, 0o777)
    os.chmod(host_dir, 0o777)
    repo_target = Path(__file__).resolve().parent / f"sandbox-escape-{uuid.uuid4().hex}"
    secret = f"cascade-secret-{uuid.uuid4().hex}"
    secret_file = Path.home() / f".cascade-sandbox-cpp-{uuid.uuid4().hex}"
    secret_file.write_text(secret)
    os.environ["CASCADE_TEST_SECRET"] = secret
    server = _Server()
    writes = ["/usr/escape", "/box/escape", "/box/main.cpp", "/etc/escape", "/escape", str(host_dir / "escape"),
              str(repo_target)]
    reads = [str(secret_file), str(Path.home()), "/work", "/root", "/home", "/proc/1/environ", "/etc/shadow"]
    cmds = {"first": "1", "fork": "fork", "loop": "loop", "sleep": "sleep", "mem": "mem", "forkmem": "forkmem",
            "ok100": "ok100", "spam": "spam", "errspam": "errspam", "segv": "segv", "exit3": "exit 3",
            "abort": "abort", "net": f"net {server.port}", "write": "write " + " ".join(writes),
            "read": "read " + " ".join(reads), "leak": "leak", "look": "look", "tamper": "tamper", "last": "21"}
    limits = {"fork": 1.5, "loop": 1.0, "sleep": 1.0, "forkmem": 5.0}
    runs = [Run("main.cpp", c + "\n", time_limit=limits.get(k), language="cpp") for k, c in cmds.items()]
    t = time.monotonic()
    try:
        vs = sb.run_many({"main.cpp": HOSTILE}, runs)
    finally:
        server.close()
        secret_file.unlink()
        del os.environ["CASCADE_TEST_SECRET"]
    took = time.monotonic() - t
    return {"v": dict(zip(cmds, vs)), "took": took, "host_dir": host_dir, "repo_target": repo_target,
            "secret": secret, "secret_file": secret_file, "accepted": server.accepted, "writes": writes}


def test_compiled_once_and_run_in_one_start_with_every_layer(session):
    v = session["v"]
    first, last = v["first"], v["last"]
    assert first.status == last.status == "ok", (first.stderr, first.compile)
    assert first.stdout.split()[0] == "2" and last.stdout.split()[0] == "42"
    assert first.stdout.split()[1] == last.stdout.split()[1] == v["leak"].stdout.split()[-1]  # one start
    assert set(first.layers) == set(sbx.LAYERS)
    c = first.compile
    assert c["status"] == "ok" and c["exit_code"] == 0 and c["wall_time"] > 0 and c["peak_memory_bytes"] > 1 << 20
    assert all(x.compile == c for x in v.values())  # one compile for the whole session
    assert first.wall_time < 1.0 and session["took"] < 30


def test_normal_verdicts_nonzero_exit_segfault_abort(session):
    v = session["v"]
    assert v["exit3"].status == "runtime_error" and v["exit3"].exit_code == 3
    assert v["segv"].status == "runtime_error" and v["segv"].signal == 11
    assert v["abort"].status == "runtime_error" and v["abort"].signal == 6


def test_fork_bomb_contained(session):
    v = session["v"]["fork"]
    assert v.status == "time_limit" and "processes" in v.limits_hit and v.wall_time < 3


def test_infinite_loop_and_sleep(session):
    loop, sleep = session["v"]["loop"], session["v"]["sleep"]
    assert loop.status == "time_limit" and 0.9 <= loop.wall_time < 3.0
    assert sleep.status == "time_limit" and "wall_time" in sleep.limits_hit and sleep.wall_time < 3.0


def test_memory_hog(session):
    v = session["v"]
    assert v["mem"].status == "memory_limit", (v["mem"].stderr, v["mem"].limits_hit)
    fm = v["forkmem"]
    assert "memory" in fm.limits_hit and int(fm.stdout.strip() or 6) > 0
    assert fm.peak_memory_bytes <= (256 + 64 + 32 + 8) << 20
    assert v["ok100"].status == "ok" and v["ok100"].peak_memory_bytes >= 100 << 20


def test_huge_output(session):
    spam, err = session["v"]["spam"], session["v"]["errspam"]
    assert spam.status == "output_limit" and len(spam.stdout) <= CFG.output_limit_bytes + (1 << 16)
    assert err.status == "output_limit" and len(err.stderr) <= CFG.stderr_keep_bytes


def test_network_blocked(session):
    v = session["v"]["net"]
    assert v.status == "ok", v.stderr
    assert v.stdout.split() == ["EACCES", "EACCES", "refused"]  # seccomp refuses socket()
    assert session["accepted"] == []


def test_writes_outside_tmp_fail_and_host_untouched(session):
    v = session["v"]["write"]
    assert v.status == "ok", v.stderr
    got = dict(line.rsplit(" ", 1) for line in v.stdout.splitlines())
    assert got.pop("cwd") == "written"
    assert got == {t: "refused" for t in session["writes"]}
    assert list(session["host_dir"].iterdir()) == [] and not session["repo_target"].exists()
    # the compiled program is the host's, read-only: a run can change neither it nor its mode
    t = session["v"]["tamper"]
    assert t.status == "ok" and t.stdout.split()[1:] == ["755", "0", "0"]
    assert t.stdout.split()[0] != str(UID)


def test_host_files_and_env_not_visible(session):
    v = session["v"]["read"]
    assert v.status == "ok", v.stderr
    out = v.stdout
    assert session["secret"] not in out and session["secret"] not in v.stderr
    listed = {line.strip() for line in out.splitlines() if line.startswith("  ")}
    assert session["secret_file"].name not in listed and str(session["secret_file"]) + " No such file" in out
    assert "READ" not in out  # not one of them could be read
    assert "CASCADE_TEST_SECRET" not in out
    env = {line[4:].split("=", 1)[0] for line in out.splitlines() if line.startswith("ENV ")}
    assert env <= set(sbx._clean_env()) | {"PWD"}  # bwrap sets PWD (its --chdir)


def test_nothing_of_a_test_is_seen_by_the_next(session):
    leak, look = session["v"]["leak"], session["v"]["look"]
    assert leak.status == "ok" and leak.stdout.split()[:2] == ["shm", "1"]  # it did create them
    assert look.status == "ok", look.stderr
    lines = look.stdout.splitlines()
    assert lines[0] == f"left=0 shm=0 cwd=/tmp uid={UID} euid={UID}", lines


def test_compile_step_contained_and_limited(sb, tmp_path):
    secret = f"cascade-secret-{uuid.uuid4().hex}"
    secret_file = Path.home() / f".cascade-sandbox-cpp-{uuid.uuid4().hex}"
    secret_file.write_text(f"int {secret};\n")
    try:
        # the compiler sees neither the host's home nor the repository
        v = sb.run(f'#include "{secret_file}"\n#include "{Path(__file__).resolve()}"\nint main() {{}}\n',
                   language="cpp")
    finally:
        secret_file.unlink()
    assert v.status == "compile_error" and "No such file" in v.stderr and secret not in v.stderr
    assert v.compile["status"] == "runtime_error" and v.compile["exit_code"] == 1
    # an include that never ends: the compile's own memory limit stops it, as a compile error
    v = sb.run('#include "/dev/zero"\nint main() {}\n', language="cpp")
    assert v.status == "compile_error" and ("memory" in v.stderr or v.compile["status"] != "runtime_error")
    # the compile's own time limit (the run limit would allow it)
    slow = Sandbox(SandboxConfig(**{**CFG.__dict__, "compile_time_limit": 0.2, "time_limit": 10.0}))
    v = slow.run("#include <bits/stdc++.h>\nint main() { std::cout << 1; }\n", language="cpp")
    assert v.status == "compile_error" and "compile time limit (0.2 s)" in v.stderr
    assert v.compile["status"] == "time_limit" and v.compile["wall_time"] < 2


def test_compile_error_is_a_verdict_not_a_crash(sb):
    vs = sb.run_many({"bad.cpp": "int main() { return undeclared; }\n", "ok.py": "print(5)"},
                     [Run("bad.cpp", "", language="cpp"), Run("ok.py"), Run("bad.cpp", "1", language="cpp")])
    assert [v.status for v in vs] == ["compile_error", "ok", "compile_error"]
    assert "bad.cpp:1:21: error: 'undeclared' was not declared" in vs[0].stderr.replace("‘", "'").replace("’", "'")
    assert "/box/" not in vs[0].stderr and vs[0].stderr == vs[2].stderr and vs[1].stdout == "5\n"


PROG = r"""
#include <bits/stdc++.h>
int main() {
    long long n; std::cin >> n;
    if (n == 7) { std::cout << 15 << "\n"; return 0; }  // wrong
    if (n == 8) { int* p = nullptr; return *(volatile int*)p; }  // segfault
    if (n == 9) return 1;                                         // nonzero exit
    if (n == 10) for (;;) {}                                      // time limit
    std::cout << 2 * n << "\n";
}
"""


def test_judge_cpp_verdicts(sb):
    tests = [{"input": f"{n}\n", "output": str(2 * n)} for n in (1, 7, 8, 9, 10, 2)]
    t = time.monotonic()
    j = Judge(sb, time_limit=1.0).judge(PROG, tests, language="cpp")
    took = time.monotonic() - t
    assert [r.status for r in j.results] == ["accepted", "wrong_answer", "runtime_error", "runtime_error",
                                             "time_limit", "accepted"], [(r.status, r.detail) for r in j.results]
    assert j.passed == 2 and j.status == "wrong_answer" and j.language == "cpp" and j.compile["status"] == "ok"
    assert took < j.compile["wall_time"] + 1.0 + 4.0  # compile + the time limit + little else
    j = Judge(sb).judge("int main() { retrun 0; }", tests, language="cpp", stop_on_failure=True)
    assert j.status == "compile_error" and j.passed == 0
    assert [r.status for r in j.results] == ["compile_error"] + ["skipped"] * 5
    assert "retrun" in j.results[0].detail and j.to_dict()["compile"]["exit_code"] == 1
    with pytest.raises(ValueError, match="stdin/stdout tests only"):
        Judge(sb).judge(PROG, [{"fn": "f", "args": [], "expected": 1}], language="cpp")


def test_a_strict_umask_on_the_host_fails_no_cpp_answer():
    """The compile runs as the sandbox uid with the umask it inherits from the host: under 077 the binary
    was 0700 (the uid's), and the supervisor (root without CAP_DAC_OVERRIDE) could not read it to take it
    out of the start: every C++ answer raised (or, in an environment, scored 0). Runs use umask 022."""
    old = os.umask(0o077)
    try:
        s = Sandbox(SandboxConfig(**{**CFG.__dict__, "warm": 0}))  # (the start is made under this umask)
        j = Judge(s).judge('#include <cstdio>\nint main() { puts("hi"); }\n', [{"input": "", "output": "hi"}],
                           language="cpp")
        v = s.run("import os\nopen('f', 'w').close()\nprint(oct(os.stat('f').st_mode & 0o777))")
    finally:
        os.umask(old)
    assert j.status == "accepted", [(r.status, r.detail) for r in j.results]
    assert v.stdout == "0o644\n", (v.stdout, v.stderr)


def test_cpp_in_the_weaker_mode(monkeypatch):
    monkeypatch.setattr(sbx, "_bwrap", lambda: None)
    layers = sbx._probe(CFG)
    weak = Sandbox(SandboxConfig(**{**CFG.__dict__, "allow_weaker": True}), _layers=layers)
    src = "#include <cstdio>\n#include <unistd.h>\nint main() { int n; scanf(\"%d\", &n); printf(\"%d %d\\n\", 3 * n, getuid()); }\n"
    vs = weak.run_many({"m.cpp": src}, [Run("m.cpp", "2", language="cpp"), Run("m.cpp", "5", language="cpp")])
    assert [v.status for v in vs] == ["ok", "ok"], [v.stderr for v in vs]
    want_uid = str(CFG.uid) if os.getuid() == 0 else str(os.getuid())
    assert [v.stdout.split() for v in vs] == [["6", want_uid], ["15", want_uid]]
    assert weak.run("int main() { x; }", language="cpp").status == "compile_error"


def test_refused_up_front_without_a_usable_compiler_or_exec_dir(sb, monkeypatch):
    monkeypatch.setattr(sbx.os, "statvfs", lambda p: type("V", (), {"f_flag": sbx.os.ST_NOEXEC})())
    with pytest.raises(sbx.SandboxUnavailable, match="noexec"):
        sb.run("int main() {}", language="cpp")
    monkeypatch.undo()
    nocxx = Sandbox(SandboxConfig(**{**CFG.__dict__, "cxx": "no-such-g++"}))
    with pytest.raises(sbx.SandboxUnavailable, match="no-such-g\\+\\+"):
        nocxx.run("int main() {}", language="cpp")
    assert nocxx.run("print(1)").stdout == "1\n"  # Python needs no compiler
    with pytest.raises(ValueError, match="unknown language"):
        sb.run("x", language="rust")


SIGNALS = r"""
#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>
int main(int argc, char** argv) {
    std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "ignored") {  // the signals ignored at the start, as the kernel has them
        FILE* f = fopen("/proc/self/status", "r");
        char line[256];
        while (fgets(line, sizeof line, f)) if (!strncmp(line, "SigIgn:", 7)) fputs(line + 7, stdout);
        return 0;
    }
    if (cmd == "big") {  // past the 1 MiB file-size limit
        FILE* g = fopen("/tmp/big", "w");
        static char buf[1 << 20];
        size_t n = 0;
        for (int i = 0; i < 4; i++) n += fwrite(buf, 1, sizeof buf, g);
        fflush(g);
        printf("wrote %zu\n", n);
        return 0;
    }
    int p[2];  // a write to a pipe nobody reads
    pipe(p);
    close(p[0]);
    printf("write %zd\n", write(p[1], "x", 1));
    return 0;
}
"""


def test_binaries_get_sigpipe_and_sigxfsz_at_their_defaults():
    """Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across execve: a C++
    program must not inherit that (a write past the file-size limit would go unreported)."""
    s = Sandbox(SandboxConfig(**{**CFG.__dict__, "file_size_mb": 1}))
    vs = s.run_many({"s.cpp": SIGNALS}, [Run("s.cpp", args=(c,), language="cpp") for c in ("ignored", "big", "pipe")])
    ign, big, pipe = vs
    assert ign.status == "ok" and int(ign.stdout, 16) & (1 << 12 | 1 << 24) == 0, ign.stdout  # bits of 13, 25
    assert big.status == "killed" and big.signal == 25 and big.limits_hit == ["file_size"], (big.stdout, big.limits_hit)
    assert pipe.status == "killed" and pipe.signal == 13 and pipe.stdout == "", pipe.stdout


def test_a_compile_cut_by_the_deadline_says_so(sb):
    """A compile stopped because the session's time ran out did not exceed the compile time limit."""
    v = sb.run_many({"m.cpp": "#include <bits/stdc++.h>\nint main() { std::cout << 1; }\n"},
                    [Run("m.cpp", language="cpp")], deadline=time.monotonic() + 0.3)[0]
    assert v.status == "compile_error" and v.compile["limits_hit"] == ["total_time"], v.compile
    assert "the session's time ran out" in v.stderr and "exceeded the compile time limit" not in v.stderr, v.stderr
