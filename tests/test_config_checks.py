"""Boundaries of the run config's checks, the override parser, checkpoints' retention and cleanup, the stage
data helpers (phases, schedules, mixes) and the run records: behaviour the other test files left unchecked."""
from __future__ import annotations

import json
import re

import pytest


# -- cascade/config.py ------------------------------------------------------------------------------
@pytest.mark.parametrize("override, msg", [
    ("aggregation.tails=0", "tails, tail_tokens and buffer >= 1 (got 0, "),
    ("sources={a: {weight: 1, envs: []}}", "source 'a' needs a weight >= 0 and at least one environment"),
    ("phases=[{steps: 0, envs: {toy/max: 1}}]", "phases[0] needs steps >= 1"),
    ("max_new_tokens_schedule=[[0.5, 8], [0.5, 16]]", "fractions rising in [0, 1]"),
    ("aggregation={fraction: 0.5, expert: warmup, expert_samples: 3, tails: 4}",
     "aggregation.tails=4 is more than aggregation.expert_samples=3"),
    ("eval_difficulty=-1", "eval_difficulty must be >= 0"),
    ("sft={steps: 2, max_len: 1}", "sft.max_len must be >= 2, got 1"),
    ("vllm.gpu_memory_utilization=0", "vllm.gpu_memory_utilization must be in (0, 1], got 0"),
    ("vllm.extra={dtype: float16}", "vllm.extra sets dtype"),
])
def test_values_at_or_past_a_bound_are_refused(override, msg):
    from cascade.config import ConfigError, load_run_config, parse_overrides

    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_run_config(parse_overrides(["stage=rlve", "profile=tiny", override]))


def test_values_on_a_bound_pass():
    from cascade.config import load_run_config, parse_overrides

    cfg, _ = load_run_config(parse_overrides(["stage=rlve", "profile=tiny", "rollout.down_wait_s=0",
                                              "aggregation={fraction: 0.5, expert: warmup, expert_samples: 4, "
                                              "tails: 4}", "max_new_tokens_schedule=[[0, 8], [0.5, 16]]"]))
    assert cfg.rollout.down_wait_s == 0
    assert (cfg.stages["rlve"].aggregation.tails, cfg.stages["rlve"].aggregation.expert_samples) == (4, 4)


def test_null_is_text_for_a_plain_string_setting():
    """``null`` unsets an optional string setting; a plain one (``str``) takes the four letters."""
    from cascade.config import load_run_config, parse_overrides

    assert parse_overrides(["trainer.rdzv_id=null", "model=null"]) == {"trainer.rdzv_id": "null", "model": None}
    cfg, _ = load_run_config(parse_overrides(["trainer.rdzv_id=~"]))
    assert cfg.trainer.rdzv_id == "~"


# -- cascade/checkpoint.py --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_model(tiny_dense_dir):
    from train.model.hf_io import load_pretrained

    return load_pretrained(tiny_dense_dir)


def test_checkpoints_keep_the_newest_and_the_pinned_one(tmp_path, tiny_dense_dir, small_model):
    from cascade.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "ck", keep=2)
    first = ck.save(1, small_model, tiny_dense_dir, {}, {"step": 1}, sync=True)
    ck.pinned = first
    for step in (2, 3, 4):
        ck.save(step, small_model, tiny_dense_dir, {}, {"step": step}, sync=True)
    assert [p.name for p in ck.complete()] == ["step-00000001", "step-00000003", "step-00000004"]
    ck.pinned = None
    ck.save(5, small_model, tiny_dense_dir, {}, {"step": 5}, sync=True)
    assert [p.name for p in ck.complete()] == ["step-00000004", "step-00000005"]


def test_a_new_checkpointer_removes_incomplete_directories_only(tmp_path, tiny_dense_dir, small_model):
    from cascade.checkpoint import Checkpointer

    root = tmp_path / "ck"
    Checkpointer(root).save(3, small_model, tiny_dense_dir, {}, {"step": 3}, sync=True)
    (root / "step-00000004.tmp").mkdir()          # a crash mid-write
    (root / "step-00000005").mkdir()               # renamed, not yet marked complete
    ck = Checkpointer(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]
    assert ck.latest() == root / "step-00000003"


