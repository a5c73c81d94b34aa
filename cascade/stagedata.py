"""A stage's data as the ZAYA1 report describes it: the mix as named sources (warm-up: puzzles /
competition math / logic puzzles), phases that switch the mix at configured steps (stage 3: 384 +
464 steps), and the response cap scheduled by the fraction of RL steps done (warm-up: 65K tokens
for its first half). Plain functions of the :class:`~cascade.config.StageConfig`."""
from __future__ import annotations

from cascade.config import Phase, Source, StageConfig
from envs.curriculum import valid_weights


def mix_of(envs: dict[str, float], sources: dict[str, Source]) -> dict[str, float]:
    """Environment weights of a mix given as ``envs`` (globs expanded) or as ``sources``: each
    source's weight split equally over the environments its patterns match."""
    from cascade.stage import expand_envs

    if not sources:
        return expand_envs(envs)
    out: dict[str, float] = {}
    for src in sources.values():
        ids = expand_envs({pat: 1.0 for pat in src.envs})
        for e in ids:
            out[e] = out.get(e, 0.0) + float(src.weight) / len(ids)
    return out


def stage_mixes(s: StageConfig, name: str = "") -> list[dict[str, float]]:
    """The mix of each phase in order (one entry, the stage's own mix, when there are no phases); ``name``,
    the stage's, names a phase with no positive weight in the error."""
    if not s.phases:
        mix = mix_of(s.envs, s.sources)
        if not valid_weights(mix):  # negative weights were sampled as shares of a negative total
            from train.dataclass_config import ConfigError

            where = f"stages.{name}.{'sources' if s.sources else 'envs'}" if name else "the stage's mix"
            raise ConfigError(f"{where}: weights must be finite and >= 0 with a positive sum; got {mix}")
        return [mix]
    if s.envs or s.sources:
        mix_of(s.envs, s.sources)  # an unknown environment is named first
        from train.dataclass_config import ConfigError

        raise ConfigError("a stage with phases takes its mix from them; drop its envs/sources or set phases=[] "
                          f"(phases: {[sorted(p.envs or p.sources) for p in s.phases]})")
    mixes = [mix_of(p.envs, p.sources) for p in s.phases]
    for i, m in enumerate(mixes):
        if not valid_weights(m):
            from train.dataclass_config import ConfigError

            where = f"stages.{name}.phases[{i}]" if name else f"phases[{i}]"
            raise ConfigError(f"{where}: its weights must be finite and >= 0 with a positive sum (a phase samples "
                              f"from its own mix); got {m}")
    return mixes


def check_env_kwargs(s: StageConfig, name: str) -> None:
    """Every ``env_kwargs`` entry names an environment of the stage's mix and settings its constructor takes,
    ``controller_kwargs`` settings and values the stage's difficulty controller takes, and ``sft.envs``
    environments that exist (a one-line ConfigError naming what is valid, before any stage runs)."""
    import inspect

    from envs.base import check_env_kwargs as check
    from envs.curriculum import CONTROLLERS
    from train.dataclass_config import ConfigError

    from cascade.stage import sft_envs

    envs = set(union_mix(stage_mixes(s, name))) | set(sft_envs(s.sft.envs))  # (an unknown sft.envs one is named)
    for env_id, kw in s.env_kwargs.items():
        if env_id not in envs:
            raise ConfigError(f"stages.{name}.env_kwargs.{env_id}: {env_id} is not in the stage's mix or sft.envs "
                              f"({', '.join(sorted(envs))})")
        try:
            check(env_id, dict(kw or {}))
        except TypeError as e:
            raise ConfigError(f"stages.{name}.env_kwargs.{env_id}: {e}") from None
    if s.controller not in CONTROLLERS:
        raise ConfigError(f"stages.{name}.controller: unknown difficulty controller {s.controller!r}; choose from "
                          f"{', '.join(CONTROLLERS)}")
    params = inspect.signature(CONTROLLERS[s.controller]).parameters
    takes = [k for k, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k != "max_difficulty"]
    bad = sorted(set(s.controller_kwargs or {}) - set(takes))
    if bad and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ConfigError(f"stages.{name}.controller_kwargs: the {s.controller} controller takes no setting "
                          f"{', '.join(bad)}; it takes: {', '.join(takes)} (settings of the configured controller "
                          f"merge with yours: controller_kwargs={{...}} replaces them all)")
    try:  # the values too (explore=0.7, up=abc), as the stage builds it; a controller draws from its own generator
        CONTROLLERS[s.controller](**controller_settings(s))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"stages.{name}.controller_kwargs: {e}") from None


