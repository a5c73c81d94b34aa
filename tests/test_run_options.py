"""What a user meets around ``cascade run`` and the CLI: ``config=FILE.yaml``, ``print_config``,
``resume=false`` / ``overwrite=true``, W&B run identity across resumes, progress on the long phases,
``engine=vllm`` options, the CLI's help and JSON outputs, and the declared dependencies."""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.conftest import cascade_here

ROOT = Path(__file__).resolve().parents[1]


def cascade(*args, cwd=None, env=None):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "cascade", *args], cwd=cwd or ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


def here(*args):
    """``cascade ARGS`` in this process (tests/conftest.py): for calls that only print or refuse a config."""
    return cascade_here(*args, cwd=ROOT)


# -- config=FILE.yaml and print_config ------------------------------------------------------------
def test_print_config_prints_every_key_and_does_no_work(tmp_path):
    out = tmp_path / "run"
    r = here("run", "profile=tiny", f"out={out}", "print_config=true")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["out"] == str(out)
    assert cfg["order"] == ["warmup", "rlve", "math", "behavior"]
    # defaults that no YAML file spells out are printed too (the resolved configuration)
    assert cfg["trainer"]["tokens_per_micro"] == 16384
    assert cfg["vllm"] == {"gpu_memory_utilization": None, "tensor_parallel_size": 1, "max_model_len": None,
                           "extra": {}}
    assert not out.exists()  # nothing was run, nothing written
    # the printed configuration is itself a valid config file that resolves to the same configuration
    f = tmp_path / "printed.yaml"
    f.write_text(r.stdout)
    again = here("run", f"config={f}", "print_config=true")
    assert again.returncode == 0, again.stderr
    assert again.stdout == r.stdout


