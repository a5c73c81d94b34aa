"""Stage evaluation as the ZAYA1 report evaluates: avg@k, the mean correctness of k sampled answers
per held-out problem averaged over the problems, overall and per environment family (the id's part
before ``/``: ``gym``, ``math``, ``code``, ...). ``k = 0`` scores one greedy answer instead.

``cascade eval`` (:func:`main`) scores a checkpoint on a stage's held-out problems without training."""
from __future__ import annotations

USAGE = """usage: cascade eval model=PATH [stage=NAME] [profile=NAME] [config=FILE.yaml] [out=DIR] [key.sub=value ...]

Scores a checkpoint on a stage's held-out problems as `cascade run` scores its policy before and after the
stage: eval_problems problems shared among the stage's environments as its mix weighs them, at eval_difficulty
(or each environment's start level), avg@eval_k at the stage's sampling settings (eval_k=0: one greedy answer),
with the run's seed. So the final/ of a stage scores what its run_state.json says after the stage. Without
stage=, every stage of the cascade in turn. The keys are `cascade run`'s (with stage=NAME, relative to that
stage): engine=vllm, rollout.urls=[...] or rollout.servers=N to generate on servers, seed=, eval_k=, ...
out=DIR only holds what servers need (a temporary directory by default). One JSON line per stage."""


def family(env_id: str) -> str:
    """The environment family of an id: ``gym/sudoku`` -> ``gym``; ``ifeval`` -> ``ifeval``."""
    return env_id.split("/", 1)[0] if "/" in env_id and ":" not in env_id else env_id


def avg_at_k(rl, problems: list, k: int, seed: int = 0, chunk: int = 0, advance=None) -> dict:
    """avg@k of ``rl.engine`` (an :class:`~train.rl.trainer.RLTrainer` or anything with its
    ``engine``, ``tokenizer``, ``cfg``, ``env_of`` and ``max_prompt_tokens``) on ``problems``
    [(env_id, Problem)], sampled with the RL sampling settings (response cap included) at ``seed``.
    Problems whose prompts do not fit the context are left out (``skipped``), as in training.
    Returns ``{"accuracy", "k", "families": {family: avg@k}, "problems": {family: n}, "skipped"}``."""
    from envs.base import verify_all, verify_workers
    from train.rl.trainer import encode_prompt
    from train.tokenizer import open_think_of

    c = rl.cfg
    enc = [(e, p, encode_prompt(rl.tokenizer, p.prompt, c.chat_template, c.system_prompt)) for e, p in problems]
    think = open_think_of(rl.tokenizer, c.chat_template, c.system_prompt)  # verified in front of each response
    per_problem: list[tuple[str, float]] = []
    size = chunk if chunk > 0 else max(len(enc), 1)
    skipped = 0
    for i in range(0, len(enc), size):  # chunks of the problems as given; prompts too long skipped within
        part = [x for x in enc[i:i + size] if len(x[2]) <= rl.max_prompt_tokens]
        skipped += len(enc[i:i + size]) - len(part)
        # each chunk its own streams (engines seed rows by their index in the call: chunks shared them all)
        params = c.sampling.params(max(k, 1), seed + i)
        if k == 0:
            params.temperature = 0.0
        comps = rl.engine.generate([x[2] for x in part], params) if part else []
        right = [0] * len(part)
        seen = [0] * len(part)
        scores = verify_all([(rl.env_of(part[comp.prompt_index][0]), part[comp.prompt_index][1], think + comp.text)
                             for comp in comps], verify_workers(c.verify_workers))
        for comp, score in zip(comps, scores):
            seen[comp.prompt_index] += 1
            right[comp.prompt_index] += bool(score.correct)
        per_problem += [(family(e), r / max(n, 1)) for (e, _, _), r, n in zip(part, right, seen)]
        if advance is not None:
            advance(len(enc[i:i + size]))
    fams: dict[str, list[float]] = {}
    for f, v in per_problem:
        fams.setdefault(f, []).append(v)
    return {"accuracy": sum(v for _, v in per_problem) / len(per_problem) if per_problem else 0.0, "k": k,
            "families": {f: sum(vs) / len(vs) for f, vs in sorted(fams.items())},
            "problems": {f: len(vs) for f, vs in sorted(fams.items())}, "skipped": skipped}


def main(argv: list[str]) -> int:
    """``cascade eval``: see :data:`USAGE`."""
    import json
    import tempfile
    from pathlib import Path

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import FLAGS, _check_machine, _initial_model
    from cascade.stage import StageRunner

    overrides = parse_overrides(argv)
    flags = [k for k in FLAGS if k in overrides]
    if flags:
        raise ValueError(f"{flags[0]}= is a `cascade run` switch; cascade eval takes model=, stage= and config keys")
    given_out = "out" in overrides
    cfg, tree = load_run_config(overrides)
    if not cfg.model:  # (not given, on the command line or in config=, or given empty: an unset $CKPT)
        raise ValueError("cascade eval needs model=PATH (a checkpoint directory or a Hub id), e.g. a stage's final/"
                         + ("; the model= given is empty" if "model" in overrides else ""))
    for name in cfg.order:
        if cfg.stages[name].eval_problems < 1:
            raise ValueError(f"stage {name}: eval_problems={cfg.stages[name].eval_problems} leaves nothing to score")
    _check_machine(cfg)
    with tempfile.TemporaryDirectory(prefix="cascade-eval-") as tmp:
        out = Path(cfg.out if given_out else tmp).absolute()
        out.mkdir(parents=True, exist_ok=True)
        src = _initial_model(cfg, out)
        names = list(tree["stages"])
        for name in cfg.order:
            index = names.index(name) if name in names else len(names)
            runner = StageRunner(name, index, cfg.stages[name], cfg, out, records=None)
            res = runner.score(src)
            print(json.dumps({"stage": name, "model": cfg.model, **res}), flush=True)
    return 0
