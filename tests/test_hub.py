"""Hugging Face Hub ids and datasets, offline, from a Hub cache built here (the layout huggingface_hub
reads: HF_HUB_CACHE/{models,datasets}--org--name/{refs/main, snapshots/<commit>/..., blobs/<sha256>});
column mapping; SFT from chat messages; a train / held-out split that never overlaps."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MATH_ROWS = [{"question": f"What is {i} + {i + 3}?", "sol": str(2 * i + 3), "lvl": f"Level {1 + i % 2}"}
             for i in range(40)]


def add_repo(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes]) -> Path:
    """One repository in a Hub cache, as ``hf download`` leaves it: content-addressed blobs, a snapshot
    of relative symlinks for the commit, and refs/main naming the commit."""
    d = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(commit)
    (d / "blobs").mkdir(exist_ok=True)
    snap = d / "snapshots" / commit
    for name, data in files.items():
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return snap


def dir_files(src: Path) -> dict[str, bytes]:
    return {str(p.relative_to(src)): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_dense_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cascade.reward_model import build_tiny_reward_model

    cache = tmp_path_factory.mktemp("hub") / "hub"
    add_repo(cache, "model", "cascade-test/tiny-dense", dir_files(Path(tiny_dense_dir)))
    rm = build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", tiny_dense_dir)
    add_repo(cache, "model", "cascade-test/tiny-rm", dir_files(rm))
    add_repo(cache, "dataset", "cascade-test/tiny-math",
             {"data/train.jsonl": "\n".join(json.dumps(r) for r in MATH_ROWS).encode()})
    buf = pa.BufferOutputStream()
    chats = [{"conversations": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": f"Say {w}."},
                                {"role": "assistant", "content": w}]} for w in ("yes", "no", "maybe")]
    pq.write_table(pa.Table.from_pylist(chats), buf)
    add_repo(cache, "dataset", "cascade-test/tiny-chat",
             {"data/train-00000-of-00001.parquet": buf.getvalue().to_pybytes()})
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """This process offline against ``hub_cache`` (huggingface_hub reads both at import time)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def _env(cache: Path, home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(home), PYTHONPATH=str(ROOT),
               CASCADE_NATIVE_DECODE="0", OMP_NUM_THREADS="1")
    return env


def _run(args: list[str], cache: Path, home: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=_env(cache, home), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# -- resolution ---------------------------------------------------------------------------------------
def test_hub_ids_resolve_offline_and_local_paths_win(offline_cache, tmp_path, monkeypatch):
    from envs.hub import HubError, is_hub_id, resolve_dataset, resolve_model

    snap = resolve_model("cascade-test/tiny-dense")
    assert snap.is_dir() and (snap / "config.json").is_file() and str(offline_cache) in str(snap)
    assert resolve_dataset("cascade-test/tiny-math").joinpath("data/train.jsonl").is_file()
    # a local directory of the same name wins over the Hub
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cascade-test" / "tiny-dense").mkdir(parents=True)
    assert not is_hub_id("cascade-test/tiny-dense")
    assert resolve_model("cascade-test/tiny-dense") == Path("cascade-test/tiny-dense")
    assert not is_hub_id("data.jsonl") and not is_hub_id("./a/b") and not is_hub_id("/a/b") and is_hub_id("a/b@v1")
    with pytest.raises(HubError) as e:
        resolve_model("cascade-test/not-cached", "reward model")
    msg = str(e.value)
    assert "\n" not in msg and "reward model 'cascade-test/not-cached'" in msg
    assert "HF_HUB_OFFLINE=1" in msg and str(offline_cache) in msg and "HF_HOME" in msg


def test_generate_and_ttc_take_hub_ids_offline(hub_cache, tmp_path):
    home = tmp_path / "home"
    r = _run(["-m", "cascade", "generate", "--model", "cascade-test/tiny-dense", "--prompt", "What is 2+3?",
              "--max-tokens", "4", "--seed", "0"], hub_cache, home, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["tokens"] >= 1

    out = tmp_path / "res.jsonl"
    r = _run(["-m", "ttc", "solve", "--model", "cascade-test/tiny-dense", "--data", "cascade-test/tiny-math",
              "--column", "problem=question,answer=sol", "--limit", "2", "--rounds", "0", "--population", "1",
              "--aggregate", "1", "--budget", "8", "--tail", "4", "--no-progress", "--out", str(out)],
             hub_cache, home, tmp_path)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["answer"] for x in recs if x["type"] == "problem"] == ["3", "5"]
    assert recs[-1]["type"] == "summary" and recs[-1]["failed"] == 0

    # not cached while offline: one line naming the id and the offline setting, for each entry point
    for args in (["-m", "cascade", "generate", "--model", "cascade-test/absent", "--prompt", "x"],
                 ["-m", "ttc", "solve", "--model", "cascade-test/absent", "--problem", "1+1", "--aggregate", "1",
                  "--budget", "8", "--tail", "4", "--rounds", "0"],
                 ["-m", "ttc", "solve", "--model", "cascade-test/tiny-dense", "--data", "cascade-test/absent-data",
                  "--aggregate", "1", "--budget", "8", "--tail", "4", "--rounds", "0"],
                 ["-m", "cascade", "run", "profile=tiny", f"out={tmp_path / 'run'}", "model=cascade-test/absent"],
                 ["-m", "cascade", "run", "profile=tiny", f"out={tmp_path / 'run'}", "stage=behavior",
                  "reward_model.path=cascade-test/absent-rm"],
                 ["-m", "cascade", "run", "profile=tiny", f"out={tmp_path / 'run'}", "stage=math",
                  "envs={math: 1}", "env_kwargs.math.path=cascade-test/absent-math"],
                 ["-m", "cascade", "run", "profile=tiny", f"out={tmp_path / 'run'}", "stage=warmup",
                  "sft.data=cascade-test/absent-sft"]):
        r = _run(args, hub_cache, home, tmp_path)
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "cascade-test/absent" in r.stderr, r.stderr
        assert "HF_HUB_OFFLINE=1" in r.stderr and "not in the Hugging Face cache" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "stages").exists()  # refused before any work


