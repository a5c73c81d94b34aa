"""The ``cascade`` command's dispatch: help, unknown commands, exit codes and one-line errors."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _returns_3(argv):
    return 3


def _key_error(argv):
    raise KeyError("no stage named 'x'")


def _connection_error(argv):
    raise ConnectionError("cannot reach rollout server http://127.0.0.1:9")


def _run_failure(argv):
    from train.errors import RunFailure

    raise RunFailure("the trainer ranks exited")


def _terminated(argv):
    from train.errors import Terminated

    raise Terminated


def _broken_pipe(argv):
    raise BrokenPipeError


def _sigterm_self(argv):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return 0


TABLE = {n: (f"tests.test_cli_dispatch:{f}", "") for n, f in
         [("three", "_returns_3"), ("key", "_key_error"), ("conn", "_connection_error"), ("fail", "_run_failure"),
          ("term", "_terminated"), ("pipe", "_broken_pipe")]}


def test_help_and_unknown_commands(capsys):
    from cascade.cli import _usage, dispatch

    for argv in ([], ["-h"], ["--help"], ["help"]):
        assert dispatch(TABLE, argv, "USAGE", "cascade") == 0
        assert capsys.readouterr().out == "USAGE\n"
    assert dispatch(TABLE, ["nope"], "USAGE", "cascade") == 2
    err = capsys.readouterr().err
    assert err.startswith("cascade: unknown command 'nope'; choose from three, key") and err.count("\n") == 1
    # the help column starts at the same place on every line
    rows = [ln for ln in _usage().splitlines() if ln.startswith("  ")]
    starts = {re.match(r"  \S+ +", ln).end() for ln in rows}
    assert len(starts) == 1 and "init-model  write a tiny" in _usage()


def test_exit_codes_and_one_line_errors(capsys, monkeypatch):
    from cascade.cli import dispatch

    monkeypatch.delenv("CASCADE_DEBUG", raising=False)
    assert dispatch(TABLE, ["three"], "", "cascade") == 3  # the subcommand's own exit code
    assert dispatch(TABLE, ["key"], "", "cascade") == 2
    assert capsys.readouterr().err == "cascade key: error: no stage named 'x'\n"  # the message, not its repr
    assert dispatch(TABLE, ["conn"], "", "cascade") == 2
    assert capsys.readouterr().err == "cascade conn: error: cannot reach rollout server http://127.0.0.1:9\n"
    # only `run` resumes from a checkpoint: other commands do not say so
    assert dispatch(TABLE, ["fail"], "", "cascade") == 1
    assert capsys.readouterr().err == "cascade fail: failed: the trainer ranks exited\n"
    assert dispatch(TABLE, ["term"], "", "cascade") == 143
    assert capsys.readouterr().err == "cascade term: terminated (SIGTERM)\n"
    monkeypatch.setenv("CASCADE_DEBUG", "1")
    from train.errors import RunFailure

    with pytest.raises(RunFailure, match="the trainer ranks exited"):
        dispatch(TABLE, ["fail"], "", "cascade")


def _child(code):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k not in ("CASCADE_DEBUG", "PYTHONHASHSEED")})


def test_output_closed_by_its_reader_ends_quietly():
    r = _child("from cascade.cli import dispatch\nfrom tests.test_cli_dispatch import TABLE\n"
               "import sys\nsys.exit(dispatch(TABLE, ['pipe'], '', 'cascade'))")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_sigterm_during_run_unwinds_as_terminated():
    """`cascade run` killed with SIGTERM unwinds (its finally blocks stop servers and ranks) and exits 143."""
    r = _child("from cascade.cli import dispatch\nimport sys\n"
               "sys.exit(dispatch({'run': ('tests.test_cli_dispatch:_sigterm_self', '')}, ['run'], '', 'cascade'))")
    assert r.returncode == 143, (r.returncode, r.stderr)
    assert r.stderr.startswith("cascade run: terminated (SIGTERM); the same command resumes")


def test_the_command_runs_with_a_fixed_hash_seed():
    r = _child("import os, sys\nsys.argv = ['cascade', '--help']\nfrom cascade.cli import main\nmain()\n"
               "print('seed', os.environ.get('PYTHONHASHSEED'))")
    assert r.returncode == 0 and "seed 0" in r.stdout, (r.stdout, r.stderr)