def test_config_file_applies_after_the_profile_and_before_the_command_line(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("stage: math\n"
                 "rl:\n  group_size: 3\n  optim: {lr: 3.0e-6}\n"   # nested, relative to the stage
                 "checkpoint_every: 7\n"
                 "vllm.max_model_len: 4096\n"                       # dotted, like the command line
                 "logging: {wandb: true}\n"
                 "envs: {toy/add: 1}\n")                            # a mapping held as one value: replaced whole
    r = here("run", "profile=tiny", f"config={f}", "rl.group_size=5", "print_config=true")
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    math = cfg["stages"]["math"]
    assert cfg["order"] == ["math"]
    assert math["rl"]["group_size"] == 5                  # the command line wins over the file
    assert math["rl"]["optim"]["lr"] == pytest.approx(3e-6)
    assert math["checkpoint_every"] == 7
    assert math["envs"] == {"toy/add": 1.0}
    assert cfg["vllm"]["max_model_len"] == 4096
    assert cfg["logging"]["wandb"] is True and cfg["logging"]["progress"] is True  # siblings kept
    tiny = yaml.safe_load(here("run", "profile=tiny", "print_config=true").stdout)
    assert cfg["stages"]["rlve"] == tiny["stages"]["rlve"]  # other stages untouched


@dataclasses.dataclass
class _Inner:
    a: int = 0
    b: int = 0


@dataclasses.dataclass
class _Mid:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    c: int = 0


@dataclasses.dataclass
class _Outer:
    mid: _Mid = dataclasses.field(default_factory=lambda: _Mid(_Inner(a=1, b=2), c=3))
    cols: dict[str, int] = dataclasses.field(default_factory=dict)


def test_a_mapping_for_a_section_merges_into_its_configured_default():
    """A setting under a section whose default the schema configures (sft.optim: lr 1e-5, warmup_steps 10, a
    default_factory that cascade.yaml does not spell out) changes that setting only: the others keep the
    configured default, not the plain OptimConfig's (warmup_steps 0)."""
    from cascade.config import load_run_config, parse_overrides
    from train.dataclass_config import build

    for over in (["sft.optim.lr=1e-3"], ["sft.optim={lr: 1e-3}"]):
        cfg, _ = load_run_config(parse_overrides(["stage=warmup", *over]))
        opt = cfg.stages["warmup"].sft.optim
        assert (opt.lr, opt.warmup_steps) == (1e-3, 10), over
    cfg, _ = load_run_config(parse_overrides(["stage=warmup", "sft.optim.warmup_steps=3"]))
    assert (cfg.stages["warmup"].sft.optim.lr, cfg.stages["warmup"].sft.optim.warmup_steps) == (1e-5, 3)
    # an empty mapping is no override: `rl={}` replaced math's configured rl with the schema's (group_size 16 -> 8,
    # muon -> adamw)
    base, _ = load_run_config(parse_overrides(["stage=math"]))
    for over in ("rl={}", "rl.optim={}"):
        cfg, _ = load_run_config(parse_overrides(["stage=math", over]))
        assert cfg.stages["math"].rl == base.stages["math"].rl, over
    assert (base.stages["math"].rl.group_size, base.stages["math"].rl.optim.name) == (16, "muon")
    # recursively, over the enclosing default's own nested values; a dict-typed field is still one value
    out = build(_Outer, {"mid": {"inner": {"b": 5}}, "cols": {"x": 1}})
    assert out == _Outer(_Mid(_Inner(a=1, b=5), c=3), {"x": 1})
    assert build(_Outer, {"mid": {"c": 4}}) == _Outer(_Mid(_Inner(a=1, b=2), c=4))
    assert build(_Mid, {"inner": {"b": 5}}) == _Mid(_Inner(a=0, b=5), c=0)


def test_print_config_of_a_merged_section_round_trips(tmp_path):
    r = here("run", "stage=warmup", "sft.optim.lr=1e-3", "print_config=true")
    assert r.returncode == 0, r.stderr
    opt = yaml.safe_load(r.stdout)["stages"]["warmup"]["sft"]["optim"]
    assert (opt["lr"], opt["warmup_steps"]) == (1e-3, 10)
    f = tmp_path / "printed.yaml"
    f.write_text(r.stdout)
    again = here("run", f"config={f}", "print_config=true")
    assert again.returncode == 0, again.stderr
    assert again.stdout == r.stdout


def test_stage_on_the_command_line_runs_that_stage_over_a_dumped_order_and_a_file_for_another(tmp_path):
    """A print_config dump (which holds ``order``) given with stage=NAME ran the whole cascade; a file written
    for stage rlve given with stage=math put its stage-relative settings on math."""
    dump = tmp_path / "printed.yaml"
    dump.write_text(here("run", "profile=tiny", "print_config=true").stdout)
    cfg = yaml.safe_load(here("run", "stage=rlve", f"config={dump}", "steps=3", "print_config=true").stdout)
    assert cfg["order"] == ["rlve"] and cfg["stages"]["rlve"]["steps"] == 3
    f = tmp_path / "rlve.yaml"
    f.write_text("stage: rlve\nsteps: 7\n")
    r = here("run", "stage=math", f"config={f}", "print_config=true")
    assert r.returncode == 2 and "its settings are for stage 'rlve', but stage=math was given" in r.stderr


def test_overrides_read_as_an_omegaconf_user_expects():
    """``2e-1`` is a number in free-form settings too (YAML 1.1 reads it as a string, which reached the
    controller and failed when its stage started); numbers given to string settings are strings; an ``envs``
    override replaces a stage's ``sources`` and phases (the warm-up has sources: it was refused); the stage's
    aggregation share, set, is every phase's (the phases' own shares hid it)."""
    from cascade.config import load_run_config, parse_overrides

    cfg, _ = load_run_config(parse_overrides(["stage=rlve", "controller_kwargs.explore=2e-1", "trainer.rdzv_id=4242",
                                              "out=2024"]))
    assert cfg.stages["rlve"].controller_kwargs["explore"] == 0.2 and (cfg.trainer.rdzv_id, cfg.out) == ("4242", "2024")
    assert parse_overrides(["a=1e-5", "b=+1E3", "c=1.0.2", "d=.5"]) == {"a": 1e-5, "b": 1000.0, "c": "1.0.2", "d": 0.5}
    cfg, _ = load_run_config(parse_overrides(["stage=warmup", "envs={math/arith: 1}"]))
    st = cfg.stages["warmup"]
    assert (st.envs, st.sources, st.phases) == ({"math/arith": 1.0}, {}, [])
    for over, tiny in ((["stages.math.aggregation.fraction=0.5"], []), (["stages.math.aggregation.fraction=0"],
                                                                        ["profile=tiny"])):
        cfg, _ = load_run_config(parse_overrides(over + tiny))
        st = cfg.stages["math"]
        assert len(st.phases) == 2 and all(p.aggregation is None for p in st.phases), st.phases
    cfg, _ = load_run_config(parse_overrides(["profile=tiny"]))
    assert [p.aggregation for p in cfg.stages["math"].phases] == [0.0, 0.25]  # the profile's own, when not set


def test_a_string_setting_takes_the_override_text_as_written():
    """A setting of type str takes the text after ``=`` itself (it was read as YAML and turned back into text:
    ``2024.10`` -> '2024.1', ``0755`` -> '493', ``#`` began a comment, ``Note: x`` was a mapping, a date a date)."""
    from cascade.config import ConfigError, load_run_config, parse_overrides

    cfg, _ = load_run_config(parse_overrides(["out=2024.10", "rollout.api_key=0755", "stage=math",
                                              "rl.system_prompt=a #b", "trainer.rdzv_id=0x1F"]))
    assert (cfg.out, cfg.rollout.api_key, cfg.trainer.rdzv_id) == ("2024.10", "0755", "0x1F")
    assert cfg.stages["math"].rl.system_prompt == "a #b"
    for text in ("Note: be brief", "- be brief", "Answer after #### like GSM8K"):
        cfg, _ = load_run_config(parse_overrides(["stage=math", f"rl.system_prompt={text}"]))
        assert cfg.stages["math"].rl.system_prompt == text
    cfg, _ = load_run_config(parse_overrides(["out=2024-12-06", "stages.math.sft.columns.prompt=007"]))
    assert (cfg.out, cfg.stages["math"].sft.columns) == ("2024-12-06", {"prompt": "007"})
    # a quoted YAML string is its content, as before; null (or ~) unsets an optional one
    cfg, _ = load_run_config(parse_overrides(["out='runs/x'", 'rollout.api_key="k #1"', "stage=math",
                                              "rl.system_prompt=null", "model=~"]))
    assert (cfg.out, cfg.rollout.api_key, cfg.stages["math"].rl.system_prompt, cfg.model) == ("runs/x", "k #1",
                                                                                              None, None)
    # other settings are read as YAML as before
    assert parse_overrides(["stage=math", "steps=0x1F", "envs={a: 1}"]) == {"stage": "math", "steps": 31,
                                                                         "envs": {"a": 1}}
    with pytest.raises(ConfigError, match=re.escape("stages.math.steps: expected an integer, got '2024-12-06'")):
        load_run_config(parse_overrides(["stage=math", "steps=2024-12-06"]))


def test_a_date_in_a_config_file_is_text(tmp_path):
    """YAML 1.1 reads 2024-12-06 as a date, which failed the config's JSON copy naming neither file nor key."""
    from cascade.config import load_run_config

    f = tmp_path / "date.yaml"
    f.write_text("out: 2024-12-06\nstage: math\nrl: {system_prompt: 2024-12-06 12:00:00}\n")
    cfg, _ = load_run_config({"config": str(f)})
    assert cfg.out == "2024-12-06" and cfg.stages["math"].rl.system_prompt == "2024-12-06 12:00:00"


def test_the_command_line_clears_what_a_config_file_set_as_it_clears_the_profile(tmp_path):
    """A print_config dump (a valid config= file) sets every stage's phases: the command line's aggregation share
    was ignored and its envs refused ("a stage with phases takes its mix from them"), as if the file's phases
    had been given on the command line too."""
    from cascade.config import load_run_config, parse_overrides
    from cascade.stagedata import stage_mixes

    dump = tmp_path / "dump.yaml"
    dump.write_text(here("run", "profile=tiny", "print_config=true").stdout)
    for base in ([], [f"config={dump}"]):
        cfg, _ = load_run_config(parse_overrides(base + ["profile=tiny", "stages.math.aggregation.fraction=0.5"]))
        st = cfg.stages["math"]
        assert st.aggregation.fraction == 0.5 and [p.aggregation for p in st.phases] == [None, None], base
        cfg, _ = load_run_config(parse_overrides(base + ["profile=tiny", "stage=math", "envs={toy/add: 1}"]))
        st = cfg.stages["math"]
        assert (st.envs, st.sources, st.phases) == ({"toy/add": 1.0}, {}, []), base
        assert stage_mixes(st, "math") == [{"toy/add": 1.0}]
        cfg, _ = load_run_config(parse_overrides(base + ["profile=tiny", "stage=warmup",
                                                         "sources={p: {weight: 1, envs: [toy/max]}}"]))
        st = cfg.stages["warmup"]
        assert (st.envs, list(st.sources), st.phases) == ({}, ["p"], []), base
    # the file's own phases still win over the file's own mix, as before
    f = tmp_path / "phases.yaml"
    f.write_text("stage: math\nenvs: {toy/add: 1}\nphases: [{steps: 5, envs: {toy/max: 1}}]\n")
    st = load_run_config({"config": str(f)})[0].stages["math"]
    with pytest.raises(ValueError, match="a stage with phases takes its mix from them"):
        stage_mixes(st, "math")


def test_settings_that_would_fail_when_their_stage_starts_are_refused_before_any_work(tmp_path):
    """Each of these passed every check and failed only when its stage began (after earlier stages had run):
    a missing local SFT file or dataset, an aggregation expert / SFT teacher naming a stage that has not run,
    out-of-range pool and aggregation settings, no sampling round."""
    out = tmp_path / "run"
    for args, msg in [(["stage=behavior", "sft.data=qa_typo.parquet"], "no such file or directory 'qa_typo.parquet'"),
                      (["stage=math", "envs={math: 1}", "env_kwargs.math.path=nope.jsonl"], "no such file"),
                      (["stage=math", "aggregation.expert=behavior"], "stage 'behavior' neither runs before 'math'"),
                      (["stage=warmup", "sft.aggregation.teacher=math"], "stage 'math' neither runs before"),
                      (["stage=math", "aggregation.expert=nosuchdir"], "aggregation.expert"),
                      (["stage=math", "rl.max_sampling_rounds=0"], "max_sampling_rounds must be >= 1"),
                      (["stage=math", "aggregation.fraction=7"], "aggregation shares must be in [0, 1]"),
                      (["stage=math", "pool.samples=0"], "samples >= 1"),
                      (["stage=math", "pool.min_pass_rate=0.9"], "min_pass_rate <= max_pass_rate")]:
        r = here("run", "profile=tiny", f"out={out}", *args)
        assert r.returncode == 2 and msg in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert not (out / "stages").exists()
    # an earlier stage of the same order is fine (checked as far as the config goes: print_config does no work)
    assert here("run", "profile=tiny", f"out={out}", "stages.math.aggregation.expert=warmup",
                "print_config=true").returncode == 0


@pytest.mark.parametrize("text, bad, valid", [
    ("rl:\n  group_sz: 3\n", "stages.math.rl.group_sz", "group_size"),
    ("logging:\n  wandbb: true\n", "logging.wandbb", "wandb_project"),
    ("stages:\n  mathh: {steps: 3}\n", "mathh", "behavior"),
])
def test_a_bad_key_in_the_config_file_is_named_with_the_valid_ones(tmp_path, text, bad, valid):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    r = here("run", "stage=math", f"config={f}", "print_config=true")
    assert r.returncode == 2
    err = r.stderr.strip()
    assert str(f) in err and bad in err and valid in err and "Traceback" not in err
    assert r.stdout == ""


def test_config_file_errors_are_one_line(tmp_path):
    r = here("run", f"config={tmp_path / 'missing.yaml'}", "print_config=true")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    r = here("run", f"config={f}", "print_config=true")
    assert r.returncode == 2 and "must hold a mapping" in r.stderr


@pytest.mark.parametrize("override, msg", [
    ("steps=-3", "steps must be >= 0, got -3"), ("sft.steps=-2", "sft.steps must be >= 0"),
    ("checkpoint_every=0", "checkpoint_every must be >= 1"), ("eval_problems=-1", "eval_problems must be >= 0"),
    ("controller=bogus", "unknown difficulty controller 'bogus'; choose from rlve"),
    ("sampling_mode=bogus", "unknown sampling_mode 'bogus'"),
    ("rl.sampling.temperature=-1", "temperature must be 0 (greedy) or >= 0.01"),
    ("rl.sampling.top_k=-2", "top_k must be >= 0 (0 or -1: off)"),
    ("rl.optim.betas=[0.9]", "betas must be two numbers in [0, 1), got [0.9]"),
    ("rl.optim.lr=-1", "lr must be >= 0, got -1"), ("sft.optim.eps=0", "eps must be > 0, got 0"),
    # settings under which aggregation never happens (accepted: the pool never filled; 0-candidate prompts trained)
    ("aggregation={fraction: 0.5, tails: 9}", "aggregation.tails=9 is more than rl.group_size=8"),
    ("sft.aggregation.tails=0", "sft.aggregation needs 1 <= tails <= samples"),
    ("sft.aggregation.tails=9", "got tails=9, samples=8"),
    ("sft.aggregation.fraction=1.5", "fraction in [0, 1]"),
    # (passed, then failed after init-model/ and the eval before: "no SFT example fits sft.max_len=8192")
    ("sft={steps: 2, examples: 0}", "sft.examples must be >= 1"),
    ("sft={steps: 2, max_len: 0}", "sft.max_len must be >= 2, got 0"),
    # (passed, then failed when the stage started: after the stages before it had run)
    ("aggregation.template=nosuch", "stages.rlve.aggregation: template: unknown template 'nosuch'"),
    ("sft.aggregation.template=nosuch", "stages.rlve.sft.aggregation: template: unknown template 'nosuch'"),
    ("sft={steps: 2, difficulties: []}", "sft.difficulties is empty"),
    ("sft={steps: 2, difficulties: [1, -1]}", "sft.difficulties must be >= 0, got [1, -1]"),
    # a mapping is valid there: the error is the mapping's, not "expected a list"
    ("sft.envs={toy/max: abc}", "stages.rlve.sft.envs.toy/max: expected a number, got 'abc'"),
])
def test_bad_values_fail_when_the_config_is_read(override, msg):
    """Before anything is written (print_config=true catches them too)."""
    from cascade.config import ConfigError, load_run_config, parse_overrides

    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_run_config(parse_overrides(["stage=rlve", "profile=tiny", override]))


def test_good_templates_and_sft_settings_pass(tmp_path):
    from cascade.config import load_run_config, parse_overrides

    f = tmp_path / "t.yaml"
    f.write_text("base: math\n")
    cfg, _ = load_run_config(parse_overrides(["stage=rlve", "profile=tiny", "aggregation.template=generic",
                                              f"sft.aggregation.template={f}", "sft.steps=2", "sft.data=qa.jsonl",
                                              "sft.difficulties=[]"]))
    st = cfg.stages["rlve"]
    assert (st.aggregation.template, st.sft.aggregation.template, st.sft.difficulties) == ("generic", str(f), [])


@pytest.mark.parametrize("override, msg", [
    ("device=quantum", "device='quantum' is not a device torch knows"),
    ("device=cuda:99", "device='cuda:99': this machine's torch sees"),
    ("engine=vllm", "engine=vllm: vLLM is not installed"),
    ("out=FILE", "is a file, not a run directory"),
    # settings read only when the stage builds its curriculum or its SFT data: checked before any stage runs
    ("controller_kwargs={upp: 0.5}", "stages.rlve.controller_kwargs: the zaya controller takes no setting upp; it "
                                     "takes:"),
    ("sft.envs={toy/maxx: 1}", "unknown environment 'toy/maxx'"),
    # a value the controller refuses (built once now, as the stage builds it): failed when the stage started
    ("controller_kwargs.explore=0.7", "stages.rlve.controller_kwargs: explore must be in (0, 0.5), got 0.7"),
    ("controller_kwargs.up=abc", "stages.rlve.controller_kwargs: could not convert string to float: 'abc'"),
    ("controller_kwargs={tau_prompts: 0}", "stages.rlve.controller_kwargs: tau_num must be >= 1, got 0"),
])
def test_what_the_machine_lacks_fails_before_any_work(tmp_path, override, msg):
    import importlib.util

    from cascade.run import main

    if override == "engine=vllm" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    (tmp_path / "FILE").write_text("")
    out = tmp_path / "run"
    override = override.replace("FILE", str(tmp_path / "FILE"))
    args = ["stage=rlve", "profile=tiny", f"out={out}", override] if not override.startswith("out=") else \
        ["stage=rlve", "profile=tiny", override]
    if "tau_prompts" in override:  # rlve's window: tau_prompts x the stage's rl.group_size rollouts
        args.append("controller=rlve")
    with pytest.raises((ValueError, KeyError), match=re.escape(msg)):  # (both one line: cascade.cli.USER_ERRORS)
        main(args)
    assert not out.exists()


def test_a_bad_controller_setting_of_a_later_stage_fails_before_the_first_stage_runs(tmp_path):
    """The value was refused only when its stage built its curriculum, hours of earlier stages later."""
    from cascade.run import main

    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape("stages.behavior.controller_kwargs: explore must be in (0, 0.5)")):
        main(["profile=tiny", f"out={out}", "order=[warmup, behavior]", "stages.behavior.controller_kwargs.explore=0.7"])
    assert not out.exists()