def test_unreachable_hub_falls_back_to_the_cache(hub_cache, tmp_path):
    """Online but with no Hub to reach (an endpoint nobody listens on): a cached id still loads, an
    uncached one is one line saying the Hub cannot be reached."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = _env(hub_cache, tmp_path / "home")
    del env["HF_HUB_OFFLINE"]
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    r = subprocess.run([sys.executable, "-m", "cascade", "generate", "--model", "cascade-test/tiny-dense", "--prompt",
                        "hi", "--max-tokens", "2"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["tokens"] >= 1, r.stderr
    r = subprocess.run([sys.executable, "-m", "cascade", "generate", "--model", "cascade-test/absent", "--prompt",
                        "hi"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "cascade-test/absent" in r.stderr and "cannot be reached" in r.stderr and f":{port}" in r.stderr


@pytest.mark.slow
def test_cascade_run_with_hub_policy_and_reward_model_offline(hub_cache, tmp_path):
    """A behavioral stage whose policy and reward model are Hub ids, and whose held-out evaluation reads
    the math dataset from the Hub with column mapping: all from the cache, offline."""
    out = tmp_path / "run"
    r = _run(["-m", "cascade", "run", "profile=tiny", f"out={out}", "stage=behavior",
              "model=cascade-test/tiny-dense", "reward_model.path=cascade-test/tiny-rm", "steps=1",
              "eval_problems=2", "rl.group_size=2", "rl.prompts_per_step=1", "rl.sampling.max_new_tokens=8",
              "envs={math: 1}", "env_kwargs.math.path=cascade-test/tiny-math",
              "env_kwargs.math.columns.problem=question", "env_kwargs.math.columns.answer=sol",
              "logging.progress=false"], hub_cache, tmp_path / "home", tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    final = next((out / "stages").glob("*-behavior")) / "final"
    state = json.loads((final / "run_state.json").read_text())
    assert (final / "config.json").is_file() and "models--cascade-test--tiny-dense" in state["started_from"]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in recs if r["stage"] == "behavior"] == ["eval", "rl", "eval"]


# -- datasets with column mapping --------------------------------------------------------------------
def test_math_env_from_hub_dataset_with_columns(offline_cache):
    from envs.base import get_env
    from envs.math import MathDatasetEnv

    env = get_env("math", path="cascade-test/tiny-math",
                  columns={"problem": "question", "answer": "sol", "level": "lvl"})
    by_text = {r["question"]: r for r in MATH_ROWS}
    assert env.max_difficulty == 1 and len(env.rows) + len(env.heldout_rows) == len(MATH_ROWS)
    for d in (0, 1):
        for seed in range(10):
            p = env.generate(seed, d)
            src = by_text[p.prompt.split("\n\n")[0]]
            assert src["lvl"] == f"Level {d + 1}" and p.answer == src["sol"]
            assert env.verify(p, f"\\boxed{{{src['sol']}}}").correct
    with pytest.raises(ValueError, match=r"lacks column\(s\) problem=query") as e:
        MathDatasetEnv(path="cascade-test/tiny-math", columns={"problem": "query", "answer": "sol"})
    assert "question" in str(e.value)  # names the columns there are
    with pytest.raises(ValueError, match="keys are problem, answer, level"):
        MathDatasetEnv(path="cascade-test/tiny-math", columns={"question": "problem"})


def test_heldout_split_never_overlaps_training(offline_cache, tmp_path):
    from envs.math import MathDatasetEnv

    env = MathDatasetEnv(path="cascade-test/tiny-math", columns={"problem": "question", "answer": "sol"}, heldout=0.25)
    held = {r["problem"] for r in env.heldout_rows}
    train_seen = {env.generate(seed, 0).prompt.split("\n\n")[0] for seed in range(2000)}
    assert held and train_seen == {r["problem"] for r in env.rows}  # training draws every training row...
    assert not held & train_seen                                   # ...and never a held-out one
    evals = {env.heldout(10**9 + s, 0).prompt.split("\n\n")[0] for s in range(300)}
    assert evals == held
    # the side depends on the text only: the same split from a shuffled copy of the data in a file
    f = tmp_path / "shuffled.jsonl"
    f.write_text("\n".join(json.dumps({"problem": r["question"], "answer": r["sol"]}) for r in reversed(MATH_ROWS)))
    again = MathDatasetEnv(path=f, heldout=0.25)
    assert {r["problem"] for r in again.heldout_rows} == held
    # a duplicate of a held-out problem (other whitespace) is held out too, never trained on
    dup = next(iter(held))
    rows = [{"problem": r["question"], "answer": r["sol"]} for r in MATH_ROWS]
    rows.append({"problem": f"  {dup} ", "answer": "0"})
    f.write_text("\n".join(json.dumps(r) for r in rows))
    env2 = MathDatasetEnv(path=f, heldout=0.25)
    assert not {" ".join(r["problem"].split()) for r in env2.rows} & held
    # tiny data: still one held-out problem; heldout=0 turns the split off
    f.write_text("\n".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(3)))
    assert len(MathDatasetEnv(path=f).heldout_rows) >= 1
    assert MathDatasetEnv(path=f, heldout=0).heldout_rows == []



class _Recs:
    """Records that keep what a stage logs (``logged``: the calls' arguments)."""

    def __init__(self):
        self.logged = []

    def log(self, *a):
        self.logged.append(a)

def test_stage_evaluates_on_heldout_and_drops_heldout_sft_prompts(tiny_dense_dir, tmp_path):
    """What a stage does with a math dataset: held-out evaluation draws only held-out problems, and SFT
    data that contains a held-out problem loses that example."""
    from cascade.config import RunConfig, SFTStage, StageConfig
    from cascade.stage import StageRunner
    from envs.curriculum import Curriculum
    from train.model.hf_io import load_pretrained
    from train.sft import SFTConfig, SFTTrainer
    from train.tokenizer import load_tokenizer

    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps({"q": r["question"], "a": r["sol"]}) for r in MATH_ROWS))
    kw = {"math": {"path": str(data), "columns": {"problem": "q", "answer": "a"}, "heldout": 0.2}}
    cur = Curriculum({"math": 1.0, "toy/add": 1.0}, controller="fixed", seed=0, env_kwargs=kw)
    env = cur.envs["math"]
    held = {r["problem"] for r in env.heldout_rows}
    sft_file = tmp_path / "sft.jsonl"
    sft_rows = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["sol"]}]}
                for r in MATH_ROWS]
    sft_file.write_text("\n".join(json.dumps(r) for r in sft_rows))
    scfg = StageConfig(envs={"math": 1.0, "toy/add": 1.0}, env_kwargs=kw, eval_problems=40,
                       sft=SFTStage(steps=1, data=str(sft_file)))
    stage = StageRunner("math", 2, scfg, RunConfig(order=[]), Path("/nonexistent"), None, None)

    stage.records = _Recs()
    evals = stage.eval_problems(cur)
    math_evals = [p.prompt.split("\n\n")[0] for e, p in evals if e == "math"]
    assert len(math_evals) == 20 and set(math_evals) <= held
    tok = load_tokenizer(tiny_dense_dir)
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(steps=1, max_len=512))
    enc = stage.sft_examples(sft, tok, cur)
    logged = stage.records.logged[-1][3]
    assert logged["dropped_heldout"] == len(held) and logged["examples"] == len(MATH_ROWS) - len(held) == len(enc)
    kept_prompts = {tok.decode(p) for p, _ in enc}
    assert not any(h in text for h in held for text in kept_prompts)


