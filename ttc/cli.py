"""The ``ttc`` command: ``ttc solve`` (Markovian RSA on one problem or a data file, over a local
checkpoint or an OpenAI-compatible server) and ``ttc serve`` (an OpenAI-compatible server over a
checkpoint). Input errors print one line on stderr and exit with status 2; a run in which some
problems failed (recorded in --out with their error) exits with status 1."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ttc.rsa import VARIANTS, RSAConfig, config_dict

USAGE = """usage: ttc COMMAND [ARGS]

commands:
  solve   Markovian RSA on a problem (--problem) or a data file (--data), with metrics
  serve   serve a checkpoint over an OpenAI-compatible HTTP API

`ttc COMMAND --help` for details."""


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default, unless it has none or its help already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        if not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and "default" not in h:
            h += (" " if h else "") + "(default: %(default)s)"
        return h


def _solve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ttc solve", description="Markovian RSA with AIME/HMMT-style evaluation.",
                                 formatter_class=_Help)
    g = ap.add_argument_group("algorithm")
    g.add_argument("--rounds", type=int, default=2, help="T, aggregation rounds after round 0 (0: parallel sampling)")
    g.add_argument("--tail", type=int, default=4096, help="tau, tokens of each trace forwarded")
    g.add_argument("--population", type=int, default=16, help="N")
    g.add_argument("--aggregate", type=int, default=4, help="C, tails per aggregation prompt")
    g.add_argument("--budget", type=int, default=40000, help="beta, max tokens per candidate per round")
    g.add_argument("--final-budget", type=int, default=None,
                   help="tokens to finish a final trace cut at beta (default beta; 0: off)")
    g.add_argument("--anchor", type=int, default=0,
                   help="delethink: tokens kept from the start of each chain in every later chunk")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's: logits of tokens in the prompt or output divided (if > 0) or multiplied by it (1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token already generated, in [-2, 2] (0: off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of a token already generated, in [-2, 2] (0: off)")
    g.add_argument("--seed", type=int, default=0, help="seeds every subset and sample (per problem)")
    g.add_argument("--template", default="math", help="math | code | generic | PATH (YAML/JSON overrides)")
    g.add_argument("--variant", default="rsa", choices=VARIANTS,
                   help="rsa (tails), full (whole traces), delethink (chunked chains), pacore (a finished "
                   "candidate forwards its answer)")
    g.add_argument("--grader", default=None, choices=["math", "exact"],
                   help="answer equivalence (default: math for the math template, else exact)")
    g.add_argument("--context", type=int, default=None,
                   help="the model's context in tokens (default: the checkpoint's, or the server's max_model_len)")
    g.add_argument("--clamp", action="store_true",
                   help="lower the budgets to fit the context instead of refusing the run (the final-answer "
                        "continuation keeps up to a quarter of what the solve prompt leaves)")
    d = ap.add_argument_group("problems")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--problem", help="one problem text")
    src.add_argument("--data", help="a jsonl/json/parquet/csv file, a dataset directory or a Hugging Face dataset "
                                    "org/name[@rev] (HF cache, HF_HUB_OFFLINE)")
    d.add_argument("--split", default="train", help="dataset split for a Hugging Face name or dataset directory")
    d.add_argument("--subset", default=None, help="dataset configuration (subset) of a Hugging Face name")
    d.add_argument("--column", default=None,
                   help="column mapping, e.g. problem=question,answer=solution (default: problem, answer)")
    d.add_argument("--answer", default=None, help="gold answer for --problem")
    d.add_argument("--limit", type=int, default=None, help="only the first N problems of --data")
    m = ap.add_argument_group("model")
    m.add_argument("--model", help="checkpoint directory or Hugging Face id org/name[@rev] (HF cache, HF_HUB_OFFLINE), "
                                   "or the served model name with --base-url")
    m.add_argument("--base-url", help="an OpenAI-compatible server (API key: --api-key, else CASCADE_API_KEY, "
                                      "else OPENAI_API_KEY)")
    m.add_argument("--api-key", default=None, help="the server's API key (default: $CASCADE_API_KEY, else "
                                                  "$OPENAI_API_KEY)")
    m.add_argument("--api", default="completions", choices=["completions", "chat"],
                   help="--base-url endpoint: token-id /v1/completions, or /v1/chat/completions (needs --tokenizer; "
                   "token counts are then the local tokenizer's, the server's in usage)")
    m.add_argument("--tokenizer",
                   help="tokenizer directory or Hub id for cutting tails with --base-url (default: the server's /tokenize)")
    m.add_argument("--engine", default="torch", choices=["torch", "vllm"], help="local engine for --model")
    m.add_argument("--device", default=None, help="torch engine: cpu, cuda, cuda:1, ... (default: cuda if any)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="torch engine: weights and activations")
    m.add_argument("--no-prefix-cache", action="store_true", help="torch engine: turn shared-prefix KV reuse off")
    m.add_argument("--threads", type=int, default=None, help="torch engine: CPU threads (torch.set_num_threads)")
    r = ap.add_argument_group("requests (--base-url)")
    r.add_argument("--concurrency", type=int, default=16,
                   help="requests in flight at most, over all problems")
    r.add_argument("--problems-in-flight", type=int, default=None,
                   help="problems run at once (default: --concurrency with --base-url, 1 on a local engine, "
                        "where the rounds of problems in flight run as one batched engine call)")
    r.add_argument("--max-tokens-in-flight", type=int, default=None,
                   help="cap on prompt + max_tokens of the requests in flight")
    r.add_argument("--rpm", type=float, default=None, help="requests per minute at most (retries count)")
    r.add_argument("--tpm", type=float, default=None, help="tokens (prompt + max_tokens) per minute at most")
    r.add_argument("--max-n", type=int, default=None, help="split n into requests of at most this many samples")
    r.add_argument("--retries", type=int, default=8, help="retries of a failed request (5xx, 429, connection)")
    r.add_argument("--backoff", type=float, default=0.5,
                   help="first retry waits up to this many seconds (full jitter, doubling, at most 60 s)")
    r.add_argument("--retry-horizon", type=float, default=900.0, help="seconds a request may keep retrying after its first failure")
    r.add_argument("--request-timeout", type=float, default=3600.0, help="seconds to wait for one response")
    o = ap.add_argument_group("output")
    o.add_argument("--out", help="results jsonl: one line per problem, then a summary line "
                                 "(rounds are checkpointed in OUT.rounds.jsonl while the run goes)")
    o.add_argument("--resume", action="store_true", help="skip problems already in --out, resume rounds in progress")
    o.add_argument("--save-traces", help="jsonl of every round: populations, prompts, tails (token ids and text); "
                   "a fresh run replaces it, --resume appends")
    o.add_argument("--price-in", type=float, default=None, help="price per 1M prompt tokens (cost from usage)")
    o.add_argument("--price-out", type=float, default=None, help="price per 1M completion tokens")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def build_backend(a):
    if a.base_url:
        from ttc.backends import ChatBackend, OpenAIBackend

        cls = ChatBackend if a.api == "chat" else OpenAIBackend
        return cls(a.base_url, model=a.model, tokenizer=a.tokenizer, api_key=getattr(a, "api_key", None),
                   concurrency=a.concurrency,
                   retries=a.retries, backoff=a.backoff, timeout=a.request_timeout, horizon=a.retry_horizon, max_n=a.max_n,
                   rpm=a.rpm, tpm=a.tpm, max_tokens_in_flight=a.max_tokens_in_flight)
    if not a.model:
        raise ValueError("give --model PATH (a checkpoint) or --base-url URL")
    from envs.hub import resolve_model

    a.model = str(resolve_model(a.model))  # a local directory wins; else a Hub id through the HF cache
    if not Path(a.model).is_dir():
        raise FileNotFoundError(f"checkpoint directory {a.model!r} not found")
    if a.engine == "vllm":
        from ttc.backends import vllm_backend

        return vllm_backend(a.model)
    from ttc.backends import torch_backend

    # the engine runs on a thread of its own with --threads (torch's default count without it) and this one on one
    return torch_backend(a.model, device=a.device, dtype=a.dtype, prefix_cache=not a.no_prefix_cache,
                         threads=a.threads)


def parse_columns(spec: str | None) -> dict[str, str]:
    from envs.hub import parse_columns as parse

    return parse(spec, ("problem", "answer"), flag="--column")


def load_problems(a, limit: bool = True) -> list[dict]:
    from envs.hub import answer_text, load_rows

    if a.problem is not None:
        if not a.problem.strip():
            raise ValueError("--problem is empty")
        return [{"problem": a.problem, "answer": answer_text(a.answer)}]  # --answer "": ungraded, as an empty cell

    cols = parse_columns(a.column)
    need = ["problem"] + (["answer"] if cols["answer"] != "answer" else [])  # answer is optional unless mapped
    rows = load_rows(a.data, need, [k for k in ("answer",) if k not in need], cols,
                     split=a.split, subset=a.subset, what="--data", hint="--column ")
    rows = rows[:a.limit] if limit and a.limit is not None else rows
    for i, r in enumerate(rows):
        q = r["problem"]
        if q is None or isinstance(q, (list, dict)) or not str(q).strip():
            raise ValueError(f"--data {a.data!r}: row {i}'s problem is {q!r}; every row needs a problem text")
    if limit and all(r["answer"] is None for r in rows):
        print(f"ttc solve: --data {a.data!r} has no answers: the problems are solved but not graded "
              "(map one with --column answer=COLUMN)", file=sys.stderr)
    return [{"problem": str(r["problem"]), "answer": answer_text(r["answer"])} for r in rows]


def run_key(cfg: RSAConfig, template, grader, model: dict | None = None, extra: dict | None = None) -> str:
    """A hash of everything that decides a problem's result: the config, the template's content,
    the grader, the model (path/config or URL/name) and the plan settings. A template file counts by
    its content (its texts and base), not by the path it was given as (``t.yaml`` and ``/abs/t.yaml``
    resume each other), and the grader by the one the run uses (``--grader math`` with the math
    template is the default)."""
    from dataclasses import asdict, is_dataclass

    from ttc.rsa import grader_name

    tmpl = asdict(template) if is_dataclass(template) else template
    if is_dataclass(template) and not callable(grader):
        grader = grader_name(template, grader)
    if isinstance(tmpl, dict):
        if not tmpl.get("base"):
            tmpl.pop("base", None)  # a built-in: the key it always had
        else:
            tmpl.pop("name", None)  # a file: its path as typed
    blob = json.dumps({"config": config_dict(cfg), "template": tmpl, "grader": grader, "model": model,
                       "extra": extra}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _problem_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _problem_keys(texts: list[str]) -> list[str]:
    """Each problem's key (what seeds its draws and ties a result to it): a hash of its text, with ``#n`` for the
    n-th repeat of a text, so that a dataset that lists a problem k times (avg@k) samples it k times apart."""
    seen: dict[str, int] = {}
    out = []
    for t in texts:
        k = _problem_key(t)
        n = seen.get(k, 0)
        seen[k] = n + 1
        out.append(k if n == 0 else f"{k}#{n}")
    return out


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    out = []
    lines = path.read_text().splitlines()
    for ln, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((ln, json.loads(line)))
        except json.JSONDecodeError:
            if ln == len(lines):  # a last line cut by a kill: dropped
                continue
            raise ValueError(f"{path}:{ln} is not JSON; cannot resume from it") from None
    return out


def read_results(path: Path, key: str) -> list[dict]:
    """Problem records already in a results file (for --resume); one-line errors on a mismatch.
    Problems recorded as failed are not kept (a resumed run tries them again)."""
    done = []
    for _, rec in _read_jsonl(path):
        if rec.get("type") != "problem":
            continue
        if rec.get("run_key") != key:
            raise ValueError(f"{path} was written with different settings (run key {rec.get('run_key')} != {key}); "
                             f"use another --out or drop --resume")
        if rec.get("status", "ok") == "ok":
            done.append(rec)
    return done


def read_checkpoints(path: Path, key: str) -> dict[tuple[int, str], list[dict]]:
    """Round records of problems in progress: {(index, problem_key): [round 0, 1, ..., k]}."""
    by: dict[tuple[int, str], dict[int, dict]] = {}
    for _, rec in _read_jsonl(path):
        if rec.get("run_key") != key:
            raise ValueError(f"{path} was written with different settings (run key {rec.get('run_key')} != {key}); "
                             f"use another --out or drop --resume")
        by.setdefault((rec["index"], rec["problem_key"]), {})[rec["round"]] = rec["record"]
    out = {}
    for k, rounds in by.items():
        seq = []
        while len(seq) in rounds:
            seq.append(rounds[len(seq)])
        out[k] = seq
    return out


def cost(usage: dict | None, price_in: float | None, price_out: float | None) -> float | None:
    """``usage`` priced per 1M prompt and completion tokens; None without prices, or where the server reported no
    token counts (a request count alone is not a free run)."""
    if not usage or (price_in is None and price_out is None) or not {"prompt_tokens", "completion_tokens"} & set(usage):
        return None
    return (usage.get("prompt_tokens", 0) * (price_in or 0.0) + usage.get("completion_tokens", 0) * (price_out or 0.0)) / 1e6


def summarize(records: list[dict], cfg: RSAConfig, key: str, extra: dict | None = None,
              prices: tuple[float | None, float | None] = (None, None)) -> dict:
    """The run's summary; ``usage`` sums every problem's, failed ones' too (their requests were served),
    and ``cost`` prices it at ``prices`` (per 1M prompt and completion tokens: this run's, for the problems of
    a resumed run as well)."""
    ok = [r for r in records if r.get("status", "ok") == "ok"]

    def avg(name):
        xs = [r[name] for r in ok if r.get(name) is not None]
        return sum(xs) / len(xs) if xs else None

    def per_round(name):
        rows = [r[name] for r in ok if r.get(name)]
        return [sum(x[t] for x in rows) / len(rows) for t in range(len(rows[0]))] if rows else None

    passk = [r["pass_at_k"] for r in ok if r.get("pass_at_k")]
    usage: dict = {}
    for r in records:
        for k, v in (r.get("usage") or {}).items():
            usage[k] = usage.get(k, 0) + v
    out = {"type": "summary", "problems": len(records), "failed": len(records) - len(ok),
           "failed_indices": [r["index"] for r in records if r not in ok],
           "mean_accuracy": avg("mean_accuracy"), "round_accuracy": per_round("round_accuracy"),
           "majority_accuracy": avg("majority_accuracy"), "round_majority_accuracy": per_round("round_majority_accuracy"),
           "pass_at_n": avg("pass_at_n"),
           "pass_at_k": {k: sum(p[k] for p in passk) / len(passk) for k in passk[0]} if passk else None,
           "generated_tokens": sum(r["generated_tokens"] for r in ok),
           "prefill_tokens": sum(r["prefill_tokens"] for r in ok), "usage": usage or None,
           "cost": cost(usage, *prices),
           "problem_wall_s": sum(r["wall_s"] for r in ok), "run_key": key, "config": config_dict(cfg)}
    if extra:
        out.update(extra)
    return out


def _progress(disable: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return Progress(TextColumn("[bold]RSA[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), disable=disable)


def _drop_cut_line(path: Path) -> None:
    """Cut ``path`` back to its last line end: a last line a kill cut short (readers drop it) would
    otherwise run into the first line appended after it, leaving a line no reader can parse."""
    with path.open("rb+") as fh:
        end = pos = fh.seek(0, os.SEEK_END)
        while pos > 0:
            step = min(1 << 16, pos)
            fh.seek(pos - step)
            i = fh.read(step).rfind(b"\n")
            if i >= 0:
                if pos - step + i + 1 < end:
                    fh.truncate(pos - step + i + 1)
                return
            pos -= step
        fh.truncate(0)


class _Writer:
    """Appends JSON lines from several threads, flushed (and fsynced) line by line (after a line a kill
    cut short, if the file ends in one, is dropped)."""

    def __init__(self, path: Path | None):
        if path is not None and path.exists():
            _drop_cut_line(path)
        self.fh = path.open("a") if path is not None else None
        self.lock = threading.Lock()

    def write(self, obj: dict) -> None:
        if self.fh is None:
            return
        line = json.dumps(obj) + "\n"
        with self.lock:
            self.fh.write(line)
            self.fh.flush()
            os.fsync(self.fh.fileno())

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def solve_main(argv: list[str]) -> int:
    started = time.perf_counter()
    a = _solve_parser().parse_args(argv)
    try:
        cfg = RSAConfig(population=a.population, aggregate=a.aggregate, rounds=a.rounds, budget=a.budget,
                        tail=a.tail, final_budget=a.final_budget, temperature=a.temperature, top_p=a.top_p,
                        top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty, seed=a.seed,
                        variant=a.variant, anchor=a.anchor).resolved()
    except ValueError as e:  # the config's field named as the option that sets it ("--rounds must be >= 0")
        option = re.sub(r"^(?:SamplingParams\.)?([a-z_]+)(?= must )", lambda m: "--" + m[1].replace("_", "-"), str(e))
        raise ValueError(option) from None
    from ttc.templates import load_template

    template = load_template(a.template)
    if a.resume and not a.out:
        raise ValueError("--resume needs --out (the results file to resume from)")
    for names, low, strict in ((("concurrency", "problems_in_flight", "max_n", "context", "limit", "threads",
                                 "max_tokens_in_flight"), 1, False),
                               (("retries", "backoff", "price_in", "price_out"), 0, False),
                               (("rpm", "tpm", "retry_horizon", "request_timeout"), 0, True)):
        for name in names:
            v = getattr(a, name)
            if v is not None and (v <= low if strict else v < low):
                raise ValueError(f"--{name.replace('_', '-')} must be {'>' if strict else '>='} {low}, got {v}")
    if a.answer is not None and a.problem is None:
        raise ValueError("--answer is the gold answer of --problem; a --data file's come from its answer column")
    if a.out and Path(a.out).is_dir():
        raise ValueError(f"--out {a.out!r} is a directory; give a file path (results jsonl)")
    problems = load_problems(a)

    from ttc.backends import ServerError
    from ttc.rsa import MarkovianRSA

    if (a.price_in is not None or a.price_out is not None) and not a.base_url:
        print("ttc solve: --price-in/--price-out price a server's usage; a local --model reports none, so no cost",
              file=sys.stderr)
    backend = build_backend(a)
    interrupted = False
    try:
        rsa = MarkovianRSA(backend, cfg, template, a.grader)
        # the plan: every request of every round fits the model's context, before anything is generated
        own = backend.context_length() if hasattr(backend, "context_length") else None
        if a.context and own and a.context > own:
            raise ValueError(f"--context {a.context} exceeds the model's own context {own} "
                             f"({'the server' if a.base_url else 'its config'}); give at most {own}, or leave it out")
        context = a.context or own
        clamped = None
        if context:
            # with --clamp, the budget fits the whole dataset's longest problem, so that a later --resume
            # with a larger --limit runs under the same settings
            whole = load_problems(a, limit=False) if a.clamp and a.limit is not None and a.problem is None else problems
            longest = max(len(backend.encode(p["problem"])) for p in whole)
            clamped = rsa.check_plan(longest, context, clamp=a.clamp)
            if clamped:
                print("ttc solve: clamped to fit the context " f"{context}: " +
                      ", ".join(f"{k} {o} -> {n}" for k, (o, n) in clamped.items()), file=sys.stderr)
        cfg = rsa.config
        model = backend.identity() if hasattr(backend, "identity") else {"model": a.model, "base_url": a.base_url}
        extra_key = {"context": context, "clamp": a.clamp, "api": a.api}
        if a.base_url and a.max_n:  # a split request's later parts sample with derived seeds
            extra_key["max_n"] = a.max_n
        key = run_key(cfg, template, a.grader, model, extra_key)
        out = Path(a.out) if a.out else None
        ckpt = out.with_name(out.name + ".rounds.jsonl") if out is not None else None
        records: list[dict] = []
        partial: dict = {}
        keys = _problem_keys([p["problem"] for p in problems])
        kept: list[dict] = []  # records of problems past this run's end (a smaller --limit): kept, not summarized
        regraded = 0
        if out is not None and a.resume and out.exists():
            for r in sorted(read_results(out, key), key=lambda r: r["index"]):
                if r["index"] >= len(problems):
                    kept.append(r)
                elif r["problem_key"] != keys[r["index"]]:
                    raise ValueError(f"{out} holds a result for another problem {r['index']} ({r['problem'][:40]!r}): "
                                     f"it was written from other data; use another --out or drop --resume")
                elif r.get("answer") != problems[r["index"]]["answer"]:
                    regraded += 1  # graded against another answer (or none): solved again
                else:
                    records.append(r)
        if kept:
            print(f"ttc solve: {len(kept)} result(s) in {out} are of problems after this run's {len(problems)}: "
                  f"kept in the file, left out of the summary", file=sys.stderr)
        if regraded:
            print(f"ttc solve: {regraded} result(s) in {out} were graded against another answer than the data's "
                  "(or none): those problems are solved again", file=sys.stderr)
        if ckpt is not None and a.resume and ckpt.exists():
            partial = read_checkpoints(ckpt, key)
        done = {(r["index"], r["problem_key"]) for r in records}
        todo = [(i, p) for i, p in enumerate(problems) if (i, keys[i]) not in done]
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            # earlier problems, without the old summary
            tmp.write_text("".join(json.dumps(r) + "\n" for r in sorted(records + kept, key=lambda r: r["index"])))
            os.replace(tmp, out)
            if not a.resume and ckpt.exists():
                ckpt.unlink()
        if a.save_traces and not a.resume:
            Path(a.save_traces).write_text("")  # a fresh run's traces replace the last run's
        results, checkpoints = _Writer(out), _Writer(ckpt)
        traces = _Writer(Path(a.save_traces)) if a.save_traces else _Writer(None)

        def with_text(r: dict) -> dict:
            return {**r, "prompt_text": backend.decode(r["prompt_ids"]),
                    "forwarded_text": [backend.decode(t) for t in r.get("forwarded") or []]}

        lock = threading.Lock()
        in_flight = a.problems_in_flight or (a.concurrency if a.base_url else 1)
        try:
            with _progress(a.no_progress) as prog:
                task = prog.add_task("", total=len(problems), completed=len(problems) - len(todo))
                live: dict[int, str] = {}

                def show():
                    acc = [r["mean_accuracy"] for r in records if r.get("mean_accuracy") is not None]
                    desc = f"mean acc {sum(acc) / len(acc):.3f}" if acc else ""
                    if live:
                        desc += (" | " if desc else "") + " ".join(f"#{i}:{s}" for i, s in sorted(live.items())[:4])
                    prog.update(task, description=desc)

                def one(i: int, p: dict) -> None:
                    pk = keys[i]  # computed once above
                    tokens = [0]

                    def on_round(t: int, rec: dict) -> None:
                        base = {"run_key": key, "index": i, "problem_key": pk, "round": t}
                        checkpoints.write({**base, "record": rec})
                        if a.save_traces:
                            traces.write({"type": "round", **base, "population": rec["population"],
                                          "prompts": [with_text(r) for r in rec["prompts"]]})
                        with lock:
                            tokens[0] += rec["tokens"]["generated"]
                            live[i] = f"round {t}/{cfg.rounds} {tokens[0]} tok"
                            show()

                    with lock:
                        live[i] = "round 0"
                        show()
                    base = {"type": "problem", "index": i, "problem_key": pk, "run_key": key, "problem": p["problem"],
                            "answer": p.get("answer")}
                    spent: dict = {}
                    try:
                        res = rsa.run(p["problem"], p.get("answer"), problem_key=pk,
                                      resume=partial.get((i, pk)), on_round=on_round, usage=spent)
                        rec = {**base, "status": "ok", **res.metrics,
                               "cost": cost(res.metrics.get("usage"), a.price_in, a.price_out)}
                        if a.save_traces:
                            fin = [with_text(vars(r)) for r in res.prompts if r.stage == "final"]
                            traces.write({"type": "final", "run_key": key, "index": i, "problem_key": pk,
                                          "prompts": fin, "responses": [c.response for c in res.final],
                                          "answers": res.metrics["answers"],
                                          "correct": [c.correct for c in res.final]})
                    except (ServerError, ValueError, RuntimeError, OSError) as e:  # recorded; the run goes on
                        rec = {**base, "status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                               "usage": dict(spent) or None, "cost": cost(spent, a.price_in, a.price_out)}
                    with lock:
                        records.append(rec)
                        live.pop(i, None)
                        prog.update(task, advance=1)
                        show()
                    results.write(rec)

                if in_flight <= 1:
                    for i, p in todo:
                        one(i, p)
                else:
                    pool = ThreadPoolExecutor(max_workers=min(in_flight, max(1, len(todo))))
                    try:
                        for f in [pool.submit(one, i, p) for i, p in todo]:
                            f.result()
                    except Exception:  # a problem failed unexpectedly: no new one starts, the running ones finish
                        pool.shutdown(wait=True, cancel_futures=True)  # (and write their results) before it is raised
                        raise
                    except BaseException:  # Ctrl-C / SIGTERM: no new problem starts (main ends the running ones)
                        pool.shutdown(wait=False, cancel_futures=True)
                        raise
                    pool.shutdown()
            records.sort(key=lambda r: r["index"])
            # wall_s: this run's elapsed time (problems run side by side; earlier runs' problems are not in it);
            # problem_wall_s: the sum of the problems' own times, those of a resumed run's earlier ones too
            extra = {"context": context, "clamped": {k: list(v) for k, v in clamped.items()} if clamped else None,
                     "wall_s": time.perf_counter() - started}
            summary = summarize(records, cfg, key, extra, (a.price_in, a.price_out))
            if (a.price_in is not None or a.price_out is not None) and summary["usage"] and summary["cost"] is None:
                print("ttc solve: the server reported no token counts (no usage in its replies), so no cost",
                      file=sys.stderr)
            results.write(summary)
        finally:
            results.close()
            checkpoints.close()
            traces.close()
        if ckpt is not None and ckpt.exists() and not summary["failed"]:
            # every problem of this run is in --out: its round checkpoints are no longer needed (those of problems
            # past a smaller --limit stay)
            rest = [r for _, r in _read_jsonl(ckpt) if r.get("index", -1) >= len(problems)]
            if rest:
                ckpt.write_text("".join(json.dumps(r) + "\n" for r in rest))
            else:
                ckpt.unlink()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM: main ends the process at once, and closing a local engine
        interrupted = True  # would wait (up to a minute) for the generation under way to end
        raise
    finally:
        close = getattr(backend, "close", None)
        if close is not None and not interrupted:
            close()
    if a.problem is not None:
        print(json.dumps({k: v for k, v in records[0].items() if k not in ("type", "problem_key", "run_key")}))
    print(json.dumps(summary))
    return 0 if not summary["failed"] else 1


def serve_main(argv: list[str]) -> int:
    from train.engine.server import main as serve

    return serve(argv, prog="ttc serve")


COMMANDS = {"solve": solve_main, "serve": serve_main}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command: problems generated the same in every run (envs.base.fixed_hash_seed)
        from envs.base import fixed_hash_seed

        fixed_hash_seed()
    from ttc.backends import ServerError

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ttc: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from train.errors import Terminated, sigterm_interrupts

    try:
        with sigterm_interrupts(name == "solve"):  # a scheduler's SIGTERM stops a sweep as Ctrl-C does
            return int(COMMANDS[name](rest) or 0)
    except (ValueError, KeyError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError,
            PermissionError, ServerError, ConnectionError) as e:
        if os.environ.get("CASCADE_DEBUG"):  # the traceback behind the one-line error, as for cascade
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"ttc {name}: error: {str(msg).splitlines()[0] if str(msg) else type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # every finished round is already on disk (fsynced line by line); leave without unwinding: the
        # engine's thread may be inside native code, and interpreter teardown around it can abort
        term = isinstance(e, Terminated)
        print(f"ttc {name}: " + ("terminated (SIGTERM)" if term else "interrupted")
              + ("; rerun with --resume to go on" if name == "solve" else ""), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(143 if term else 130)


if __name__ == "__main__":
    sys.exit(main())