def controller_settings(s: StageConfig) -> dict:
    """The settings the stage's difficulty controller is built with: ``controller_kwargs``, and for ``rlve``
    without ``group_size`` or ``tau_num`` the stage's ``rl.group_size`` (its window counts ``tau_prompts`` groups
    of the stage's size)."""
    kw = dict(s.controller_kwargs or {})
    if s.controller == "rlve" and not {"group_size", "tau_num"} & set(kw):
        kw["group_size"] = s.rl.group_size
    return kw


def union_mix(mixes: list[dict[str, float]]) -> dict[str, float]:
    """Every environment of any phase, weighted by the sum of its normalised shares (what a curriculum
    over the whole stage is built with, and what the pass-rate pool samples from)."""
    out: dict[str, float] = {}
    for m in mixes:
        total = sum(m.values()) or 1.0
        for e, w in m.items():
            out[e] = out.get(e, 0.0) + w / total
    return out


def phase_starts(s: StageConfig) -> list[int]:
    """The RL step at which each phase starts. Phases whose steps sum to the stage's ``steps`` switch
    exactly at the configured steps; otherwise (a shortened run, e.g. the tiny profile) the
    boundaries scale in proportion (rounded), each phase starting at least one step after the one before
    (a 2-step smoke run of a two-phase stage runs one step of each; phases past the last step never start)."""
    if not s.phases:
        return [0]
    total = sum(p.steps for p in s.phases)
    starts, acc = [], 0
    for p in s.phases:
        at = acc if total == s.steps else round(acc * s.steps / total)
        starts.append(max(at, starts[-1] + 1) if starts else 0)
        acc += p.steps
    return starts


def phase_at(s: StageConfig, rl_step: int) -> tuple[int, Phase | None]:
    """(index, phase) in force at RL step ``rl_step`` (0-based); (0, None) without phases."""
    if not s.phases:
        return 0, None
    idx = 0
    for i, start in enumerate(phase_starts(s)):
        if rl_step >= start:
            idx = i
    return idx, s.phases[idx]


def max_new_tokens_at(s: StageConfig, rl_step: int, default: int) -> int:
    """The response cap at RL step ``rl_step`` of ``s.steps``: the tokens of the last schedule entry
    whose fraction has been reached, else ``default``."""
    frac = rl_step / max(s.steps, 1)
    cap = default
    for f, tokens in s.max_new_tokens_schedule:
        if frac >= f:
            cap = int(tokens)
    return cap


def set_mix(curriculum, weights: dict[str, float]) -> None:
    """Sample ``curriculum`` (a :class:`~envs.curriculum.Curriculum`, or a pool around one) with the
    mix ``weights``; its environments outside the mix get weight 0 (kept, with their difficulty
    state, for a later phase)."""
    inner = getattr(curriculum, "curriculum", curriculum)
    unknown = sorted(set(weights) - set(inner.weights))
    if unknown:
        raise ValueError(f"the mix names environments outside the stage's curriculum: {unknown}")
    if not valid_weights(weights):
        raise ValueError(f"a mix's weights must be finite and >= 0 with a positive sum; got {weights}")
    inner.weights = {e: float(weights.get(e, 0.0)) for e in inner.weights}
