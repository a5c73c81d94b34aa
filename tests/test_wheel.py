"""The built wheel works on its own: ``pip install`` of the wheel (not editable) into a fresh virtual
environment, then the ``cascade`` command from a directory outside the repository finds its configs,
its native C++ sources, the sandbox supervisor and the sample data in the installed package.

The wheel is built offline (``pip wheel --no-build-isolation``, setuptools from the dev extra) from a
copy of the sources, so the checkout gets no build/ or egg-info. The fresh venv has no pip and no
dependencies of its own: a ``.pth`` file appends this environment's site-packages (torch etc.), whose
editable-install hook is not run from there (Python processes ``.pth`` files only in site
directories), so ``cascade``, ``envs``, ``train`` and ``ttc`` can only come from the wheel, which
every test asserts."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cascade", "envs", "train", "ttc")
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")


def _run(cmd, cwd, env=None, timeout=180) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} -> {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source copy, wheel path): the wheel built from a copy of what the build reads."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in (*PACKAGES, "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=JUNK)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp / "dist"), str(src)], cwd=tmp, timeout=300)
    (whl,) = (tmp / "dist").glob("cascade_rl-*.whl")
    return src, whl


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """(venv python, environment for its commands, a working directory outside the repository)."""
    _, whl = built
    tmp = tmp_path_factory.mktemp("venv")
    vdir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(vdir)], cwd=tmp)
    py = vdir / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=tmp).stdout.strip())
    deps = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]) if Path(p).is_dir()]
    (purelib / "_cascade_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(whl)],
         cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CASCADE_CONFIGS", "VIRTUAL_ENV")}
    # the venv's commands first; this interpreter's bin (where pip put ninja, a dependency) last, as
    # train/engine/native.py does, so that the build uses the same ninja as this session's (another
    # ninja would rebuild the shared extension)
    env["PATH"] = os.pathsep.join([str(vdir / "bin"), env.get("PATH", ""), str(Path(sys.executable).parent)])
    work = tmp / "work"
    work.mkdir()
    assert ROOT not in work.resolve().parents
    return py, env, work


def test_wheel_holds_every_package_file_and_the_configs(built):
    """Every file of the four packages (modules, sample data, native sources, docs) and every
    config (as cascade/_configs) is in the wheel; nothing else lands at its top level."""
    src, whl = built
    names = set(zipfile.ZipFile(whl).namelist())
    want = {p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*") if p.is_file()}
    want |= {"cascade/_configs/" + p.relative_to(src / "configs").as_posix()
             for p in (src / "configs").rglob("*") if p.is_file()}
    assert {"cascade/_configs/cascade.yaml", "cascade/_configs/profiles/tiny.yaml", "train/engine/csrc/decode_cpu.cpp",
            "envs/code/supervisor.py", "envs/data/math_sample.jsonl", "cascade/docs/DESIGN.md"} <= want
    assert sorted(want - names) == []
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == set(PACKAGES)  # no top-level configs/


def test_installed_wheel_finds_its_files(venv):
    """From outside the repository, the installed packages and the files they read at run time are
    the venv's; the native decode ops build from the shipped C++ source."""
    py, env, work = venv
    probe = ("import json, cascade, envs, ttc, train, train.presets as p, train.engine.native as n\n"
             "import envs.code.supervisor as s, envs.math as m\n"
             "print(json.dumps({'mods': [cascade.__file__, envs.__file__, ttc.__file__, train.__file__],\n"
             " 'configs': str(p.configs_dir()), 'presets': p.list_presets(), 'csrc': str(n._SRC),\n"
             " 'supervisor': s.__file__, 'sample': str(m.SAMPLE_PATH), 'sample_ok': m.SAMPLE_PATH.is_file(),\n"
             " 'native': n.load() if n.enabled() else None, 'error': n._STATE.get('error')}))\n")
    got = json.loads(_run([str(py), "-c", probe], cwd=work, env=env).stdout.strip().splitlines()[-1])
    venv_dir = py.parent.parent
    for f in (*got["mods"], got["configs"], got["csrc"], got["supervisor"], got["sample"]):
        assert Path(f).is_relative_to(venv_dir), f
    assert Path(got["configs"]).name == "_configs" and {"tiny-dense", "tiny-moe"} <= set(got["presets"])
    assert got["sample_ok"]
    assert got["native"] in (True, None), got["error"]  # None: CASCADE_NATIVE_DECODE=0


