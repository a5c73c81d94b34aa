"""``cascade envs``: list, show and self-check environments.

    cascade envs list [PATTERN ...] [--family F]
    cascade envs show ID [--difficulty D] [--seed S] [--arg KEY=VALUE ...]
    cascade envs check [ID ...] [--difficulties 0-5] [--seeds 3] [--jobs N] [--arg KEY=VALUE ...]

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
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="list registered environments")
    p.add_argument("patterns", nargs="*", help="ids or '*' globs to show (default: all)")
    p.add_argument("--family", help="only this family (e.g. math, gym, rg, ifeval)")
    p = sub.add_parser("show", help="print one generated problem with its reference answer and response")
    p.add_argument("id")
    p.add_argument("--difficulty", "-d", type=int, default=0)
    p.add_argument("--seed", "-s", type=int, default=0)
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="environment constructor argument")
    p = sub.add_parser("check", help="self-check environments (all, or those given); exit 1 on any failure")
    p.add_argument("ids", nargs="*", help="ids or '*' globs (default: every registered environment)")
    p.add_argument("--difficulties", default="0-5", help="e.g. 0-5 or 0,2,4 (default 0-5)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per difficulty (default 3)")
    p.add_argument("--jobs", "-j", type=int, default=1, help="worker processes (default 1)")
    p.add_argument("--arg", action="append", metavar="KEY=VALUE", help="environment constructor argument")
    p.add_argument("--quiet", "-q", action="store_true", help="only the summary and failures")
    return ap


def _list(args) -> int:
    from envs.base import env_info, list_envs

    rows = []
    for env_id in list_envs():
        if args.patterns and not any(fnmatch.fnmatchcase(env_id, pat) for pat in args.patterns):
            continue
        info = env_info(env_id)
        if args.family and info["family"] != args.family:
            continue
        rows.append(info)
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

    env = get_env(args.id, **_parse_args_kv(args.arg))
    p = env.generate(args.seed, args.difficulty)
    print(f"# {args.id}  difficulty={args.difficulty} seed={args.seed}")
    print("## prompt\n" + p.prompt)
    print("## reference answer\n" + env.format_answer(p.answer))
    print("## reference response\n" + env.reference_response(p))
    score = env.verify(p, env.reference_response(p))
    print(f"## reference score\nreward={score.reward} correct={score.correct} format_ok={score.format_ok}")
    return 0


def _check(args) -> int:
    from envs.check import check_ids, expand_ids

    ids = expand_ids(args.ids)
    diffs = parse_range(args.difficulties)
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    seeds = list(range(args.seeds))
    kwargs = _parse_args_kv(args.arg)
    t0 = time.perf_counter()
    failed: dict[str, list[str]] = {}
    for env_id, fails, dt in check_ids(ids, diffs, seeds, jobs=args.jobs, env_kwargs=kwargs):
        if fails:
            failed[env_id] = fails
        if not args.quiet or fails:
            print(f"{'FAIL' if fails else 'ok  '} {env_id}  ({dt:.2f}s)", flush=True)
            for f in fails[:10]:
                print(f"     {f}")
            if len(fails) > 10:
                print(f"     ... and {len(fails) - 10} more")
    dt = time.perf_counter() - t0
    print(f"{len(ids) - len(failed)}/{len(ids)} environments pass the self-check "
          f"(difficulties {args.difficulties}, {args.seeds} seeds, {dt:.1f}s)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return {"list": _list, "show": _show, "check": _check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
