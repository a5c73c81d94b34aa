"""A tokenizer made locally, with no download: byte-level BPE trained with ``tokenizers`` on text
this module generates, saved as HF tokenizer files with a Qwen-style chat template and
``<think>``/``</think>`` tokens. Digits are split one per token, as in Qwen.
"""
from __future__ import annotations

import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_WORDS = """the of and to a in is that for it as with was on be by this are or from at an which have not
has but were all can their one its also there been more other when into some than them these may only
so no about what out would up such first new two time like then over most any after each where could
because through many three how between both under while last well just very same before answer number
sum product find compute let given value solve equation problem prove show integer prime digit list sort
graph edge node path shortest tree cost weight total order sequence string word letter count ways choose
probability expected random fair coin dice area triangle circle square point line angle length width
height radius perimeter volume fraction ratio remainder divisor multiple factor greatest least common
minimum maximum largest smallest positive negative even odd real matrix vector set interval function
think step reason therefore thus hence so final because check verify answer result output input program
return print def if else elif for while in range len int str list dict true false none import class
please write response paragraph sentence title section bullet keyword language format json lowercase
uppercase quote comma end phrase highlight repeat request instruction follow assistant user system""".split()


def training_corpus(n_lines: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic text covering prose, arithmetic, LaTeX, code and chat markup."""
    rng = random.Random(seed)
    lines = []
    ops = ["+", "-", "*", "/", "=", "<", ">", "^", "%"]
    latex = ["\\boxed{", "\\frac{", "\\sqrt{", "\\cdot", "\\times", "\\le", "\\ge", "\\pi", "\\{", "\\}", "$", "^{", "_{"]
    code = ["def f(x):", "    return", "print(", "for i in range(n):", "if x == y:", "import sys", "input().split()",
            "int(", "map(int,", "list(", "sorted(", "len(", "while True:", "[]", "{}", "()", "==", "!=", "+=", ":"]
    for i in range(n_lines):
        kind = i % 5
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            expr = " ".join(f"{rng.randint(0, 999)} {rng.choice(ops)}" for _ in range(rng.randint(1, 5)))
            lines.append(f"{expr} {rng.randint(0, 9999)}")
        elif kind == 2:
            lines.append(" ".join(rng.choice(latex) + str(rng.randint(0, 99)) + "}" for _ in range(rng.randint(1, 4))))
        elif kind == 3:
            lines.append("\n".join(rng.choice(code) for _ in range(rng.randint(1, 4))))
        else:
            lines.append(f"<think>\n{' '.join(rng.choice(_WORDS) for _ in range(6))}\n</think>\n"
                         f"The answer is \\boxed{{{rng.randint(0, 999)}}}.")
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 1024, seed: int = 0, model_max_length: int = 1 << 30):
    """Train the tokenizer and save HF files to ``out_dir``; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    # <think> and </think> keep their ids (3, 4) but are not special, as in Qwen3's tokenizer: a decode that skips
    # special tokens (vLLM's and the server's default) keeps the reasoning delimiters
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIAL_TOKENS[3:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=SPECIAL_TOKENS[1:2], model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained`` on a local directory or a Hub id ``org/name`` (its snapshot in the
    HF cache, :func:`envs.hub.resolve_model`), with a one-line error when it has no tokenizer."""
    from transformers import AutoTokenizer

    from envs.hub import resolve_model

    p = resolve_model(path, "tokenizer")
    if not p.is_dir() or not ((p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists()):
        raise FileNotFoundError(f"no tokenizer files in {str(p)!r}")
    return AutoTokenizer.from_pretrained(str(p))


def chat_prompt_ids(tokenizer, prompt: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return chat_ids(tokenizer, msgs)


def whole_chars(decode, ids: list[int], lead: bool = True) -> tuple[list[int], str]:
    """``ids`` (a cut of a token sequence) less the remnant of a character the cut split (byte-level BPE: U+FFFD,
    which a model would read, and re-tokenise, as itself), at the cut's start (``lead``) or its end; with the text they
    decode to. At least one token is kept."""
    ids = list(ids)
    text = decode(ids)
    while len(ids) > 1 and (text.startswith("\ufffd") if lead else text.endswith("\ufffd")):
        ids = ids[1:] if lead else ids[:-1]
        text = decode(ids)
    return ids, text


USER_MARK = "\u2063CASCADE-USER\u2063"  # an unlikely user message, to find where a template puts it


def split_chat(rendered: str) -> tuple[str, str]:
    """(text before, text after) the user message in a chat template rendered around ``USER_MARK``."""
    if rendered.count(USER_MARK) != 1:
        raise ValueError("the chat template did not render the user message exactly once")
    pre, post = rendered.split(USER_MARK)
    return pre, post


def chat_parts(tokenizer, system: str | None = None) -> tuple[str, str]:
    """(text before, text after) the user message in ``tokenizer``'s generation prompt; ``("", "")``
    without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER_MARK}]
    return split_chat(str(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)))


def open_think_of(tokenizer, chat: bool = True, system: str | None = None) -> str:
    """The thinking block ``tokenizer``'s chat template leaves open at the end of a generation prompt
    (:func:`envs.base.open_think`), ``""`` for plain-text prompts or a tokenizer without a template."""
    from envs.base import open_think

    if not chat:
        return ""
    try:
        return open_think(chat_parts(tokenizer, system)[1])
    except Exception:  # noqa: BLE001 - a template that cannot render this: the prompts say so where they are built
        return ""


def chat_ids(tokenizer, msgs: list[dict]) -> list[int]:
    """Token ids of chat ``msgs`` ending with the assistant header; a one-line error when the
    tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template (chat_template.jinja): use rl.chat_template=false "
                         "(cascade run) or --raw (cascade generate) for plain-text prompts")
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