def test_installed_cascade_commands(venv):
    """`cascade run profile=tiny print_config=true`, `cascade init-model`, `cascade generate` and one
    step of the tiny math stage (math-verify worker, code envs), all from the wheel."""
    py, env, work = venv
    cascade = str(py.parent / "cascade")
    cfg = yaml.safe_load(_run([cascade, "run", "profile=tiny", "print_config=true"], cwd=work, env=env).stdout)
    assert cfg["model_preset"] == "tiny-moe" and cfg["order"] == ["warmup", "rlve", "math", "behavior"]
    assert cfg["stages"]["warmup"]["steps"] == 30  # the tiny profile, over cascade.yaml

    _run([cascade, "init-model", "--preset", "tiny-dense", "--out", "m"], cwd=work, env=env)
    assert (work / "m" / "config.json").is_file()
    out = _run([cascade, "generate", "--model", "m", "--prompt", "2+2=", "--max-tokens", "4"], cwd=work, env=env)
    gen = json.loads(out.stdout.strip().splitlines()[-1])
    assert gen["tokens"] == 4 and gen["finish_reason"] == "length"

    _run([cascade, "run", "profile=tiny", "stage=math", "steps=1", "eval_problems=4", "out=r"], cwd=work, env=env,
         timeout=300)
    assert (work / "r" / "stages" / "2-math" / "final" / "config.json").is_file()


def test_installed_sandbox_judges(venv):
    """The sandbox copies its supervisor from the installed package into the box."""
    from envs.code import sandbox as sbx

    layers = sbx.detect_layers(sbx.SandboxConfig(time_limit=5.0, memory_mb=256))
    if layers["namespaces"] is not None:
        pytest.skip(f"sandbox needs bubblewrap: {layers['namespaces']}")
    py, env, work = venv
    (work / "add.py").write_text("a, b = map(int, input().split())\nprint(a + b)\n")
    (work / "tests.jsonl").write_text('{"input": "2 3\\n", "output": "5"}\n{"input": "1 1\\n", "output": "3"}\n')
    out = _run([str(py.parent / "cascade"), "sandbox", "judge", "--tests", "tests.jsonl", "add.py"], cwd=work, env=env)
    v = json.loads(out.stdout)
    assert (v["passed"], v["total"], v["status"]) == (1, 2, "wrong_answer")


def test_configs_dir_order(tmp_path, monkeypatch):
    """CASCADE_CONFIGS wins; in a checkout (no cascade/_configs) the repository's configs/ is used; a
    missing CASCADE_CONFIGS folder is a one-line error naming where it looked."""
    from train.presets import configs_dir

    monkeypatch.delenv("CASCADE_CONFIGS", raising=False)
    assert not (ROOT / "cascade" / "_configs").exists() and configs_dir() == ROOT / "configs"
    monkeypatch.setenv("CASCADE_CONFIGS", str(tmp_path))
    assert configs_dir() == tmp_path
    monkeypatch.setenv("CASCADE_CONFIGS", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere.*CASCADE_CONFIGS"):
        configs_dir()


def test_the_packaged_configs_come_before_a_neighbouring_configs_folder(tmp_path, monkeypatch):
    """An installed wheel's cascade/_configs wins over a configs/ beside the packages (someone else's)."""
    import train.presets as presets

    monkeypatch.delenv("CASCADE_CONFIGS", raising=False)
    monkeypatch.setattr(presets, "__file__", str(tmp_path / "train" / "presets.py"))
    (tmp_path / "configs").mkdir()
    assert presets.configs_dir() == tmp_path / "configs"
    (tmp_path / "cascade" / "_configs").mkdir(parents=True)
    assert presets.configs_dir() == tmp_path / "cascade" / "_configs"


def test_preset_model_dict_family_vocabulary_and_overrides(tmp_path, monkeypatch):
    from train.presets import load_preset, preset_model_dict

    dense = preset_model_dict("tiny-dense")
    assert dense["vocab_size"] == 1024 and dense["hidden_size"] == 128 and "architecture" not in dense
    assert preset_model_dict("tiny-dense", 777)["vocab_size"] == 777  # e.g. the built tokenizer's size
    assert preset_model_dict("tiny-dense", hidden_size=64)["hidden_size"] == 64
    assert preset_model_dict("tiny-zaya")["architecture"] == "zaya"
    assert preset_model_dict("tiny-llama", architecture="qwen3")["architecture"] == "qwen3"
    with pytest.raises(ValueError, match="unknown model preset 'tiny-nope'; available presets: .*tiny-dense"):
        load_preset("tiny-nope")
    # a preset's own architecture stands over its model_type's family
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.yaml").write_text("model_type: llama\nmodel: {architecture: qwen2, hidden_size: 8}\n")
    monkeypatch.setenv("CASCADE_CONFIGS", str(tmp_path))
    assert preset_model_dict("mine") == {"architecture": "qwen2", "hidden_size": 8, "vocab_size": 1024}
