"""SFTTrainer.step packs examples back to back; its loss and gradients equal the mean response-token
NLL that Hugging Face transformers computes on the same weights from a padded batch."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import hf_random_model
from train.model.hf_io import load_pretrained
from train.optim import OptimConfig
from train.sft import SFTConfig, SFTTrainer


def examples(n: int = 7, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 1 + int(torch.randint(1, 12, (1,), generator=g)), int(torch.randint(0, 20, (1,), generator=g))
        out.append((torch.randint(0, 320, (p,), generator=g).tolist(), torch.randint(0, 320, (r,), generator=g).tolist()))
    out[3] = (out[3][0], [])  # an example without a response token: in the batch, scores nothing
    return out


def hf_loss(hf, exs) -> torch.Tensor:
    """Mean NLL of the response tokens over the whole batch, from one right-padded forward."""
    T = max(len(p) + len(r) for p, r in exs)
    ids = torch.zeros(len(exs), T, dtype=torch.long)
    att = torch.zeros(len(exs), T, dtype=torch.long)
    mask = torch.zeros(len(exs), T - 1)
    for i, (p, r) in enumerate(exs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        att[i, :len(p) + len(r)] = 1
        mask[i, len(p) - 1:len(p) - 1 + len(r)] = 1
    logits = hf(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    nll = -F.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (nll * mask).sum() / mask.sum()


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("tokens_per_micro,micro_batch_size", [(16384, 32), (24, 32), (16384, 2)])
def test_packed_sft_step_equals_transformers_padded_loss_and_grads(tmp_path, kind, tokens_per_micro, micro_batch_size):
    hf = hf_random_model(kind, seed=1).float()
    hf.config.output_router_logits = False
    hf.save_pretrained(tmp_path / "hf")
    exs = examples()
    ref = hf_loss(hf, exs)
    ref.backward()
    ours = load_pretrained(tmp_path / "hf")
    sft = SFTTrainer(ours, None, SFTConfig(micro_batch_size=micro_batch_size, tokens_per_micro=tokens_per_micro,
                                           optim=OptimConfig(lr=0.0, grad_clip=1e9, warmup_steps=0)))
    grads = {}
    before = copy.deepcopy(sft.policy.state_dict())
    for n, p in sft.policy.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, n=n: grads.__setitem__(n, t.grad.detach().clone()))
    m = sft.step(exs)
    assert m["tokens"] == sum(len(r) for _, r in exs)
    assert abs(m["sft_loss"] - float(ref.detach())) < 1e-5
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(grads) <= set(hf_grads) | {"lm_head.weight"}
    for n, g in grads.items():
        if n == "lm_head.weight" and n not in hf_grads:
            continue  # tied: the gradient lives on the embedding
        assert torch.allclose(g, hf_grads[n], atol=1e-5, rtol=1e-4), n
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in hf_grads.values()))
    assert abs(m["grad_norm"] - float(norm)) < 1e-4 * float(norm)
    for n, t in sft.policy.state_dict().items():  # lr 0: the step moved nothing
        assert torch.equal(t, before[n]), n


def test_an_example_whose_prompt_encodes_to_nothing_is_refused(tiny_dense_dir):
    from train.tokenizer import load_tokenizer

    sft = SFTTrainer(load_pretrained(tiny_dense_dir), load_tokenizer(tiny_dense_dir), SFTConfig(chat_template=False))
    assert len(sft.encode([("2 + 2 =", "4")])) == 1
    with pytest.raises(ValueError, match="prompt encodes to no tokens"):
        sft.encode([("", "an answer")])


def test_a_decaying_schedule_without_total_steps_runs_over_the_trainers_steps(tiny_dense_dir):
    """``sft.optim.schedule=cosine`` with no ``total_steps`` kept the peak learning rate for the whole warm-up."""
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    lrs = {}
    for schedule in ("cosine", "constant"):
        cfg = SFTConfig(steps=5, optim=OptimConfig(lr=1e-3, schedule=schedule, warmup_steps=1, min_lr_ratio=0.1))
        sft = SFTTrainer(load_pretrained(tiny_dense_dir), tok, cfg)
        lrs[schedule] = []
        for _ in range(5):
            sft.opt.step()  # no gradients: nothing moves (the scheduler wants an optimizer step before its own)
            sft.sched.step()
            lrs[schedule].append(sft.opt.param_groups[0]["lr"])
    assert lrs["constant"] == [1e-3] * 5
    assert lrs["cosine"][-1] == pytest.approx(1e-4) and lrs["cosine"] == sorted(lrs["cosine"], reverse=True)


def test_a_template_that_opens_the_thinking_gets_responses_that_go_on_from_it(tiny_dense_dir):
    """Under a chat template that opens the thinking in the prompt (DeepSeek-R1's, Qwen3-Thinking-2507's), every
    SFT target began with a second <think> (reference traces, data with thinking): the warm-up taught a stray
    <think>; a bare answer would be learned inside the open thinking, never closed."""
    from train.sft import render_trace
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    opened = copy.deepcopy(tok)
    opened.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    policy = load_pretrained(tiny_dense_dir)
    whole = render_trace("two plus two", "\\boxed{4}")
    for t, think in ((opened, "<think>\n"), (tok, "")):
        sft = SFTTrainer(policy, t, SFTConfig(steps=1, max_len=256))
        assert sft.think_open == think
        (p, r), (p2, r2) = sft.encode([("What is 2+2?", whole), ("What is 2+2?", "\\boxed{4}")])
        text = t.decode(p + r)
        assert text.count("<think>") == 1 and text.count("</think>") == 1 and text.endswith("\\boxed{4}<|im_end|>")
        bare = t.decode(p2 + r2)
        assert bare.count("</think>") == (1 if think else 0) and bare.endswith("\\boxed{4}<|im_end|>")


def test_the_trainer_ranks_sft_schedule_runs_over_the_stages_sft_steps(monkeypatch, tmp_path):
    """The trainer ranks took sft.optim as configured: a cosine schedule with no total_steps kept the peak rate
    for the whole warm-up there (SFTTrainer filled it in; the ranks did not)."""
    import types

    import cascade.learner
    from cascade.stage import StageRunner

    assert OptimConfig(schedule="cosine").over(7).total_steps == 7 and OptimConfig().over(7).total_steps == 0
    assert OptimConfig(schedule="linear", total_steps=3).over(7).total_steps == 3
    got = {}
    monkeypatch.setattr(cascade.learner, "WorkerLearner", lambda *a, **kw: got.update(kw))
    monkeypatch.setattr("train.model.hf_io.save_pretrained", lambda *a, **kw: None)
    sft = types.SimpleNamespace(steps=4, optim=OptimConfig(schedule="cosine"))
    runner = types.SimpleNamespace(dir=tmp_path / "stages" / "0-warmup", rcfg=types.SimpleNamespace(
        trainer=None, dtype="float32", device="cpu"), scfg=types.SimpleNamespace(steps=2, sft=sft),
        updates_done=lambda rl, s: 0)
    StageRunner.start_learner(runner, types.SimpleNamespace(cfg=None, pad_id=0), None, tmp_path)
    assert got["sft_optim"].total_steps == 4


def test_trimming_counts_a_response_as_a_thinking_template_trains_it(tiny_dense_dir):
    """Under a template that opens the thinking in the prompt, a bare answer is trained behind a closed empty
    thinking block (after_open_think): trim_pairs counted it as written, kept answers a few tokens under the budget
    that SFTTrainer.encode then refused ("an SFT example has N tokens > max_len"), which ended the stage's SFT. Every
    pair it keeps now encodes, a bare answer as well as one with thinking to cut."""
    from cascade.trim import trim_pairs
    from train.sft import prompt_ids
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    opened = copy.deepcopy(tok)
    opened.chat_template = tok.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    cfg = SFTConfig(steps=1, max_len=64)
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), opened, cfg)
    plen = lambda p: len(prompt_ids(opened, p, cfg.chat_template, cfg.system_prompt))  # noqa: E731
    pairs = [("What is the sum?", " ".join(["the answer"] * n)) for n in range(5, 40)]
    pairs += [("What is the sum?", f"<think>{'so we add ' * n}</think>\\boxed{{4}}") for n in range(5, 40)]
    kept, dropped = trim_pairs(opened, pairs, cfg.max_len - 1, plen, sft.think_open)
    bare = [r for _, r in kept if "<think>" not in r]
    assert dropped and len(bare) >= 5 and sum("<think>" in r for _, r in kept) == 35  # (every thinking one cut to fit)
    assert max(len(p) + len(r) for p, r in sft.encode(kept)) <= cfg.max_len  # (raised: 65 tokens > max_len 64)


def test_load_pairs_takes_mapped_prompt_and_response_columns_over_a_messages_column(tmp_path):
    """Data with both (OpenR1-Math-style: question, solution and messages): columns mapping prompt and response
    picks those columns; without a mapping, or with messages mapped, the messages are the example."""
    import json

    from train.sft import load_pairs

    msgs = [{"role": "user", "content": "What is 2+2? Put the answer in a box."},
            {"role": "assistant", "content": "\\boxed{4}"}]
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "What is 2+2?", "solution": "<think>2+2</think>4", "messages": msgs,
                             "prompt": "p", "response": "r"}) + "\n")
    for cols in ({"prompt": "question", "response": "solution"}, "prompt=question,response=solution"):
        assert load_pairs(f, cols) == [("What is 2+2?", "<think>2+2</think>4")]
    assert load_pairs(f, {"prompt": "prompt", "response": "response"}) == [("p", "r")]  # mapped as themselves
    from_messages = [([{"role": "user", "content": "What is 2+2? Put the answer in a box."}], "\\boxed{4}")]
    assert load_pairs(f) == load_pairs(f, {"messages": "messages"}) == from_messages


def test_chat_examples_must_end_with_an_assistant_reply_after_another_message():
    """The loss is on the last assistant message: a conversation of that message alone (nothing to predict it
    from) or one ending with a user turn is refused, naming where it came from."""
    from train.sft import _messages

    user, bot = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}
    assert _messages([user, bot], "row 0") == ([user], "yo")
    for bad in ([bot], [bot, user], [user, user]):
        with pytest.raises(ValueError, match="row 7: messages must end with an assistant message"):
            _messages(bad, "row 7")


def test_load_pairs_says_a_missing_data_file_does_not_exist(tmp_path):
    from train.sft import load_pairs

    for name in ("absent.jsonl", "absent.parquet"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load_pairs(tmp_path / name)


def test_load_pairs_with_messages_mapped_takes_the_messages_even_when_prompt_is_mapped_too(tmp_path):
    import json

    from train.sft import load_pairs

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q", "solution": "s", "conv": [{"role": "user", "content": "hi"},
                                                                        {"role": "assistant", "content": "yo"}]}) + "\n")
    assert load_pairs(f, {"messages": "conv", "prompt": "question", "response": "solution"}) == \
        [([{"role": "user", "content": "hi"}], "yo")]
    assert load_pairs(f, {"prompt": "question", "response": "solution"}) == [("q", "s")]


def test_chat_prompt_ids_add_the_system_prompt_only_where_the_context_has_none(tiny_dense_dir):
    from train.sft import prompt_ids
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    user = {"role": "user", "content": "What is 2+2?"}
    own = {"role": "system", "content": "Be brief."}
    text = tok.decode(prompt_ids(tok, [own, user], True, "Think hard."))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    added = tok.decode(prompt_ids(tok, [user], True, "Think hard."))
    assert added == "<|im_start|>system\nThink hard.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n" \
                    "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="need the chat template"):
        prompt_ids(tok, [user], False, None)


def test_prompt_text_is_the_last_user_message_of_a_chat_context():
    from train.sft import prompt_text

    ctx = [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
           {"role": "assistant", "content": "reply"}, {"role": "user", "content": "second"}]
    assert prompt_text(ctx) == "second"
    assert prompt_text("plain") == "plain" and prompt_text([{"role": "system", "content": "sys"}]) == ""


def test_a_response_ends_with_one_end_of_sequence_token_and_max_len_is_inclusive(tiny_dense_dir):
    """encode_pair appends EOS to a response that lacks it, and not a second to one that has it; an example of
    exactly max_len tokens is kept, one more is refused."""
    from train.sft import encode_pair
    from train.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_dense_dir)
    eos = tok.eos_token_id
    plain = tok.encode("The answer is 4.", add_special_tokens=False)
    for resp in ("The answer is 4.", "The answer is 4.<|im_end|>"):
        p, r = encode_pair(tok, "What is 2+2?", resp, chat=False, system=None)
        assert r == plain + [eos] and p == tok.encode("What is 2+2?", add_special_tokens=False)
    n = len(p) + len(r)
    assert len(SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(chat_template=False, max_len=n))
               .encode([("What is 2+2?", "The answer is 4.")])) == 1
    with pytest.raises(ValueError, match=f"{n} tokens > max_len {n - 1}"):
        SFTTrainer(load_pretrained(tiny_dense_dir), tok, SFTConfig(chat_template=False, max_len=n - 1)).encode(
            [("What is 2+2?", "The answer is 4.")])


def test_step_metrics_count_from_zero_and_a_loaded_state_goes_on_from_the_saved_step(tiny_dense_dir):
    cfg = SFTConfig(steps=4, optim=OptimConfig(lr=1e-3, schedule="constant", warmup_steps=0))
    sft = SFTTrainer(load_pretrained(tiny_dense_dir), None, cfg)
    exs = examples(4)
    assert [sft.step(exs)["step"] for _ in range(2)] == [0, 1]
    again = SFTTrainer(load_pretrained(tiny_dense_dir), None, cfg)
    again.load_state_dict(sft.state_dict())
    assert again.step_idx == 2 and again.step(exs)["step"] == 2


def test_render_trace_and_messages_given_as_a_json_string():
    import json

    from train.sft import _messages, render_trace

    assert render_trace("  add them \n", " \\boxed{4} ") == "<think>\nadd them\n</think>\n\n\\boxed{4}"
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    assert _messages(json.dumps(conv), "row 0") == ([{"role": "user", "content": "hi"}], "yo")
    with pytest.raises(ValueError, match="row 1: messages is a string, not a JSON list"):
        _messages("hi there", "row 1")


def test_conversational_prompt_completion_rows_are_checked_and_normalised_as_chat():
    from train.sft import _pair

    got = _pair([{"from": "human", "value": "hi"}], [{"from": "gpt", "value": "yo"}], "row 0")
    assert got == ([{"role": "user", "content": "hi"}], "yo")
    assert _pair("hi", [{"role": "assistant", "content": "yo"}], "row 0") == ([{"role": "user", "content": "hi"}], "yo")
    with pytest.raises(ValueError, match="row 2: messages must end with an assistant message"):
        _pair([{"role": "user", "content": "hi"}], [{"role": "user", "content": "again"}], "row 2")