def test_sft_data_drops_the_stages_own_eval_problems(tiny_dense_dir, tmp_path):
    """An environment that keeps no held-out list (toy/*, gym/*): the stage's own evaluation problems, which
    run() puts into curriculum.exclude, are dropped from sft.data too, not trained on."""
    from cascade.config import RunConfig, SFTStage, StageConfig
    from cascade.stage import StageRunner
    from envs.curriculum import Curriculum
    from envs.hub import normalize_text
    from train.model.hf_io import load_pretrained
    from train.sft import SFTConfig, SFTTrainer
    from train.tokenizer import load_tokenizer

    cur = Curriculum({"toy/add": 1.0}, controller="fixed", seed=0)
    env = cur.envs["toy/add"]
    sft_file = tmp_path / "sft.jsonl"
    scfg = StageConfig(envs={"toy/add": 1.0}, eval_problems=8, sft=SFTStage(steps=1, data=str(sft_file)))
    stage = StageRunner("warmup", 0, scfg, RunConfig(order=[]), Path("/nonexistent"), None, None)

    stage.records = _Recs()
    held = stage.eval_problems(cur)
    cur.exclude = stage.held_out(cur, held)  # as StageRunner.run does before the SFT warm-up
    held_prompts = {normalize_text(p.prompt) for _, p in held}
    assert len(held) == 8 and not hasattr(env, "heldout_texts")
    # two training problems that are no evaluation problem, then one row per evaluation problem
    extra = [p for p in (env.generate(s, 0) for s in range(50)) if normalize_text(p.prompt) not in held_prompts][:2]
    rows = [{"prompt": p.prompt, "response": env.reference_response(p)} for p in extra + [p for _, p in held]]
    sft_file.write_text("\n".join(json.dumps(r) for r in rows))
    tok = load_tokenizer(tiny_dense_dir)
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(steps=1, max_len=512, chat_template=False))
    enc = stage.sft_examples(sft, tok, cur)
    logged = stage.records.logged[-1][3]
    assert logged["dropped_heldout"] == 8 and logged["examples"] == 2 == len(enc)
    kept = {tok.decode(p) for p, _ in enc}
    assert all(any(p.prompt in text for text in kept) for p in extra)
    assert not any(p.prompt in text for _, p in held for text in kept)
    # SFT data of evaluation problems only: nothing is left to train on, and the error says why
    sft_file.write_text("\n".join(json.dumps(r) for r in rows[2:]))
    with pytest.raises(ValueError, match="all 8 examples of sft.data .* are held-out evaluation problems"):
        stage.sft_examples(sft, tok, cur)