def test_cascade_run_refuses_an_empty_model(tmp_path):
    """An empty model= (an unset $CKPT) trained a fresh model_preset policy; cascade eval already refused it."""
    from cascade.run import main

    out = tmp_path / "run"
    f = tmp_path / "c.yaml"
    f.write_text("model: ''\n")
    for args in (["model="], [f"config={f}"]):
        with pytest.raises(ValueError, match=re.escape("model= is empty (an unset variable?)")):
            main([*args, "profile=tiny", f"out={out}", "stage=warmup", "sft.steps=1", "sft.examples=50", "steps=1",
                  "eval_problems=2", "pool.size=0"])
        assert not out.exists()


def test_order_refuses_a_repeated_stage():
    """order=[warmup, warmup] ran warmup once and reported it twice."""
    from cascade.config import load_run_config, parse_overrides

    with pytest.raises(ValueError, match=re.escape("order names warmup more than once")):
        load_run_config(parse_overrides(["profile=tiny", "order=[warmup, rlve, warmup]"]))


def test_overwrite_checks_refs_against_the_fresh_run(tmp_path):
    """With overwrite=true the up-front checks counted the old run's finished stages, which overwrite then deleted:
    the stage failed later, with the old run gone."""
    import socket

    out = tmp_path / "run"
    _old_run(out)
    (out / "stages" / "0-warmup" / "final" / "COMPLETE").write_text("")
    r = here("run", "profile=tiny", f"out={out}", "stage=math", "aggregation.expert=warmup", "overwrite=true")
    assert r.returncode == 2 and "stage 'warmup' neither runs before 'math'" in r.stderr, r.stderr
    assert (out / "stages" / "0-warmup" / "final" / "COMPLETE").exists() and (out / "metrics.jsonl").exists()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = here("run", "profile=tiny", f"out={out}", "stage=warmup", f"rollout.urls=[http://127.0.0.1:{port}]",
             "overwrite=true")  # warmup finished in the old run: its servers were not checked
    assert r.returncode == 2 and "rollout.urls:" in r.stderr, r.stderr
    assert (out / "stages" / "0-warmup" / "final" / "COMPLETE").exists() and (out / "metrics.jsonl").exists()


def test_other_commands_refuse_bad_input_in_one_line(tmp_path, capsys):
    from cascade.cli import main

    f = tmp_path / "a-file"
    f.write_text("")
    for argv, msg in [(["init-model", "--preset", "tiny-dense", "--out", str(f)], "File exists"),
                      (["sandbox", "run", str(tmp_path)], "is a directory, not a file"),
                      (["calc", "--preset", "tiny-moe", "--hidden", "256", "--seq", "128", "--D", "2"],
                       "give the model one way"),
                      (["calc", "--preset", "tiny-moe", "--seq", "128", "--D", "2", "--bytes", "0"], "--bytes"),
                      (["sandbox"], "required: {run,judge,layers}")]:
        with pytest.raises(SystemExit) if argv == ["sandbox"] else contextlib.nullcontext():
            assert main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err)


def test_cascade_debug_shows_the_traceback_behind_a_one_line_error(tmp_path, capsys, monkeypatch):
    """CASCADE_DEBUG=1 (README) re-raises the error behind the one-line message, for cascade and for ttc."""
    from cascade.cli import main as cascade_main
    from ttc.cli import main as ttc_main

    missing = str(tmp_path / "missing")
    assert cascade_main(["report", missing]) == 2 and ttc_main(["solve", "--problem", "x", "--model", missing]) == 2
    monkeypatch.setenv("CASCADE_DEBUG", "1")
    for run in (lambda: cascade_main(["report", missing]),
                lambda: ttc_main(["solve", "--problem", "x", "--model", missing])):
        with pytest.raises((FileNotFoundError, ValueError)):
            run()


