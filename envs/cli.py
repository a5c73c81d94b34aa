"""``cascade envs``: list, show and self-check environments.

    cascade envs list [PATTERN ...] [--family F] [--json]
    cascade envs show ID [--difficulty D] [--seed S] [--arg KEY=VALUE ...]
    cascade envs check [ID ...] [--difficulties 0-5] [--seeds 3] [--jobs 2] [--gen-limit S] [--arg KEY=VALUE ...]

``check`` runs each environment in one of ``--jobs`` worker processes with every ``generate`` under a
time bound; an environment whose generator exceeds it at a difficulty is capped below it and the
cap is recorded in ``envs/difficulty_caps.json`` (read by ``get_env``; see ``envs/caps.py``).
It ends with the slowest environments and the ones the adapters leave out, with their reasons.

Ids may contain '/', and '*' globs select several (quote them in the shell: 'rg/*').
"""
from __future__ import annotations

import argparse
import fnmatch
import sys
import time

__all__ = ["main", "parse_range"]


def parse_range(text: str) -> list[int]:
    """``"0-5"`` -> [0..5], ``"0,2,4"`` -> [0, 2, 4], ``"3"`` -> [3]."""
    out: list[int] = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                if int(hi) < int(lo):
                    raise ValueError
                out.extend(range(int(lo), int(hi) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise ValueError(f"bad difficulty range {text!r}; use e.g. 0-5 or 0,2,4") from None
    if not out or min(out) < 0:
        raise ValueError(f"bad difficulty range {text!r}; use e.g. 0-5 or 0,2,4")
    return out


def _parse_args_kv(items: list[str] | None) -> dict:
    import json

    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--arg expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cascade envs", description="list, show and self-check environments")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{list,show,check}")
    p = sub.add_parser("list", help="list registered environments")
    p.add_argument("patterns", nargs="*", help="ids or '*' globs to show (default: all)")
    p.add_argument("--family", help="only this family or id namespace (e.g. graphs, math, gym, rg, ifeval)")
    p.add_argument("--json", action="store_true", help="print a JSON list of {id, family, description}")
    p = sub.add_parser("show", help="print one generated problem with its reference answer and response")
    p.add_argument("id")
    p.add_argument("--difficulty", "-d", type=int, default=0)
    p.add_argument("--seed", "-s", type=int, default=0)
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="environment constructor argument")
    p = sub.add_parser("check", help="self-check environments (all, or those given); exit 1 on any failure")
    p.add_argument("ids", nargs="*", help="ids or '*' globs (default: every registered environment)")
    p.add_argument("--difficulties", default="0-5", help="e.g. 0-5 or 0,2,4 (default 0-5)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per difficulty (default 3)")
    p.add_argument("--jobs", "-j", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--gen-limit", type=float, default=None,
                   help="CPU seconds one generate may take before the environment is capped below that "
                        "difficulty (default: the environment's generate_time_limit, else 10)")
    p.add_argument("--env-limit", type=float, default=300.0, help="seconds the check of one environment may take")
    p.add_argument("--caps", default=None, help="file recording the difficulty caps found "
                                                "(default envs/difficulty_caps.json)")
    p.add_argument("--no-record", action="store_true", help="do not record the caps found")
    p.add_argument("--slowest", type=int, default=10, help="how many of the slowest environments to report")
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="environment constructor argument")
    p.add_argument("--quiet", "-q", action="store_true", help="only the summary and failures")
    return ap