# -- SFT data ---------------------------------------------------------------------------------------------
def test_sft_from_messages_and_mapped_columns(offline_cache, tiny_dense_dir, tmp_path):
    from train.sft import SFTConfig, SFTTrainer, encode_pair, load_pairs
    from train.model.hf_io import load_pretrained
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer("cascade-test/tiny-dense")  # the tokenizer by Hub id too
    pairs = load_pairs("cascade-test/tiny-chat", columns={"messages": "conversations"})
    assert [r for _, r in pairs] == ["yes", "no", "maybe"]
    ctx, resp = pairs[0]
    assert ctx == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes."}]
    p_ids, r_ids = encode_pair(tok, ctx, resp, chat=True, system=None)
    full = tok.apply_chat_template(ctx + [{"role": "assistant", "content": resp}], tokenize=False)
    assert tok.decode(p_ids).startswith(full[:full.index("Say yes.")]) and "Be brief." in tok.decode(p_ids)
    assert tok.decode(r_ids).startswith("yes") and r_ids[-1] == tok.eos_token_id  # the loss: the answer only
    with pytest.raises(ValueError, match="needs columns 'prompt' and 'response', or 'messages'"):
        load_pairs("cascade-test/tiny-chat")

    f = tmp_path / "qa.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(4)))
    assert load_pairs(f, columns={"prompt": "question", "response": "answer"})[1] == ("q1", "a1")
    sharegpt = tmp_path / "sg.jsonl"
    sharegpt.write_text(json.dumps({"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    assert load_pairs(sharegpt) == [([{"role": "user", "content": "hi"}], "yo")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(ValueError, match="must end with an assistant message"):
        load_pairs(bad)
    # TRL's conversational prompt-completion rows are chat examples; a null is an error naming its row (it was
    # trained on as the text "None")
    conv = tmp_path / "conv.jsonl"
    conv.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}],
                                "completion": [{"role": "assistant", "content": "yo"}]}))
    assert load_pairs(conv, columns={"response": "completion"}) == [([{"role": "user", "content": "hi"}], "yo")]
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c", "response": None}))
    with pytest.raises(ValueError, match="row 1: response must be a string"):
        load_pairs(nulls)
    # a training step on chat-format examples
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(steps=1, batch_size=3, micro_batch_size=3))
    m = sft.step(sft.encode(pairs))
    assert m["tokens"] == sum(len(tok.encode(r, add_special_tokens=False)) + 1 for _, r in pairs)