def test_a_finished_run_needs_no_rollout_servers_to_be_rerun(tmp_path):
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import _all_finished

    cfg, tree = load_run_config(parse_overrides(["stage=rlve", "profile=tiny", "rollout.urls=[http://127.0.0.1:1]",
                                                 "rollout.api_key=K"]))
    assert not _all_finished(cfg, tree, tmp_path)  # so the servers are checked before any work
    final = tmp_path / "stages" / f"{list(tree['stages']).index('rlve')}-rlve" / "final"
    final.mkdir(parents=True)
    (final / "COMPLETE").write_text("ok\n")
    assert _all_finished(cfg, tree, tmp_path)  # nothing left to run: gone servers are not an error


def _fails(argv):
    from train.engine.remote import RemoteError

    raise RemoteError("every rollout server went down; 8 of 8 prompts unanswered")


def _interrupted(argv):
    raise KeyboardInterrupt


def test_a_run_that_fails_outside_this_process_or_is_interrupted_ends_without_a_traceback(capsys):
    """A server or the trainer ranks gone (RunFailure), or Ctrl-C: what happened and that the same command
    resumes, exit 1 / 130 (they were tracebacks of up to 80 lines)."""
    from cascade.cli import dispatch

    table = {"run": ("tests.test_run_options:_fails", ""), "stop": ("tests.test_run_options:_interrupted", "")}
    assert dispatch(table, ["run"], "", "cascade") == 1
    err = capsys.readouterr().err
    assert err.startswith("cascade run: failed: every rollout server went down") and "resumes" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert dispatch(table, ["stop"], "", "cascade") == 130
    assert capsys.readouterr().err == "cascade stop: interrupted\n"
    table["run"] = table["stop"]  # `run` interrupted: one line, with how to resume
    assert dispatch(table, ["run"], "", "cascade") == 130
    assert capsys.readouterr().err == "cascade run: interrupted; the same command resumes from the last complete " \
                                      "checkpoint\n"


def test_a_rerun_with_other_settings_says_what_changed(tmp_path, capsys):
    import yaml as y

    from cascade.run import _warn_changed

    old = {"out": "x", "stages": {"rlve": {"steps": 3, "rl": {"group_size": 8}}, "math": {"steps": 4}}}
    (tmp_path / "config.yaml").write_text(y.safe_dump(old))
    (tmp_path / "stages" / "1-rlve" / "final").mkdir(parents=True)
    (tmp_path / "stages" / "1-rlve" / "final" / "COMPLETE").write_text("ok\n")
    _warn_changed(tmp_path, old)
    assert capsys.readouterr().err == ""
    new = {"out": "x", "stages": {"rlve": {"steps": 5, "rl": {"group_size": 8}}, "math": {"steps": 6}}}
    _warn_changed(tmp_path, new)
    err = capsys.readouterr().err
    assert "stages.math.steps: 4 -> 6, stages.rlve.steps: 3 -> 5" in err
    assert "finished stage(s) rlve keep what they ran" in err and err.count("\n") == 1
    assert "resume from a checkpoint" not in err
    (tmp_path / "stages" / "2-math" / "checkpoints" / "step-00000002").mkdir(parents=True)  # math in progress
    _warn_changed(tmp_path, new)
    err = capsys.readouterr().err
    assert ("stage(s) math resume from a checkpoint with the curriculum (mix weights, levels) and optimizer state it "
            "holds, its peak learning rate") in err
    _warn_changed(tmp_path, dict(new, trainer={"nproc": 2}))  # a section the last run left at its defaults
    assert "trainer.nproc: (default) -> 2" in capsys.readouterr().err


# -- resume=false / overwrite=true ----------------------------------------------------------------
def _old_run(out: Path) -> None:
    (out / "stages" / "0-warmup" / "final").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "config.yaml").write_text("out: x\n")
    (out / "wandb-run-id").write_text("abc123\n")
    (out / "notes.txt").write_text("the user's own file\n")


