"""Shared fixtures: tiny models and tokenizers built locally (nothing is downloaded)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

_STARTED = pytest.StashKey[bool]()

# Tiny models run fastest on one thread, and tests that spawn process groups must not oversubscribe.
torch.set_num_threads(1)


def pytest_configure(config):
    """A pytest-xdist worker runs at nice 5, its test processes too: the tiny cascade run its controller started
    (nice 0) keeps one core, as it does beside the tests of a one-process run, instead of a third of two cores
    among the two workers; once it ends, the workers have both."""
    if hasattr(config, "workerinput"):
        os.nice(5)


def pytest_collection_modifyitems(session, config, items):
    """A module may define ``start_in_background(config, root=None)`` to start a long job (a whole tiny cascade
    run, one thread) as soon as one of its tests is selected, so that the job runs on the second core while
    the tests before it run; its fixtures then wait for it. (Under pytest-xdist see the next hook; such a module
    also defines ``job_root(testrun_uid)``, where the job of an xdist run lives.)"""
    if config.option.collectonly or hasattr(config, "workerinput"):  # (pytest-xdist: its controller starts them)
        return
    for mod in {item.module for item in items if hasattr(item, "module")}:
        start = getattr(mod, "start_in_background", None)
        if start is not None:
            start(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under pytest-xdist (``make test``: ``-n 2``) the controller, which outlives its workers, starts the long
    jobs once: when the first worker has collected, for the modules among its test ids that define
    ``start_in_background(config, root)``; the worker that runs a module's tests finds its job under ``root``."""
    import importlib
    from pathlib import Path

    config = node.config
    if config.option.collectonly or config.stash.get(_STARTED, False):
        return
    config.stash[_STARTED] = True
    here = Path(config.rootpath)
    for path in sorted({i.split("::")[0] for i in ids}):
        if path.endswith(".py") and "def start_in_background(" in (here / path).read_text():
            mod = importlib.import_module(path[:-3].replace("/", "."))
            mod.start_in_background(config, mod.job_root(node.workerinput["testrunuid"]))


def cascade_here(*args, cwd=None):
    """``cascade ARGS`` run in this process -> a CompletedProcess (returncode, stdout, stderr): for the
    calls that refuse a config or only print it, the code of the ``cascade`` entry point without a new
    interpreter and torch import (~2.7 CPU-s) per call. What ``cascade run`` sets for its own process
    before it refuses (torch's threads, environment variables) and the working directory are restored."""
    import contextlib
    import io
    import subprocess

    from cascade.cli import main

    env, threads, here = dict(os.environ), torch.get_num_threads(), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["cascade", *args], rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny-moe checkpoint written by ``cascade init-model`` (model + tokenizer)."""
    from train.presets import init_model

    out = tmp_path_factory.mktemp("tiny-moe")
    init_model("tiny-moe", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory):
    from train.presets import init_model

    out = tmp_path_factory.mktemp("tiny-dense")
    init_model("tiny-dense", out, seed=0)
    return out


@pytest.fixture(scope="session")
def warm(tmp_path_factory):
    """The SFT-warmed tiny dense policy of tests/test_rl_loop.py, computed once for every module that
    trains from it."""
    from tests.test_rl_loop import warm_start

    return warm_start(tmp_path_factory)


def hf_random_model(kind: str, seed: int = 0, **kw):
    """A tiny random Qwen3 / Qwen3-MoE model made with transformers, weights spread out so that
    attention and routing are far from uniform."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    common.update(kw)
    if kind == "moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                                   num_experts_per_tok=2, norm_topk_prob=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=96, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


def wait_until(done, timeout: float, every: float = 0.1) -> None:
    """Call ``done()`` every ``every`` seconds until it is true or ``timeout`` seconds have passed."""
    import time

    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(every)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is dead)."""
    from train.rl.worker import proc_stat

    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def pids_of_uid(uid: int) -> list[int]:
    """Processes running as ``uid`` (the sandbox's own uid in the sandbox tests)."""
    from pathlib import Path

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                owner = Path(f"/proc/{d}/status").read_text().split("\nUid:")[1].split()[0]
            except (OSError, IndexError):
                continue
            if owner == str(uid):
                out.append(int(d))
    return out


def assert_no_processes_of(uid: int, wait_s: float = 5.0) -> None:
    """After a sandboxed run: nothing of ``uid`` outlives it (given ``wait_s`` to be reaped: a killed
    process may take a moment to vanish on a loaded machine)."""
    from pathlib import Path

    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            return "?"

    wait_until(lambda: not pids_of_uid(uid), wait_s, every=0.05)
    left = {p: cmdline(p) for p in pids_of_uid(uid)}
    assert left == {}, f"a sandboxed process outlived its run: {left}"
