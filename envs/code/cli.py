"""``cascade sandbox``: run or judge a Python or C++ program in the code sandbox; prints one JSON verdict.

    cascade sandbox run PROGRAM.py|PROGRAM.cpp [--stdin FILE] [--time-limit S] [--memory-mb M]
                        [--language python|cpp] [--compile-time-limit S] [--allow-weaker]
    cascade sandbox judge PROGRAM.py|PROGRAM.cpp --tests FILE.jsonl [--time-limit S] [--memory-mb M]
                          [--float-tol X] [--stop-on-failure] [--allow-weaker]
    cascade sandbox layers

The language is read from the file's extension (.cpp/.cc/.cxx: C++, compiled by g++ inside the
sandbox) unless ``--language`` says it. Exit code 0 whenever a verdict was produced (whatever the
verdict says, compile_error included).
"""
from __future__ import annotations

import argparse
import json
import sys

from envs.code.judge import Judge, load_tests
from envs.code.sandbox import Sandbox, SandboxConfig, SandboxError, detect_layers, language_of


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} not found") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path!r} is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _config(a) -> SandboxConfig:
    kw = {"allow_weaker": a.allow_weaker, "warm": 0}  # one judgement per process: nothing to start ahead
    if a.time_limit is not None:
        kw["time_limit"] = a.time_limit
    if a.memory_mb is not None:
        kw["memory_mb"] = a.memory_mb
    if a.compile_time_limit is not None:
        kw["compile_time_limit"] = a.compile_time_limit
    return SandboxConfig(**kw)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cascade sandbox", description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,judge,layers}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--time-limit", type=float, default=None, help="wall seconds per run (default 5)")
    common.add_argument("--memory-mb", type=int, default=None, help="memory per run in MiB (default 512)")
    common.add_argument("--allow-weaker", action="store_true", help="run even if isolation layers are missing")
    common.add_argument("--language", choices=("python", "cpp"), default=None,
                        help="the program's language (default: from its extension; .cpp/.cc/.cxx: cpp)")
    common.add_argument("--compile-time-limit", type=float, default=None,
                        help="C++: wall seconds for the compile (default 20)")
    r = sub.add_parser("run", parents=[common], help="run a program once")
    r.add_argument("program")
    r.add_argument("--stdin", default=None, help="file fed to the program's standard input")
    j = sub.add_parser("judge", parents=[common], help="judge a program against tests")
    j.add_argument("program")
    j.add_argument("--tests", required=True, help="JSONL: {input, output} | {fn, args, expected} | {code}")
    j.add_argument("--float-tol", type=float, default=None)
    j.add_argument("--stop-on-failure", action="store_true")
    sub.add_parser("layers", help="which isolation layers this machine has")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.cmd == "layers":
        layers = detect_layers()
        print(json.dumps({"layers": {k: v is None for k, v in layers.items()},
                          "missing": {k: v for k, v in layers.items() if v is not None}}))
        return 0
    program = _read(a.program, "program")
    language = a.language or language_of(a.program)
    sb = Sandbox(_config(a))
    try:
        if a.cmd == "run":
            data = _read(a.stdin, "stdin file") if a.stdin else ""
            out = sb.run(program, data, language=language).to_dict()
        else:
            tests = load_tests(a.tests)
            j = Judge(sb, float_tol=a.float_tol)
            out = j.judge(program, tests, stop_on_failure=a.stop_on_failure, language=language).to_dict()
    except SandboxError as e:
        raise ValueError(str(e)) from None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