def test_resume_false_refuses_a_directory_holding_a_run(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    r = here("run", "profile=tiny", f"out={out}", "resume=false")
    assert r.returncode == 2
    assert "holds a previous run" in r.stderr and "overwrite=true" in r.stderr and "out=" in r.stderr
    assert (out / "metrics.jsonl").exists() and (out / "stages").exists()  # nothing touched
    r = here("run", "profile=tiny", f"out={out}", "resume=maybe")
    assert r.returncode == 2 and "resume must be true or false" in r.stderr


def test_overwrite_deletes_only_the_runs_files(tmp_path):
    from cascade.run import previous_run, start_fresh

    out = tmp_path / "run"
    _old_run(out)
    with pytest.raises(ValueError, match="would delete model="):
        start_fresh(out, True, model=str(out / "stages" / "0-warmup" / "final"))
    assert previous_run(out)
    start_fresh(out, True, model=str(tmp_path / "elsewhere"))
    assert previous_run(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    start_fresh(tmp_path / "new", False)  # resume=false on a fresh directory: nothing to refuse


# -- W&B: one run across resumes, step on one axis ------------------------------------------------
class _FakeWandb(types.ModuleType):
    """Records init/log/finish calls as the wandb module would receive them."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, data, step=None, **kw):
        assert step is not None, "wandb.log without step"
        self.logs.append((step, dict(data)))

    def finish(self):
        self.finished += 1


def test_wandb_keeps_one_run_id_across_resumes_and_logs_steps(tmp_path, monkeypatch):
    from cascade.config import load_run_config
    from cascade.records import Records
    from cascade.run import step_offsets

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg, tree = load_run_config({"profile": "tiny", "stages.warmup.sft.steps": 2, "stages.warmup.steps": 3})
    offsets = step_offsets(cfg, list(tree["stages"]))
    assert offsets["warmup"] == 0 and offsets["rlve"] == 5
    assert offsets["math"] == 5 + cfg.stages["rlve"].sft.steps + cfg.stages["rlve"].steps

    out = tmp_path / "run"
    rec = Records(out, wandb=True, project="p", config=tree, step_offsets=offsets)
    rec.log("warmup", "eval", 0, {"accuracy_before": 0.1})
    rec.log("warmup", "sft", 0, {"sft_loss": 2.0})
    rec.log("warmup", "sft", 1, {"sft_loss": 1.5})
    rec.log("warmup", "pool", 0, {"pool_kept": 7})   # measured after SFT, recorded at step 0
    rec.log("warmup", "rl", 2, {"reward_mean": 0.5})
    rec.close()                                      # the process ends (or is killed) here
    rid = (out / "wandb-run-id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{8}", rid)
    assert fake.inits[0]["id"] == rid and fake.inits[0]["resume"] == "allow" and fake.inits[0]["project"] == "p"

    rec = Records(out, wandb=True, project="p", config=tree, step_offsets=offsets)  # `cascade run` again: resume
    rec.log("warmup", "rl", 3, {"reward_mean": 0.6})
    rec.log("rlve", "rl", 0, {"reward_mean": 0.2})
    rec.close()
    assert [i["id"] for i in fake.inits] == [rid, rid]  # the same W&B run, not a new one
    steps = [s for s, _ in fake.logs]
    assert steps == [0, 0, 1, 1, 2, 3, 5]
    assert steps == sorted(steps)  # W&B drops a step that goes back
    assert fake.logs[-1] == (5, {"rlve/rl/reward_mean": 0.2})
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 7  # metrics.jsonl keeps its own steps
    assert fake.finished == 2


# -- progress on the long phases -------------------------------------------------------------------
class _Bars:
    """The part of rich.progress.Progress a stage uses, recording what it shows."""

    def __init__(self):
        self.tasks, self.live = {}, set()

    def add_task(self, description, total=None, completed=0, **fields):
        tid = len(self.tasks)
        self.tasks[tid] = {"description": description, "total": total, "completed": completed, **fields}
        self.live.add(tid)
        return tid

    def advance(self, tid, k=1):
        self.tasks[tid]["completed"] += k

    def update(self, tid, **kw):
        self.tasks[tid].update(kw)

    def remove_task(self, tid):
        self.live.discard(tid)


class _Oracle:
    """An engine that answers a chosen set of problems right: the reference response for a prompt
    that holds one of them, a wrong answer otherwise."""

    def __init__(self, tok, solve: dict[str, str]):
        self.tok, self.solve, self.calls = tok, solve, []

    def generate(self, prompts, params, **kw):
        from train.engine.base import Completion

        self.calls.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            hit = self.solve.get(self.tok.decode(p).strip(), "\\boxed{-1}")
            for _ in range(params.n):
                out.append(Completion([1], hit, [0.0], "stop", prompt_index=i))
        return out


def _stage(progress, scfg=None):
    from cascade.config import RunConfig, StageConfig
    from cascade.stage import StageRunner

    return StageRunner("math", 2, scfg or StageConfig(), RunConfig(order=[]), Path("/nonexistent"), None, progress)


def test_evaluation_and_pool_filter_show_progress_with_unchanged_results(tiny_dense_dir):
    from cascade.pool import filter_by_pass_rate
    from envs.base import get_env
    from envs.curriculum import Curriculum
    from train.model.hf_io import load_pretrained
    from train.rl.trainer import RLConfig, RLTrainer
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    env = get_env("toy/add")
    held = [("toy/add", env.generate(100 + i, 1)) for i in range(11)]
    long = held[3][1]
    held[3] = ("toy/add", dataclasses.replace(long, prompt=long.prompt + " pad" * 400))
    solved = {p.prompt: env.reference_response(p) for i, (_, p) in enumerate(held) if i % 3 == 0}
    eng = _Oracle(tok, solved)
    cur = Curriculum(["toy/add"], controller="fixed", seed=0, controller_kwargs={"difficulty": 1})
    rl = RLTrainer(load_pretrained(tiny_dense_dir), tok, eng, cur,
                   RLConfig(group_size=2, prompts_per_step=2, chat_template=False, max_prompt_tokens=200))
    one_call = rl.evaluate(held)
    fits = [i for i in range(11) if i != 3]
    assert one_call == pytest.approx(sum(i % 3 == 0 for i in fits) / len(fits))  # 3 of 10 (problem 3: too long)

    bars = _Bars()
    stage = _stage(bars)
    eng.calls.clear()
    assert stage.evaluate(rl, held, "before") == one_call
    assert eng.calls == [3, 4, 3]             # one RL step's rollouts (2 x 2) per engine call, the long one skipped
    (t,) = bars.tasks.values()
    assert t["description"] == "eval" and t["total"] == 11 and t["completed"] == 11 and "math" in t["info"]
    assert not bars.live                       # the bar goes when the phase ends

    # pool filter: chunks of one RL step's rollouts, kept problems aligned even when one is skipped
    eng.calls.clear()
    seen = []
    kept, rates = filter_by_pass_rate(rl, held, 2, max_pass_rate=0.5, chunk=stage.chunk(rl, 2), advance=seen.append)
    assert eng.calls == [2, 1, 2, 2, 2, 1] and seen == [2, 2, 2, 2, 2, 1]
    assert len(rates) == 10
    assert [p.prompt for _, p in kept] == [held[i][1].prompt for i in fits if i % 3]


def test_sft_data_building_shows_progress(tiny_dense_dir):
    from cascade.config import SFTStage, StageConfig
    from train.model.hf_io import load_pretrained
    from train.sft import SFTConfig, SFTTrainer, reference_pairs
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(steps=1, max_len=512, chat_template=False))
    bars = _Bars()
    scfg = StageConfig(envs={"toy/add": 1.0}, sft=SFTStage(steps=1, examples=300, envs=["toy/add"]))
    stage = _stage(bars, scfg)

    class _Recs:
        def __init__(self):
            self.logged = []

        def log(self, *a):
            self.logged.append(a)

    stage.records = _Recs()
    enc = stage.sft_examples(sft, tok, None)
    direct = sft.encode(reference_pairs(["toy/add"], 300, seed=stage.rcfg.seed + stage.index, difficulties=[0, 1, 2]))
    assert enc == direct                        # the same examples as without the bars
    assert [(t["total"], t["completed"]) for t in bars.tasks.values()] == [(300, 300), (300, 300)]
    assert not bars.live
    assert stage.records.logged[0][1] == "sft_data"


# -- engine=vllm options ---------------------------------------------------------------------------
def test_vllm_options_reach_the_engine_constructor(monkeypatch, tmp_path):
    import inspect

    import train.engine.vllm_engine as ve
    from cascade.config import ConfigError, load_run_config
    from cascade.stage import make_engine

    got = {}

    class Recorder:
        def __init__(self, model_path, **kw):
            got["path"], got["kw"] = model_path, kw

    cfg, _ = load_run_config({"engine": "vllm", "dtype": "bfloat16", "vllm.gpu_memory_utilization": 0.45,
                              "vllm.tensor_parallel_size": 2, "vllm.max_model_len": 8192,
                              "vllm.extra": {"enforce_eager": True, "swap_space": 0}})
    real = inspect.signature(ve.VLLMEngine.__init__).parameters
    monkeypatch.setattr(ve, "VLLMEngine", Recorder)
    make_engine(cfg, tmp_path, None, None)
    assert got["path"] == str(tmp_path)
    assert got["kw"] == {"dtype": "bfloat16", "gpu_memory_utilization": 0.45, "tensor_parallel_size": 2,
                         "max_model_len": 8192, "enforce_eager": True, "swap_space": 0}
    # the real constructor takes each: named, or through **llm_kwargs on to vllm.LLM
    assert any(p.kind is p.VAR_KEYWORD for p in real.values())
    for k in ("dtype", "gpu_memory_utilization", "max_model_len", "enforce_eager"):
        assert k in real
    cfg, _ = load_run_config({"engine": "vllm"})
    make_engine(cfg, tmp_path, None, None)
    assert got["kw"] == {"dtype": "float32", "tensor_parallel_size": 1}  # unset: vLLM's own defaults
    for bad, msg in [({"vllm.gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                     ({"vllm.tensor_parallel_size": 0}, "tensor_parallel_size"),
                     ({"vllm.extra": {"max_model_len": 3}}, "use vllm.<key>"),
                     ({"vllm.gpu_mem": 0.5}, "valid keys: extra, gpu_memory_utilization")]:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            load_run_config(bad)


# -- CLI help and JSON -----------------------------------------------------------------------------
def test_subcommand_help_names_the_command_and_has_no_markup():
    for cmd, usage in [("serve", "usage: cascade serve"), ("sandbox", "usage: cascade sandbox"),
                       ("envs", "usage: cascade envs"), ("run", "usage: cascade run")]:
        r = cascade(cmd, "--help")
        assert r.returncode == 0, (cmd, r.stderr)
        assert r.stdout.startswith(usage), (cmd, r.stdout[:80])
        assert "``" not in r.stdout and "[bold" not in r.stdout and "[/" not in r.stdout, cmd
    r = subprocess.run([sys.executable, "-m", "ttc", "serve", "--help"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.stdout.startswith("usage: ttc serve"), r.stdout[:80]
    r = cascade("run", "--help")
    for key in ("config=FILE.yaml", "print_config=true", "resume=false", "overwrite=true"):
        assert key in r.stdout


def test_envs_list_json_and_family_by_namespace():
    r = cascade("envs", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) > 100 and {"id", "family", "description"} <= set(rows[0])
    gym = [x["id"] for x in rows if x["id"].startswith("gym/")]
    r = cascade("envs", "list", "--family", "gym", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(x["id"] for x in json.loads(r.stdout)) == sorted(gym) and gym
    r = cascade("envs", "list", "gym/*", "--family", "graphs", "--json")
    got = json.loads(r.stdout)
    assert got and all(x["id"].startswith("gym/") and x["family"] == "graphs" for x in got)
    r = cascade("envs", "list", "--family", "gymm")
    assert r.returncode == 2 and "gym" in r.stderr and "graphs" in r.stderr  # names the families there are
    r = cascade("envs", "list", "gym/sudokux")  # a typo: an error naming the close ids (was an empty table, exit 0)
    assert r.returncode == 2 and "did you mean gym/sudoku" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_output_piped_into_head_ends_quietly():
    r = subprocess.run(f"{sys.executable} -m cascade envs list --json | head -1", shell=True, cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert r.stdout == "[\n" and "error" not in r.stderr and "Traceback" not in r.stderr


# -- dependencies as used --------------------------------------------------------------------------
def _requirements():
    import tomllib

    from packaging.requirements import Requirement

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_norm(Requirement(r).name): Requirement(r) for r in proj["dependencies"]}
    extras = {_norm(Requirement(r).name) for rs in proj["optional-dependencies"].values() for r in rs}
    return core, extras


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports():
    """(top-level module, at module level outside try?) for every import in the packages."""
    local = {"cascade", "envs", "train", "ttc", "tests"}
    out = []
    for pkg in ("cascade", "envs", "train", "ttc"):
        for f in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(f.read_text())
            guarded = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.If)):
                    guarded |= {id(n) for n in ast.walk(node) if n is not node}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    top = n.split(".")[0]
                    if top not in local and top not in sys.stdlib_module_names and top != "__future__":
                        out.append((top, id(node) not in guarded, f.relative_to(ROOT)))
    return out


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_declared_dependencies_are_the_ones_imported():
    from importlib.metadata import packages_distributions

    core, extras = _requirements()
    dists = packages_distributions()
    imported_core, missing = set(), []
    for mod, top_level, where in _imports():
        names = {_norm(d) for d in dists.get(mod, [])}
        if not names:
            continue  # an optional package not installed here (vllm, ...): declared in an extra, checked below
        if top_level and not names & set(core):
            missing.append(f"{mod} ({where}, imported at module level) is not a core dependency")
        elif not names & (set(core) | extras):
            missing.append(f"{mod} ({where}) is declared nowhere")
        imported_core |= names & set(core)
    assert not missing, missing
    assert "numpy" in core
    build_only = {"ninja"}  # torch's C++ extension builder runs it; never imported
    unused = set(core) - imported_core - build_only
    assert not unused, f"declared but never imported: {sorted(unused)}"
    assert "omegaconf" not in core


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_transformers_floor_loads_the_tokenizers_cascade_saves(tmp_path):
    """A saved tokenizer names its class; the declared transformers floor must have it."""
    import transformers
    from packaging.version import Version

    from train.presets import init_model

    init_model("tiny-dense", tmp_path, seed=0)
    cls = json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
    assert cls == "TokenizersBackend" and hasattr(transformers, cls)
    core, _ = _requirements()
    floors = [Version(s.version) for s in core["transformers"].specifier if s.operator in (">=", "==", "~=")]
    assert floors and min(floors) >= Version("5.0")  # 4.x has no TokenizersBackend
    assert Version(transformers.__version__) >= min(floors)
    torch_spec = str(core["torch"].specifier)
    assert "==" not in torch_spec and "+" not in torch_spec  # never pins a build over the one installed first


def test_saved_tokenizer_keeps_think_delimiters_when_special_tokens_are_skipped(tmp_path):
    """As Qwen3's: <think> and </think> are added tokens, not special ones, so a decode that skips special
    tokens (vLLM's and the server's default) keeps them; the chat tokens are still skipped."""
    from train.tokenizer import load_tokenizer
    from train.presets import init_model

    init_model("tiny-dense", tmp_path, seed=0)
    tok = load_tokenizer(tmp_path)
    text = "<think>\nabc\n</think>\nThe answer is 4"
    ids = tok.encode(text + "<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<think>") == 3 and tok.convert_tokens_to_ids("</think>") == 4
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert set(tok.all_special_ids) == {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}


def test_make_setup_shows_download_progress():
    r = subprocess.run(["make", "-n", "setup", f"VENV={ROOT / 'no-such-venv'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pips = [ln for ln in r.stdout.splitlines() if "pip install " in ln]
    assert len(pips) == 2 and "torch==" in pips[0]  # torch first, with its pinned build
    for ln in pips:
        assert " -q" not in ln and "--quiet" not in ln and "--progress-bar off" not in ln


def test_small_profile_runs_every_stage(tmp_path):
    """`profile=small` (the larger policy, longer stages) resolves and runs: one SFT and one RL step per stage, of 2
    prompts (16 rollouts, 32 in the behavior stage, which trains on them: the profile's 16 and 8 took 45 s alone
    instead of 17). On one thread (the profile's two took 211-300 s instead of 20 s beside two busy test workers:
    OpenMP's threads wait for each other on shared cores)."""
    out = tmp_path / "run"
    r = cascade("run", "profile=small", f"out={out}", "logging.progress=false", "threads=1",
                "stages.warmup.sft.steps=1", "stages.warmup.sft.examples=64", "stages.warmup.pool.size=4",
                "stages.math.pool.size=4",
                *[f"stages.{s}.{k}" for s in ("warmup", "rlve", "math", "behavior")
                  for k in ("steps=1", "eval_problems=4", "rl.prompts_per_step=2")])
    assert r.returncode == 0, r.stderr[-2000:]
    state = json.loads((out / "stages" / "3-behavior" / "final" / "run_state.json").read_text())
    assert state["steps"] == 1
    assert json.loads((out / "init-model" / "config.json").read_text())["hidden_size"] == 256  # mini-moe
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("stage") == "behavior" and "loss" in x for x in records)  # an update of the policy ran


def test_the_after_score_is_of_the_final_policy_whatever_the_sync_schedule(tmp_path, monkeypatch):
    """rl.sync_every=2 with 3 RL steps: the engine's last sync is one update behind the policy final/ holds; the
    held-out score after the stage must be the final policy's (it was the weights of the update before)."""
    import cascade.evaluation as evaluation
    from cascade.run import main

    seen = []
    real = evaluation.avg_at_k

    def spy(rl, *a, **kw):
        eng = dict(rl.engine.model.named_parameters())
        diff = max((p.detach() - eng[n].detach()).abs().max().item() for n, p in rl.policy.named_parameters())
        seen.append((rl.step_idx, rl.synced_version, diff))
        return real(rl, *a, **kw)

    monkeypatch.setattr(evaluation, "avg_at_k", spy)
    main(["stage=warmup", "profile=tiny", f"out={tmp_path / 'run'}", "logging.progress=false", "sft.steps=0",
          "steps=3", "rl.sync_every=2", "rl.dynamic_sampling=false", "pool.size=0", "eval_problems=2", "eval_k=0"])
    assert seen == [(0, 0, 0.0), (3, 3, 0.0)], seen  # before and after: the engine holds the policy's version
    final = tmp_path / "run" / "stages" / "0-warmup" / "final"
    assert json.loads((final / "run_state.json").read_text())["steps"] == 3


def test_cascade_eval_scores_a_checkpoint_as_its_stage_did(warm, tmp_path, capsys):
    """``cascade eval`` on a stage's start model and on its final/ gives the held-out scores the stage recorded
    before and after (the same problems, levels, seed and sampling), per family too; bad invocations are one line."""
    from cascade.evaluation import main as eval_main
    from cascade.run import main as run_main
    from train.model.hf_io import save_pretrained

    _, tok, model = warm
    start = tmp_path / "warm"
    save_pretrained(model, start, tokenizer=tok)
    stage = ["stage=rlve", "profile=tiny", "logging.progress=false", "envs={toy/max: 1}", "controller=fixed",
             "controller_kwargs={difficulty: 1}", "rl.chat_template=false", "rl.sampling.max_new_tokens=10",
             "rl.dynamic_sampling=false", "rl.optim.lr=1e-3", "eval_problems=12", "seed=3"]
    run_main([f"out={tmp_path / 'run'}", f"model={start}", "steps=2", *stage])
    final = tmp_path / "run" / "stages" / "1-rlve" / "final"
    st = json.loads((final / "run_state.json").read_text())
    capsys.readouterr()
    for model_dir, acc, fams in ((start, st["accuracy_before"], st["accuracy_before_by_family"]),
                                 (final, st["accuracy_after"], st["accuracy_after_by_family"])):
        assert eval_main([f"model={model_dir}", *stage]) == 0
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (got["stage"], got["accuracy"], got["families"], got["k"]) == ("rlve", acc, fams, st["eval_k"])
        assert got["problems"] == {"toy": 12} and got["difficulty"] == {"toy/max": 1}
    assert 0 < st["accuracy_before"] < 1 or 0 < st["accuracy_after"] < 1, st  # scores that can tell runs apart
    for argv, msg in ((stage, "cascade eval needs model=PATH"),
                      ([f"model={start}", "resume=false"], "`cascade run` switch")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            eval_main(argv)


def test_cascade_eval_needs_a_model_from_the_command_line_or_a_config_file(tmp_path):
    """An empty model= (an unset $CKPT) scored a freshly initialised policy; a config file's model was refused."""
    from cascade.evaluation import main as eval_main

    for empty in ("model=", "model=null"):
        with pytest.raises(ValueError, match=re.escape("cascade eval needs model=PATH")):
            eval_main([empty, "stage=warmup", "profile=tiny"])
    f = tmp_path / "eval.yaml"
    f.write_text("model: some/dir\nstage: warmup\neval_problems: 0\n")
    with pytest.raises(ValueError, match=re.escape("stage warmup: eval_problems=0 leaves nothing to score")):
        eval_main([f"config={f}", "profile=tiny"])  # past the model check: the file's model is taken


def test_servers_started_beside_the_trainer_on_too_few_cores_are_noted():
    """rollout.servers on this CPU machine with the in-process trainer: a note when servers' threads and the
    trainer's outnumber the cores, none when they fit, for servers elsewhere, or trainer ranks."""
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import shared_cores_note

    def cfg(*over):
        return load_run_config(parse_overrides(["profile=tiny", *over]))[0]

    note = shared_cores_note(cfg("rollout.servers=1"), cores=2, trainer_threads=2)
    assert note and "rollout.servers=1 x rollout.threads=1 and the trainer's 2 torch thread(s)" in note
    assert "2 core(s)" in note and "rollout.urls" in note
    assert shared_cores_note(cfg("rollout.servers=1"), cores=4, trainer_threads=2) is None
    assert shared_cores_note(cfg(), cores=2, trainer_threads=2) is None
    assert shared_cores_note(cfg("rollout.servers=1", "trainer.nproc=2"), cores=2, trainer_threads=2) is None
    assert shared_cores_note(cfg("rollout.servers=1"), cores=3, trainer_threads=2) is None  # 1 x 1 + 2 fit 3 cores
    assert shared_cores_note(cfg("rollout.servers=2", "rollout.threads=2"), cores=6, trainer_threads=3)  # 4 + 3 > 6
    assert shared_cores_note(cfg("rollout.servers=1", "rollout.backend=vllm"), cores=2, trainer_threads=2) is None


def test_a_run_training_on_code_fails_before_any_work_where_the_sandbox_cannot_run(tmp_path, monkeypatch):
    """The tiny math stage trains on code/solve: without bubblewrap (simulated) `cascade run` stops in its
    pre-run checks with the sandbox's message, not with every code answer scored 0 in the third stage. SFT
    from reference answers refuses an environment that has none (C++ prompts over Python references)."""
    from cascade.config import ConfigError
    from cascade.run import main
    from envs.code import sandbox as sbx
    from train.sft import reference_pairs

    monkeypatch.setattr(sbx.Sandbox, "missing", lambda self: {"namespaces": "bwrap is not installed (simulated)"})
    monkeypatch.delenv(sbx.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError, match="stage math trains on code/io_predict.*bwrap is not installed"):
        main(["profile=tiny", f"out={tmp_path / 'run'}", "logging.progress=false", "stage=math"])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="code/solve has no reference answer"):
        reference_pairs(["toy/add", "code/solve"], 2, env_kwargs={"code/solve": {"language": "cpp"}})


# -- the orchestrator's helpers, checked directly ---------------------------------------------------------
def _finished(out: Path, *dirs: str) -> None:
    for d in dirs:
        (out / "stages" / d / "final").mkdir(parents=True)
        (out / "stages" / d / "final" / "COMPLETE").write_text("ok\n")


def test_a_stage_starts_from_the_latest_earlier_stage_finished_in_the_run_directory(tmp_path):
    from cascade.run import _previous_final

    assert _previous_final(None, tmp_path, 2) is None  # nothing finished (no stages/ at all)
    _finished(tmp_path, "0-warmup")
    (tmp_path / "stages" / "1-rlve" / "final").mkdir(parents=True)  # rlve's final/ not complete
    assert _previous_final(None, tmp_path, 0) is None
    assert _previous_final(None, tmp_path, 1) == tmp_path / "stages" / "0-warmup" / "final"
    assert _previous_final(None, tmp_path, 3) == tmp_path / "stages" / "0-warmup" / "final"
    _finished(tmp_path, "2-math")
    assert _previous_final(None, tmp_path, 3) == tmp_path / "stages" / "2-math" / "final"
    assert _previous_final(None, tmp_path, 2) == tmp_path / "stages" / "0-warmup" / "final"


def test_only_the_first_stage_about_to_start_from_another_init_model_is_refused(tmp_path):
    """``_check_init_model``: an init-model/ marked "ok" (written before the marker said what made it) or made
    with this run's settings is taken; one made otherwise is refused for the first stage of ``order`` when that
    stage would start from it, not when it resumes from its own checkpoint, and never for a later stage."""
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import _check_init_model

    cfg, tree = load_run_config(parse_overrides(["profile=tiny"]))
    marker = tmp_path / "init-model" / "COMPLETE"
    marker.parent.mkdir()
    for made in ("ok", f"model_preset={cfg.model_preset} seed={cfg.seed}"):
        marker.write_text(made + "\n")
        _check_init_model(cfg, tree, tmp_path)
    marker.write_text("model_preset=other seed=0\n")
    with pytest.raises(ValueError, match="stage warmup would start from .*made with model_preset=other seed=0"):
        _check_init_model(cfg, tree, tmp_path)
    step = tmp_path / "stages" / "0-warmup" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    with pytest.raises(ValueError, match="stage warmup"):  # an incomplete checkpoint is nothing to resume
        _check_init_model(cfg, tree, tmp_path)
    (step / "COMPLETE").write_text("ok\n")
    _check_init_model(cfg, tree, tmp_path)  # warmup resumes from its own; rlve, math, behavior start after it
    cfg.model = str(tmp_path / "elsewhere")  # model=: init-model/ is not used
    step.joinpath("COMPLETE").unlink()
    _check_init_model(cfg, tree, tmp_path)


def test_the_final_table_line_of_a_stage():
    from cascade.run import difficulty_rise, stage_line

    s = {"stage": "rlve", "steps": 4, "eval_k": 4, "accuracy_before": 0.25, "accuracy_after": 0.5,
         "eval_difficulty": None, "accuracy_before_by_family": {"toy": 0.25},
         "difficulty_start": {"toy/add": 0, "toy/max": 2, "toy/new": 0},
         "difficulty": {"toy/add": [1, 3], "toy/max": 2, "toy/new": 1},
         "difficulty_max": {"toy/add": 4, "toy/max": 2}}
    rows, rose = difficulty_rise(s)  # (a level missing from difficulty_max: its end level is its highest)
    assert rows == {"toy/add": (0, 3, 4), "toy/max": (2, 2, 2), "toy/new": (0, 1, 1)} and rose == 2
    assert stage_line(s) == ("     rlve: 4 steps, held-out avg@4 0.25 -> 0.50 (at the start levels); difficulty rose on "
                             "2 of 3: toy/add 0->3 (max 4), toy/max 2->2, toy/new 0->1")
    del s["accuracy_before_by_family"]  # (a run_state written before the key: scored)
    assert stage_line({**s, "eval_k": 0, "eval_difficulty": 2}).startswith(
        "     rlve: 4 steps, held-out greedy accuracy 0.25 -> 0.50 (at difficulty 2); difficulty rose on 2 of 3:")
    assert ("all 3 held-out prompts skipped (longer than rl.max_prompt_tokens or the context); difficulty rose on 2"
            in stage_line({**s, "accuracy_before_by_family": {}, "eval_skipped": 3}))
    assert "4 steps, no held-out problems (eval_problems=0);" in stage_line({**s, "accuracy_before_by_family": {},
                                                                              "eval_skipped": 0})
    many = {f"e{i}": 1 for i in range(9)}
    assert stage_line({**s, "difficulty_start": {}, "difficulty_max": {}, "difficulty": many}).endswith(
        "difficulty rose on 9 of 9")  # more than 8 environments: only the count
    eight = dict(list(many.items())[:8])
    assert stage_line({**s, "difficulty_start": {}, "difficulty_max": {}, "difficulty": eight}).endswith(
        "difficulty rose on 8 of 8: e0 0->1, e1 0->1, e2 0->1, e3 0->1, e4 0->1, e5 0->1, e6 0->1, e7 0->1")


def test_overwrite_removes_a_linked_log_directory_but_not_what_it_points_to(tmp_path):
    """A run entry that is a symbolic link (tensorboard/ linked to shared storage, or a dangling wandb link) is a
    previous run's; overwrite=true removes the link, never the files it points to."""
    from cascade.run import previous_run, start_fresh

    out, shared = tmp_path / "run", tmp_path / "shared-tb"
    (shared / "events").mkdir(parents=True)
    out.mkdir()
    (out / "tensorboard").symlink_to(shared)
    (out / "wandb").symlink_to(tmp_path / "gone")  # dangling
    assert previous_run(out) == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match=r"holds a previous run \(tensorboard, wandb\)"):
        start_fresh(out, False)
    start_fresh(out, True)
    assert previous_run(out) == [] and list(out.iterdir()) == [] and (shared / "events").is_dir()


def test_a_stage_named_as_an_expert_or_teacher_runs_before_or_finished_in_the_run_directory(tmp_path):
    """``_check_model_refs``: a stage of the run named as aggregation.expert / sft.aggregation.teacher must run
    before the stage that names it (not the stage itself) or have finished in out= (not with overwrite=true, which
    deletes it); a local dataset must exist."""
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import _check_model_refs

    def check(*over, fresh=False):
        _check_model_refs(load_run_config(parse_overrides(["profile=tiny", *over]))[0], tmp_path, fresh=fresh)

    check("stages.math.aggregation.expert=rlve", "stages.behavior.sft.aggregation.teacher=warmup")
    with pytest.raises(FileNotFoundError, match="stage 'math' neither runs before 'math'"):
        check("stages.math.aggregation.expert=math")
    with pytest.raises(FileNotFoundError, match="stage 'behavior' neither runs before 'warmup'"):
        check("stages.warmup.sft.aggregation.teacher=behavior")
    _finished(tmp_path, "3-behavior")
    check("stages.warmup.sft.aggregation.teacher=behavior")  # finished in an earlier run
    with pytest.raises(FileNotFoundError, match=r"nor finished in .* \(overwrite=true deletes the run there\)"):
        check("stages.warmup.sft.aggregation.teacher=behavior", fresh=True)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        check("stage=math", f"sft.data={tmp_path / 'nope.jsonl'}")
    (tmp_path / "qa.jsonl").write_text('{"prompt": "q", "response": "a"}\n')
    check("stage=math", f"sft.data={tmp_path / 'qa.jsonl'}")


def test_a_rerun_names_at_most_six_changed_settings_and_an_emptied_section(tmp_path, capsys):
    import yaml as y

    from cascade.run import _warn_changed

    old = {"stages": {"math": {f"k{i}": i for i in range(7)}, "rlve": {"env_kwargs": {"toy/add": {"x": 1}}}}}
    (tmp_path / "config.yaml").write_text(y.safe_dump(old))
    _warn_changed(tmp_path, {"stages": {"math": {f"k{i}": i + 1 for i in range(6)} | {"k6": 6},
                                        "rlve": {"env_kwargs": {"toy/add": {"x": 1}}}}})
    err = capsys.readouterr().err
    assert err.count(" -> ") == 6 and "stages.math.k5: 5 -> 6" in err and " ..." not in err
    _warn_changed(tmp_path, {"stages": {"math": {f"k{i}": i + 1 for i in range(7)},
                                        "rlve": {"env_kwargs": {"toy/add": {"x": 1}}}}})
    err = capsys.readouterr().err
    assert err.count(" -> ") == 6 and "stages.math.k6" not in err and err.rstrip().endswith(" ...")
    _warn_changed(tmp_path, {"stages": {"math": {f"k{i}": i for i in range(7)}, "rlve": {"env_kwargs": {"toy/add": {}}}}})
    assert "stages.rlve.env_kwargs.toy/add: (default) -> {}" in capsys.readouterr().err  # (x: 1 -> (default) too)


def test_a_rerun_notes_only_the_finished_and_resumed_stages_whose_settings_changed(tmp_path, capsys):
    import yaml as y

    from cascade.run import _warn_changed

    old = {"stages": {"warmup": {"steps": 1}, "rlve": {"steps": 2}, "math": {"steps": 3}, "behavior": {"steps": 4}}}
    (tmp_path / "config.yaml").write_text(y.safe_dump(old))
    _finished(tmp_path, "0-warmup", "1-rlve")
    for d in ("2-math", "3-behavior"):
        (tmp_path / "stages" / d / "checkpoints" / "step-00000001").mkdir(parents=True)
    _warn_changed(tmp_path, {"stages": {**old["stages"], "rlve": {"steps": 5}, "behavior": {"steps": 6}}})
    err = capsys.readouterr().err
    assert "finished stage(s) rlve keep what they ran" in err and "stage(s) behavior resume from a checkpoint" in err
    _warn_changed(tmp_path, {"stages": {**old["stages"], "warmup": {"steps": 5}}}, distributed=True)
    err = capsys.readouterr().err
    assert "finished stage(s) warmup keep" in err and "resume from a checkpoint" not in err
    _warn_changed(tmp_path, {"stages": {**old["stages"], "math": {"steps": 5}}}, distributed=True)
    err = capsys.readouterr().err
    assert "keep what they ran" not in err and "stage(s) math resume from a checkpoint with the curriculum (mix " \
        "weights, levels) and optimizer moments it holds; the learning rate with its warm-up and decay" in err


def test_cascade_run_refuses_a_blank_model(tmp_path):
    """model= of spaces only (a config file's ``model: ' '``) is as empty as ``model=``."""
    from cascade.run import main

    out, f = tmp_path / "run", tmp_path / "c.yaml"
    f.write_text("model: '  '\n")
    with pytest.raises(ValueError, match=re.escape("model= is empty (an unset variable?)")):
        main([f"config={f}", "profile=tiny", f"out={out}", "stage=warmup"])
    assert not out.exists()


def test_a_model_only_the_transformers_fallback_loads_is_refused_for_trainer_ranks(tmp_path, monkeypatch):
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import _initial_model
    from train.model import hf_io

    monkeypatch.setattr(hf_io, "check_loadable", lambda p: None)  # (what a checkpoint of another architecture gives)
    monkeypatch.setattr(hf_io, "fallback_architecture", lambda p: "SomeForCausalLM")
    cfg = load_run_config(parse_overrides(["profile=tiny", f"model={tmp_path}", "trainer.nproc=2"]))[0]
    with pytest.raises(ValueError, match=r"\(SomeForCausalLM\) would load through the transformers fallback.*"
                                         r"trainer.nproc=2, trainer.nnodes=1"):
        _initial_model(cfg, tmp_path / "run")
    cfg.trainer.nproc = 1
    assert _initial_model(cfg, tmp_path / "run") == tmp_path  # in this process the fallback loads it


def test_a_run_is_finished_only_when_every_stage_of_its_order_is(tmp_path):
    from cascade.config import load_run_config, parse_overrides
    from cascade.run import _all_finished

    cfg, tree = load_run_config(parse_overrides(["profile=tiny"]))
    _finished(tmp_path, "0-warmup", "1-rlve", "2-math")
    assert not _all_finished(cfg, tree, tmp_path)
    _finished(tmp_path, "3-behavior")
    assert _all_finished(cfg, tree, tmp_path)


def test_each_stage_starts_from_the_one_before_it_in_order_over_an_older_finished_stage(tmp_path, monkeypatch, capsys):
    """``order=[behavior, rlve]`` in a directory where warmup finished earlier: behavior starts from warmup's
    final/ (the latest earlier stage finished there), rlve from behavior's (the stage before it in this order),
    not from warmup's, though warmup's index comes before rlve's. (Stages are stubbed: no training.)"""
    from cascade.run import main
    from cascade.stage import StageRunner

    started = []

    def run(self, start_dir):
        started.append((self.name, Path(start_dir)))
        self.final.mkdir(parents=True)
        (self.final / "run_state.json").write_text(json.dumps({"stage": self.name, "steps": 0, "eval_k": 0,
                                                                "accuracy_before": 0.0, "accuracy_after": 0.0}))
        (self.final / "COMPLETE").write_text("ok\n")
        return self.final

    monkeypatch.setattr(StageRunner, "run", run)
    out = tmp_path / "run"
    _finished(out, "0-warmup")
    assert main(["profile=tiny", f"out={out}", "order=[behavior, rlve]", "logging.progress=false", "threads=0"]) == 0
    assert started == [("behavior", out / "stages" / "0-warmup" / "final"),
                       ("rlve", out / "stages" / "3-behavior" / "final")]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stages"] == ["behavior", "rlve"]