def test_a_weights_file_longer_than_its_header_says_is_damage(tmp_path, tiny_dense_dir, small_model):
    from cascade.checkpoint import Checkpointer, Unreadable, read_back

    ck = Checkpointer(tmp_path / "ck")
    path = ck.save(1, small_model, tiny_dense_dir, {"x": 1}, {"step": 1}, sync=True)
    assert read_back(path) == ({"x": 1}, {"step": 1})
    f = next(path.glob("*.safetensors"))
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(Unreadable, match="weights: ValueError"):
        read_back(path)


def test_a_set_aside_unreadable_checkpoint_is_never_resumed(tmp_path, tiny_dense_dir, small_model):
    from cascade.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, small_model, tiny_dense_dir, {}, {"step": 1}, sync=True)
    ck.save(2, small_model, tiny_dense_dir, {}, {"step": 2}, sync=True)
    (ck.root / "step-00000002" / "state.json").write_text("{cut")
    warned = []
    path, (_, state) = ck.latest_loadable(warn=warned.append)
    assert path.name == "step-00000001" and state == {"step": 1} and len(warned) == 1
    assert (ck.root / "step-00000002.unreadable").is_dir()
    assert [p.name for p in ck.complete()] == ["step-00000001"]
    assert ck.latest_loadable(warn=warned.append)[0].name == "step-00000001" and len(warned) == 1


# -- cascade/stagedata.py ---------------------------------------------------------------------------
def _stage(**kw):
    from cascade.config import Phase, StageConfig

    phases = [Phase(steps=n, envs={"toy/max": 1.0}) for n in kw.pop("phase_steps", [])]
    return StageConfig(phases=phases, **kw)


def test_phase_starts_scale_to_a_shortened_stage_and_stay_apart():
    from cascade.stagedata import phase_at, phase_starts

    assert phase_starts(_stage(steps=6, phase_steps=[4, 2])) == [0, 4]      # as configured
    assert phase_starts(_stage(steps=4, phase_steps=[2, 1])) == [0, 3]      # 2 * 4/3 = 2.67 -> 3
    assert phase_starts(_stage(steps=2, phase_steps=[1, 9, 10])) == [0, 1, 2]  # at least one step apart
    s = _stage(steps=6, phase_steps=[4, 2])
    assert [phase_at(s, i)[0] for i in range(6)] == [0, 0, 0, 0, 1, 1]


def test_the_response_cap_switches_on_the_step_its_fraction_is_reached():
    from cascade.stagedata import max_new_tokens_at

    s = _stage(steps=10, max_new_tokens_schedule=[[0.0, 64], [0.5, 16]])
    assert [max_new_tokens_at(s, i, 999) for i in (0, 4, 5, 9)] == [64, 64, 16, 16]
    assert max_new_tokens_at(_stage(steps=10, max_new_tokens_schedule=[[0.3, 8]]), 2, 999) == 999


def test_union_mix_sums_each_phases_normalised_shares():
    from cascade.stagedata import union_mix

    assert union_mix([{"a": 1.0, "b": 3.0}, {"a": 2.0}]) == {"a": 1.25, "b": 0.75}


def test_the_rlve_controller_takes_the_stage_group_size_unless_given_a_window():
    from cascade.stagedata import controller_settings

    assert controller_settings(_stage(controller="rlve", controller_kwargs={"tau_num": 3})) == {"tau_num": 3}
    assert controller_settings(_stage(controller="rlve")) == {"group_size": _stage().rl.group_size}


def test_set_mix_zeroes_what_the_mix_leaves_out_and_refuses_strangers():
    from types import SimpleNamespace

    from cascade.stagedata import set_mix

    cur = SimpleNamespace(weights={"a": 1.0, "b": 1.0})
    set_mix(cur, {"a": 2.0})
    assert cur.weights == {"a": 2.0, "b": 0.0}
    with pytest.raises(ValueError, match=re.escape("outside the stage's curriculum: ['c']")):
        set_mix(cur, {"c": 1.0})


# -- cascade/records.py -----------------------------------------------------------------------------
def test_a_record_after_a_line_a_crash_cut_is_a_line_of_its_own(tmp_path):
    from cascade.records import Records, read_records

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "math", "phase": "rl", "step": 0}) + "\n"
                                            + '{"stage": "math", "phase": "rl", "st')
    r = Records(tmp_path)
    r.log("math", "rl", 1, {"reward_mean": 0.5})
    r.close()
    assert [(x["step"], x.get("reward_mean")) for x in read_records(tmp_path)] == [(0, None), (1, 0.5)]


