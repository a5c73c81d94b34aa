"""The ``ttc`` command: ``ttc solve`` (Markovian RSA on one problem or a data file, over a local
checkpoint or an OpenAI-compatible server) and ``ttc serve`` (an OpenAI-compatible server over a
checkpoint). Input errors print one line on stderr and exit with status 2."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from ttc.rsa import VARIANTS, RSAConfig, config_dict

USAGE = """usage: ttc COMMAND [ARGS]

commands:
  solve   Markovian RSA on a problem (--problem) or a data file (--data), with metrics
  serve   serve a checkpoint over an OpenAI-compatible HTTP API

`ttc COMMAND --help` for details."""


def _solve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ttc solve", description="Markovian RSA with AIME/HMMT-style evaluation.")
    g = ap.add_argument_group("algorithm")
    g.add_argument("--rounds", type=int, default=2, help="T, aggregation rounds after round 0 (0: parallel sampling)")
    g.add_argument("--tail", type=int, default=4096, help="tau, tokens of each trace forwarded")
    g.add_argument("--population", type=int, default=16, help="N")
    g.add_argument("--aggregate", type=int, default=4, help="C, tails per aggregation prompt")
    g.add_argument("--budget", type=int, default=40000, help="beta, max tokens per candidate per round")
    g.add_argument("--final-budget", type=int, default=None,
                   help="tokens to finish a final trace cut at beta (default beta; 0: off)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--template", default="math", help="math | code | generic | PATH (YAML/JSON overrides)")
    g.add_argument("--variant", default="rsa", choices=VARIANTS)
    g.add_argument("--grader", default=None, choices=["math", "exact"],
                   help="answer equivalence (default: math for the math template, else exact)")
    d = ap.add_argument_group("problems")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--problem", help="one problem text")
    src.add_argument("--data", help="jsonl/json/parquet with columns problem and answer")
    d.add_argument("--answer", default=None, help="gold answer for --problem")
    d.add_argument("--limit", type=int, default=None, help="only the first N problems of --data")
    m = ap.add_argument_group("model")
    m.add_argument("--model", help="checkpoint directory, or the served model name with --base-url")
    m.add_argument("--base-url", help="an OpenAI-compatible server (API key from OPENAI_API_KEY or CASCADE_API_KEY)")
    m.add_argument("--tokenizer",
                   help="tokenizer directory for cutting tails with --base-url (default: the server's /tokenize)")
    m.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    m.add_argument("--device", default=None)
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--no-prefix-cache", action="store_true", help="torch engine: turn shared-prefix KV reuse off")
    m.add_argument("--threads", type=int, default=None, help="torch engine: CPU threads (torch.set_num_threads)")
    m.add_argument("--concurrency", type=int, default=16, help="parallel requests to the server")
    m.add_argument("--retries", type=int, default=5, help="retries of a failed request (5xx, 429, connection)")
    m.add_argument("--request-timeout", type=float, default=3600.0)
    o = ap.add_argument_group("output")
    o.add_argument("--out", help="results jsonl: one line per problem, then a summary line")
    o.add_argument("--resume", action="store_true", help="skip problems already in --out")
    o.add_argument("--no-progress", action="store_true")
    return ap


def build_backend(a):
    if a.base_url:
        from ttc.backends import OpenAIBackend

        return OpenAIBackend(a.base_url, model=a.model, tokenizer=a.tokenizer, concurrency=a.concurrency,
                             retries=a.retries, timeout=a.request_timeout)
    if not a.model:
        raise ValueError("give --model PATH (a checkpoint) or --base-url URL")
    if not Path(a.model).is_dir():
        raise FileNotFoundError(f"checkpoint directory {a.model!r} not found")
    if a.engine == "vllm":
        from ttc.backends import vllm_backend

        return vllm_backend(a.model)
    from ttc.backends import torch_backend

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    return torch_backend(a.model, device=a.device, dtype=a.dtype, prefix_cache=not a.no_prefix_cache)


def load_problems(a) -> list[dict]:
    if a.problem is not None:
        if not a.problem.strip():
            raise ValueError("--problem is empty")
        return [{"problem": a.problem, "answer": a.answer}]
    from envs.math import load_math_rows

    rows = [{"problem": r["problem"], "answer": r["answer"]} for r in load_math_rows(a.data)]
    return rows[:a.limit] if a.limit is not None else rows


def run_key(cfg: RSAConfig, template: str, grader) -> str:
    blob = json.dumps({"config": config_dict(cfg), "template": template, "grader": grader}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _problem_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_results(path: Path, key: str) -> list[dict]:
    """Problem records already in a results file (for --resume); one-line errors on a mismatch."""
    done = []
    for ln, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{ln} is not JSON; cannot resume from it") from None
        if rec.get("type") != "problem":
            continue
        if rec.get("run_key") != key:
            raise ValueError(f"{path} was written with different settings (run key {rec.get('run_key')} != {key}); "
                             f"use another --out or drop --resume")
        done.append(rec)
    return done


def summarize(records: list[dict], cfg: RSAConfig, key: str) -> dict:
    def avg(name):
        xs = [r[name] for r in records if r.get(name) is not None]
        return sum(xs) / len(xs) if xs else None

    rounds = [r["round_accuracy"] for r in records if r.get("round_accuracy")]
    per_round = [sum(x[t] for x in rounds) / len(rounds) for t in range(len(rounds[0]))] if rounds else None
    return {"type": "summary", "problems": len(records), "mean_accuracy": avg("mean_accuracy"),
            "round_accuracy": per_round, "majority_accuracy": avg("majority_accuracy"), "pass_at_n": avg("pass_at_n"),
            "generated_tokens": sum(r["generated_tokens"] for r in records),
            "prefill_tokens": sum(r["prefill_tokens"] for r in records),
            "wall_s": sum(r["wall_s"] for r in records), "run_key": key, "config": config_dict(cfg)}


def _progress(disable: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]RSA[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), disable=disable)


def solve_main(argv: list[str]) -> int:
    a = _solve_parser().parse_args(argv)
    cfg = RSAConfig(population=a.population, aggregate=a.aggregate, rounds=a.rounds, budget=a.budget, tail=a.tail,
                    final_budget=a.final_budget, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                    min_p=a.min_p, seed=a.seed, variant=a.variant).resolved()
    from ttc.templates import load_template

    template = load_template(a.template)
    if a.resume and not a.out:
        raise ValueError("--resume needs --out (the results file to resume from)")
    problems = load_problems(a)
    key = run_key(cfg, template.name, a.grader)
    out = Path(a.out) if a.out else None
    records: list[dict] = []
    if out is not None and a.resume and out.exists():
        records = read_results(out, key)
    done = {(r["index"], r["problem_key"]) for r in records}
    todo = [(i, p) for i, p in enumerate(problems) if (i, _problem_key(p["problem"])) not in done]

    from ttc.rsa import MarkovianRSA

    backend = build_backend(a)
    rsa = MarkovianRSA(backend, cfg, template, a.grader)
    fh = None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))  # earlier problems, without the old summary
        os.replace(tmp, out)
        fh = out.open("a")
    try:
        with _progress(a.no_progress or len(problems) < 2) as prog:
            task = prog.add_task("", total=len(problems), completed=len(problems) - len(todo))
            for i, p in todo:
                res = rsa.run(p["problem"], p.get("answer"))
                rec = {"type": "problem", "index": i, "problem_key": _problem_key(p["problem"]), "run_key": key,
                       "problem": p["problem"], "answer": p.get("answer"), **res.metrics}
                records.append(rec)
                if fh is not None:
                    fh.write(json.dumps(rec) + "\n")
                    fh.flush()
                acc = [r["mean_accuracy"] for r in records if r["mean_accuracy"] is not None]
                prog.update(task, advance=1, description=f"mean acc {sum(acc) / len(acc):.3f}" if acc else "")
        records.sort(key=lambda r: r["index"])
        summary = summarize(records, cfg, key)
        if fh is not None:
            fh.write(json.dumps(summary) + "\n")
    finally:
        if fh is not None:
            fh.close()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if a.problem is not None:
        print(json.dumps({k: v for k, v in records[0].items() if k not in ("type", "problem_key", "run_key")}))
    print(json.dumps(summary))
    return 0


def serve_main(argv: list[str]) -> int:
    from train.engine.server import main as serve

    return serve(argv)


COMMANDS = {"solve": solve_main, "serve": serve_main}


def main(argv: list[str] | None = None) -> int:
    from ttc.backends import ServerError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ttc: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return int(COMMANDS[name](rest) or 0)
    except (ValueError, KeyError, FileNotFoundError, NotADirectoryError, ServerError, ConnectionError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ttc {name}: error: {str(msg).splitlines()[0] if str(msg) else type(e).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
