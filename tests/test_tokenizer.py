"""The locally built tokenizer (train/tokenizer.py): its special and reasoning tokens, digits one per token, the
chat template's pieces around the user message, and cuts of a token sequence that split a character."""
import copy

import pytest

from train.tokenizer import (USER_MARK, chat_ids, chat_parts, chat_prompt_ids, load_tokenizer,
                             split_chat, whole_chars)


@pytest.fixture(scope="module")
def tok(tiny_dense_dir):
    return load_tokenizer(tiny_dense_dir)  # made by build_tokenizer (cascade init-model)


def test_reasoning_tokens_survive_a_decode_that_skips_special_tokens_and_digits_are_single_tokens(tok):
    ids = tok.encode("<think>\nadd\n</think>\n\n12345<|im_end|>", add_special_tokens=False)
    assert ids[0] == 3 and 4 in ids and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nadd\n</think>\n\n12345"
    digits = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == ["1", "2", "3", "4", "5"]


def test_chat_pieces_and_prompt_ids(tok, tmp_path):
    assert chat_parts(tok) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat_parts(tok, "Be brief.") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n",
                                            "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(chat_prompt_ids(tok, "hi", "Be brief.")) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert split_chat(f"a{USER_MARK}b") == ("a", "b")
    with pytest.raises(ValueError, match="exactly once"):
        split_chat(f"a{USER_MARK}b{USER_MARK}")
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    assert chat_parts(bare) == ("", "")
    with pytest.raises(ValueError, match="no chat template"):
        chat_ids(bare, [{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_whole_chars_drops_the_remnants_of_a_split_character_at_the_cut():
    pieces = {1: "\ufffd", 2: "a", 3: "b"}
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    assert whole_chars(decode, [1, 1, 2, 3]) == ([2, 3], "ab")
    assert whole_chars(decode, [2, 3, 1, 1], lead=False) == ([2, 3], "ab")
    assert whole_chars(decode, [2, 1], lead=True) == ([2, 1], "a\ufffd")  # only the cut's own end is trimmed
    assert whole_chars(decode, [1, 1]) == ([1], "\ufffd")  # at least one token is kept