def _list(args) -> int:
    from envs.base import env_info, list_envs

    rows, families = [], set()
    for env_id in list_envs():
        if args.patterns and not any(fnmatch.fnmatchcase(env_id, pat) for pat in args.patterns):
            continue
        info = env_info(env_id)
        # a family is the kind of task (graphs, strings, ...); the id's namespace (gym/, rg/) selects too
        groups = {info["family"], env_id.split("/")[0]} if "/" in env_id else {info["family"]}
        families |= groups
        if args.family and args.family not in groups:
            continue
        rows.append(info)
    if args.family and not rows:
        raise ValueError(f"no environment in family {args.family!r}; families and namespaces: "
                         f"{', '.join(sorted(families))}")
    if args.patterns and not rows:  # (a typo: say so, not an empty table)
        import difflib

        close = sorted({c for pat in args.patterns for c in difflib.get_close_matches(pat, list_envs(), n=5)})
        raise ValueError(f"no environment matches {' '.join(args.patterns)}"
                         + (f"; did you mean {', '.join(close)}?" if close else "; `cascade envs list` shows them all"))
    if args.json:
        import json

        print(json.dumps(rows, indent=1))
        return 0
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"{len(rows)} environments", show_lines=False)
        for col in ("id", "family", "description"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(r["id"], r["family"], r["description"])
        Console().print(table)
    except ImportError:
        for r in rows:
            print(f"{r['id']}\t{r['family']}\t{r['description']}")
    return 0


def _show(args) -> int:
    from envs.base import get_env

    if args.difficulty < 0:
        raise ValueError(f"--difficulty must be >= 0, got {args.difficulty}")
    env = get_env(args.id, **_parse_args_kv(args.arg))
    p = env.generate(args.seed, args.difficulty)
    print(f"# {args.id}  difficulty={args.difficulty} seed={args.seed}")
    print("## prompt\n" + p.prompt)
    print("## reference answer\n" + env.format_answer(p.answer))
    print("## reference response\n" + env.reference_response(p))
    score = env.verify(p, env.reference_response(p))
    print(f"## reference score\nreward={score.reward} correct={score.correct} format_ok={score.format_ok}")
    return 0


def _excluded() -> dict[str, str]:
    """Environments the adapters leave unregistered, with the reason (only installed packages)."""
    out = {}
    for prefix, mod in (("rg/", "envs.reasoning_gym_adapter"), ("rlve/", "envs.rlve_adapter"),
                        ("rc/", "envs.reasoning_core_adapter")):
        try:
            import importlib

            m = importlib.import_module(mod)
        except Exception:  # noqa: BLE001
            continue
        if m.catalog():
            out.update({f"{prefix}{k}": v for k, v in getattr(m, "EXCLUDED", {}).items()})
    return out


def _check(args) -> int:
    from envs.check import check_ids, expand_ids, update_caps

    ids = expand_ids(args.ids)
    diffs = parse_range(args.difficulties)
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.gen_limit is not None and not args.gen_limit > 0:  # 0 meant the default, a negative one every level slow
        raise ValueError(f"--gen-limit must be > 0 seconds, got {args.gen_limit:g}")
    if not args.env_limit > 0:  # (a limit <= 0 failed every environment as "took over -1s")
        raise ValueError(f"--env-limit must be > 0 seconds, got {args.env_limit:g}")
    seeds = list(range(args.seeds))
    kwargs = _parse_args_kv(args.arg)
    t0 = time.perf_counter()
    failed: dict[str, list[str]] = {}
    results = []
    for r in check_ids(ids, diffs, seeds, jobs=args.jobs, env_kwargs=kwargs, gen_limit=args.gen_limit,
                       env_limit=args.env_limit):
        results.append(r)
        if r.failures:
            failed[r.env_id] = r.failures
        capped = f"  capped at difficulty {r.cap}: {r.cap_reason}" if r.cap is not None else ""
        if not args.quiet or r.failures or capped:
            print(f"{'FAIL' if r.failures else 'ok  '} {r.env_id}  ({r.seconds:.2f}s){capped}", flush=True)
            for f in r.failures[:10]:
                print(f"     {f}")
            if len(r.failures) > 10:
                print(f"     ... and {len(r.failures) - 10} more")
    dt = time.perf_counter() - t0
    if kwargs and not args.no_record:  # caps belong to an id as get_env builds it by default
        print(f"difficulty caps not recorded: measured with constructor arguments {kwargs}")
    elif not args.no_record and not any(":" in i for i in ids):
        from envs import caps as _caps

        before = _caps.load_caps(args.caps)
        after = update_caps(results, diffs, args.caps, write=False)
        if after != before:
            path = _caps.save_caps(after, args.caps)
            print(f"difficulty caps recorded in {path}: {len(after)} environments capped")
    if args.slowest > 0 and results:
        print(f"slowest {min(args.slowest, len(results))} environments:")
        for r in sorted(results, key=lambda r: -r.seconds)[:args.slowest]:
            st = r.stats
            gen = f"generate {st['gen_s'] / st['gen_n'] * 1e3:.1f} ms mean, {st['gen_max_s']:.2f}s max" \
                if st.get("gen_n") else "generate -"
            ver = f"verify {st['ver_s'] / st['ver_n'] * 1e3:.1f} ms mean" if st.get("ver_n") else "verify -"
            print(f"  {r.seconds:8.2f}s  {r.env_id}  ({gen}; {ver})")
    excluded = {k: v for k, v in _excluded().items()
                if not args.ids or any(fnmatch.fnmatchcase(k, pat) for pat in args.ids)}
    if excluded:
        print(f"{len(excluded)} environments left out by their adapters:")
        for k, v in sorted(excluded.items()):
            print(f"  {k}: {v}")
    print(f"{len(ids) - len(failed)}/{len(ids)} environments pass the self-check "
          f"(difficulties {args.difficulties}, {args.seeds} seeds, {args.jobs} jobs, {dt:.1f}s)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return {"list": _list, "show": _show, "check": _check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