def test_a_rerun_step_drops_only_its_own_stages_later_records(tmp_path):
    from cascade.records import read_records

    recs = [{"stage": "rlve", "phase": "rl", "step": 5}, {"stage": "math", "phase": "rl", "step": 3},
            {"stage": "math", "phase": "pool", "step": 7}, {"stage": "math", "phase": "rl", "step": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = sorted((r["stage"], r["phase"], r["step"]) for r in read_records(tmp_path))
    assert got == [("math", "pool", 7), ("math", "rl", 1), ("rlve", "rl", 5)]


# -- train/dataclass_config.py: the typed build, value by value -----------------------------------------
import dataclasses as _dc  # noqa: E402
from typing import Optional as _Optional  # noqa: E402


@_dc.dataclass
class _Leaf:
    n: int = 0
    x: float = 0.0
    on: bool = False
    s: str = ""


@_dc.dataclass
class _Typed:
    leaf: _Leaf = _dc.field(default_factory=lambda: _Leaf(n=7))
    xs: list[int] = _dc.field(default_factory=list)
    pair: tuple[int, ...] = ()
    table: dict[str, float] = _dc.field(default_factory=dict)
    either: int | str = 0
    maybe: _Optional[int] = None
    positive: int = 1

    def __post_init__(self):
        if self.positive < 1:
            raise ValueError(f"positive must be >= 1, got {self.positive}")
        if self.positive == 99:
            raise KeyError("positive may not be 99")


def test_build_converts_what_yaml_gives_and_refuses_the_rest():
    from train.dataclass_config import ConfigError, build

    got = build(_Typed, {"leaf": {"x": 2, "on": True}, "xs": [1, 2.0], "pair": [3, 4], "table": {"a": 1, "b": "1e-3"},
                         "maybe": None, "either": "w"})
    assert got.leaf == _Leaf(n=7, x=2.0, on=True)  # merged into the field's default (n=7)
    assert isinstance(got.leaf.x, float) and got.xs == [1, 2] and isinstance(got.xs[1], int)
    assert got.pair == (3, 4) and isinstance(got.pair, tuple)
    assert got.table == {"a": 1.0, "b": 0.001} and isinstance(got.table["a"], float)
    assert (got.either, got.maybe) == ("w", None)
    assert build(_Leaf, {"x": "1e-3", "n": 3.0, "s": 2024}) == _Leaf(n=3, x=0.001, s="2024")
    same = _Leaf(n=2)
    assert build(_Typed, {"leaf": same}).leaf is same  # an instance is taken as it is
    for data, msg in (({"on": 1}, "on: expected true/false, got 1"),
                      ({"x": True}, "x: expected a number, got True"),
                      ({"x": "fast"}, "x: expected a number, got 'fast'"),
                      ({"n": True}, "n: expected an integer, got True"),
                      ({"n": 2.5}, "n: expected an integer, got 2.5"),
                      ({"s": True}, "s: expected a string, got True"),
                      ({"nope": 1}, "unknown key 'nope'; valid keys: n, on, s, x")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            build(_Leaf, data)
    for data, msg in (({"xs": "12"}, "xs: expected a list, got str '12'"),
                      ({"xs": [1, "a"]}, "xs[1]: expected an integer, got 'a'"),
                      ({"table": {"a": "x"}}, "table.a: expected a number, got 'x'"),
                      ({"either": None}, "either: "),
                      ({"leaf": 3}, "leaf: expected a mapping, got 3"),
                      ({"leaf": {"bad": 1}}, "unknown key 'leaf.bad' in leaf"),
                      ({"positive": 0}, "_Typed: positive must be >= 1, got 0"),
                      ({"positive": 99}, "_Typed: positive may not be 99")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            build(_Typed, data)


def test_build_over_a_base_keeps_the_bases_values_and_nested_ones():
    from train.dataclass_config import build

    base = _Typed(leaf=_Leaf(n=3, s="b"), xs=[9], positive=5)
    got = build(_Typed, {"leaf": {"x": 1.5}}, base=base)
    assert got == _Typed(leaf=_Leaf(n=3, x=1.5, s="b"), xs=[9], positive=5)
    assert build(_Typed, {}, base=base) == base