def test_a_bad_file_in_a_dataset_folder_and_a_split_a_single_file_lacks_are_one_line_errors(tmp_path):
    """A folder (a Hub snapshot's shape) holding a line that does not parse: datasets raises
    DatasetGenerationError, which must become the same one-line error a single file gives. A split other
    than train of a single file is refused, not answered with every row."""
    from envs.hub import load_table

    (tmp_path / "ds").mkdir()
    bad = '{"problem": "a", "answer": 1}\n{"problem": "b", "answ'
    (tmp_path / "ds" / "train.jsonl").write_text(bad)
    with pytest.raises(ValueError, match=r"math dataset .*ds.* \(split 'train'\) cannot be read: .*JSON"):
        load_table(tmp_path / "ds", what="math dataset")
    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "a", "answer": 1}\n')
    assert len(load_table(good)) == 1
    with pytest.raises(ValueError, match="is a single file: it has only the 'train' split .*got split 'test'"):
        load_table(good, split="test")
    with pytest.raises(ValueError, match="subset 'main'"):
        load_table(good, subset="main")


def test_a_missing_local_table_file_is_not_taken_for_a_hub_id():
    from envs.hub import is_hub_id

    assert not is_hub_id("data/MISSING.JSONL") and not is_hub_id("data/missing.Parquet")
    assert is_hub_id("org/name") and is_hub_id("org/name@main")


def test_a_csv_file_keeps_its_answers_as_written(tmp_path):
    """datasets guessed column types: answers 7 became 7.0 (an exact grader then failed every correct 7), 0012
    became 12.0 and a long integer 1.2345678901234568e+22; an empty cell stays empty."""
    from envs.hub import load_table

    f = tmp_path / "aime.csv"
    f.write_text("problem,answer\nWhat is 3+4?,7\nA?,0012\nB?,3.10\nC?,12345678901234567890123\nUngraded,\n")
    assert load_table(f, what="ttc dataset")["answer"] == ["7", "0012", "3.10", "12345678901234567890123", ""]


