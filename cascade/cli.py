"""The ``cascade`` command. Each subcommand lives with the part it drives and is imported lazily,
so ``cascade envs list`` never pays for importing torch."""
from __future__ import annotations

import importlib
import os
import sys

from train.errors import RunFailure, Terminated, sigterm_interrupts

# name -> ("module:function", one-line help). Each function takes argv (list[str]) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("cascade.run:main", "run one stage (stage=NAME) or the whole cascade, with key=value overrides"),
    "eval": ("cascade.evaluation:main", "score a checkpoint on a stage's held-out problems as `run` scores them"),
    "report": ("cascade.report:main", "summarise a run directory and plot its metrics"),
    "init-model": ("train.model.cli:init_model_main", "write a tiny policy checkpoint from a preset"),
    "generate": ("train.model.cli:generate_main", "sample from a checkpoint with the torch engine"),
    "envs": ("envs.cli:main", "list, show and self-check environments"),
    "sandbox": ("envs.code.cli:main", "run or judge a program in the code sandbox"),
    "serve": ("train.engine.server:main", "serve a checkpoint over an OpenAI-compatible HTTP API"),
    "calc": ("train.parallel.calc:main", "memory/communication of TSP/TP/SP/DP; `calc rollout`: rollout:trainer sizing"),
}

# Errors that are the user's to fix: printed as one line, exit code 2 (CASCADE_DEBUG=1 shows the traceback).
RESUME_HINT = "; the same command resumes from the last complete checkpoint"
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
               PermissionError, TypeError, ConnectionError)


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {k.ljust(width)}  {h}" for k, (_, h) in SUBCOMMANDS.items())
    return f"usage: cascade COMMAND [ARGS]\n\ncommands:\n{rows}\n\n`cascade COMMAND --help` for details."


def dispatch(table: dict[str, tuple[str, str]], argv: list[str], usage: str, prog: str) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown command {name!r}; choose from {', '.join(table)}", file=sys.stderr)
        return 2
    mod, _, fn = table[name][0].partition(":")
    func = getattr(importlib.import_module(mod), fn)
    # `run`: SIGTERM unwinds like Ctrl-C (finally blocks stop servers and ranks) instead of ending at once
    with sigterm_interrupts(name == "run"):
        try:
            return int(func(rest) or 0)
        except BrokenPipeError:  # output piped into `head` and the like, which stopped reading: end quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except USER_ERRORS as e:
            if os.environ.get("CASCADE_DEBUG"):
                raise
            msg = e.args[0] if isinstance(e, KeyError) and e.args else e
            print(f"{prog} {name}: error: {msg}", file=sys.stderr)
            return 2
        except RunFailure as e:  # a server or the trainer ranks went away: what and where to look, no traceback
            if os.environ.get("CASCADE_DEBUG"):
                raise
            print(f"{prog} {name}: failed: {e}" + (RESUME_HINT if name == "run" else ""), file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:  # the run's finally blocks have stopped its servers and ranks by now
            term = isinstance(e, Terminated)
            print(f"{prog} {name}: " + ("terminated (SIGTERM)" if term else "interrupted")
                  + (RESUME_HINT if name == "run" else ""), file=sys.stderr)
            return 143 if term else 130


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command: problems generated the same in every run (envs.base.fixed_hash_seed)
        from envs.base import fixed_hash_seed

        fixed_hash_seed()
    return dispatch(SUBCOMMANDS, list(sys.argv[1:] if argv is None else argv), _usage(), "cascade")


if __name__ == "__main__":
    sys.exit(main())