def test_numeric_answer_columns_are_written_out_in_full(tmp_path):
    """A jsonl/parquet answer read as a float came out in exponent form (1e-05, 1e+16), which no response matches;
    a math file's row without an answer (once the gold "None") is left out, with a note."""
    from envs.hub import answer_text
    from envs.math import MathDatasetEnv, load_math_rows

    assert [answer_text(v) for v in (1e-05, 2.5e-07, 1e16, 7.0, 0.25, 7, "0012", None, float("nan"), " ", 1e23, -0.0)] \
        == ["0.00001", "0.00000025", "10000000000000000", "7", "0.25", "7", "0012", None, None, None,
            "100000000000000000000000", "0"]
    f = tmp_path / "m.jsonl"
    f.write_text("".join(json.dumps({"problem": f"P{i}?", "answer": a}) + "\n"
                         for i, a in enumerate([1e-05, 1e16, 0.25, None])))
    rows = load_math_rows(f)
    assert [r["answer"] for r in rows] == ["0.00001", "10000000000000000", "0.25"]
    env = MathDatasetEnv(path=str(f), heldout=0.0)
    p = env.problem("P0?", rows[0]["answer"], 0, 0)
    assert env.verify(p, "\\boxed{0.00001}").correct and not env.verify(p, "\\boxed{0.0001}").correct


def test_a_csv_with_a_byte_order_mark_or_a_pandas_index_keeps_its_columns(tmp_path):
    """The header was read with csv.reader, which names columns otherwise than pandas (datasets' parser): Excel's
    "CSV UTF-8" starts with a byte order mark ('\\ufeffproblem'), pandas' df.to_csv(path) writes its index under a
    blank header ('' for 'Unnamed: 0'); both failed with KeyError: 'Field ... does not exist in schema'."""
    import pandas

    from envs.hub import load_rows

    bom = tmp_path / "excel.csv"
    bom.write_bytes(b"\xef\xbb\xbfproblem,answer\r\nWhat is 1+1?,2\r\nZip code?,0012\r\n")
    idx = tmp_path / "frame.csv"
    pandas.DataFrame({"problem": ["What is 1+1?", "Zip code?"], "answer": ["2", "0012"]}).to_csv(idx)
    assert idx.read_text().startswith(",problem,answer\n")
    for f in (bom, idx):
        rows = load_rows(f, ["problem", "answer"])
        assert [(r["problem"], r["answer"]) for r in rows] == [("What is 1+1?", "2"), ("Zip code?", "0012")], f
    assert list(load_rows(idx, ["problem"])[0]) == ["problem"]


def test_a_csv_in_a_folder_gives_the_rows_of_the_same_single_file(tmp_path):
    """A csv in a folder (a Hub snapshot's shape) had its column types guessed and pandas' missing values dropped:
    0012 became 12, the answers NA and None no answer. A test.csv without the answer column (Kaggle's layout) still
    loads, and so does a dataset card's separator."""
    from envs.hub import load_rows, load_table

    text = "problem,answer\nZip code?,0012\nCountry code of Namibia?,NA\nWhich option is empty?,None\nHalf?,\n"
    want = [("Zip code?", "0012"), ("Country code of Namibia?", "NA"), ("Which option is empty?", "None"),
            ("Half?", "")]
    single = tmp_path / "single.csv"
    single.write_text(text)
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.csv").write_text(text)
    (folder / "test.csv").write_text("problem\nWhat is 3+4?\n")
    for ref in (single, folder):
        assert [(r["problem"], r["answer"]) for r in load_rows(ref, ["problem", "answer"])] == want, ref
    assert load_table(folder, split="test")[:] == {"problem": ["What is 3+4?"]}
    card = tmp_path / "card"
    card.mkdir()
    (card / "data.csv").write_text(text.replace(",", ";"))
    (card / "README.md").write_text('---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n'
                                    '    path: data.csv\n  sep: ";"\n---\n')
    assert [(r["problem"], r["answer"]) for r in load_rows(card, ["problem", "answer"])] == want


def test_heldout_sides_ignore_whitespace_inside_a_problem_too():
    """A copy of a problem with other whitespace inside it (a doubled space, a line break) is on the same side of the
    split as the problem: otherwise a held-out problem leaks into training as its re-spaced copy."""
    from envs.hub import heldout_side, normalize_text, split_heldout

    assert normalize_text("  What is\t 1 +\n\n1?  ") == "What is 1 + 1?"
    texts = [f"Problem number {i} asks for {i} + {i}." for i in range(40)]
    spaced = [t.replace(" ", "  \n ") for t in texts]
    assert [heldout_side(t, 0.3) for t in texts] == [heldout_side(t, 0.3) for t in spaced]
    train, held = split_heldout(texts + spaced, 0.3)
    assert held and train
    assert {i % 40 for i in held}.isdisjoint({i % 40 for i in train})
