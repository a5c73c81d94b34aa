"""IFEval instructions against hand-written responses, loose checking, language identification and
the environment's rewards."""
from __future__ import annotations

import pytest

from envs import get_env
from envs.ifeval import INSTRUCTIONS, check, check_loose, detect_language
from envs.ifeval.env import compatible

EN = "The cat sat on the mat. It was a sunny day and the birds were singing."

# (spec, response that follows it, response that does not)
CASES = [
    ({"type": "keywords:existence", "keywords": ["harbor", "violin"]},
     "A violin played by the Harbor.", "A violinist played by the harbors."),
    ({"type": "keywords:frequency", "keyword": "ember", "relation": "at least", "n": 2},
     "Ember after ember fell.", "One ember fell."),
    ({"type": "keywords:frequency", "keyword": "ember", "relation": "less than", "n": 2},
     "One ember fell.", "Ember after EMBER fell."),
    ({"type": "keywords:forbidden_words", "words": ["very", "really"]},
     "Everything went well.", "It was Very nice."),
    ({"type": "keywords:letter_frequency", "letter": "z", "relation": "at least", "n": 3},
     "Zig zag zoo.", "Zig zag."),
    ({"type": "keywords:letter_frequency", "letter": "z", "relation": "less than", "n": 3},
     "Zig zag.", "Zig zag zoo."),
    ({"type": "language:response_language", "language": "de"},
     "Das ist ein schöner Tag und wir gehen in den Park.", EN),
    ({"type": "length_constraints:number_sentences", "relation": "at least", "n": 3},
     "One. Two! Three?", "One. Two!"),
    ({"type": "length_constraints:number_sentences", "relation": "less than", "n": 3},
     "One. Two!", "One. Two! Three?"),
    ({"type": "length_constraints:number_paragraphs", "n": 2},
     "First part.\n***\nSecond part.", "First part.\n\nSecond part."),
    ({"type": "length_constraints:number_words", "relation": "at least", "n": 5},
     "one two three four five", "one two three four"),
    ({"type": "length_constraints:number_words", "relation": "less than", "n": 5},
     "one two three four", "one two three four five"),
    ({"type": "length_constraints:nth_paragraph_first_word", "n": 2, "nth": 2, "word": "finally"},
     "Start here.\n\nFinally, we end.", "Start here.\n\nAt last we end."),
    ({"type": "detectable_content:number_placeholders", "n": 2},
     "Dear [name], see you at [address].", "Dear [name], see you soon."),
    ({"type": "detectable_content:postscript", "marker": "P.S."},
     "Hello.\nP.S. Bring snacks.", "Hello. PS bring snacks."),
    ({"type": "detectable_content:postscript", "marker": "P.P.S"},
     "Hello.\nP.P.S Bring snacks.", "Hello.\nP.S. Bring snacks."),
    ({"type": "detectable_format:number_bullet_lists", "n": 2},
     "List:\n* one\n- two", "List:\n* one\n- two\n- three"),
    ({"type": "detectable_format:constrained_response"},
     "My answer is maybe.", "Maybe."),
    ({"type": "detectable_format:number_highlighted_sections", "n": 2},
     "This is *one* and **two**.", "This is *one* and ** **."),
    ({"type": "detectable_format:multiple_sections", "splitter": "SECTION", "n": 2},
     "SECTION 1\nintro\nSECTION 2\nmain", "SECTION 1\nintro\nSection 2\nmain"),
    ({"type": "detectable_format:json_format"},
     '```json\n{"a": 1}\n```', "{'a': 1}"),
    ({"type": "detectable_format:title"},
     "<<My Poem>>\nRoses are red.", "<< >>\nRoses are red."),
    ({"type": "combination:two_responses"},
     "Answer one.\n******\nAnswer two.", "Same.\n******\nSame."),
    ({"type": "combination:repeat_prompt", "prompt_to_repeat": "Write a poem."},
     "write a poem. Here it is.", "Sure! Write a poem. Here it is."),
    ({"type": "startend:end_checker", "end_phrase": "Any other questions?"},
     '"Done. Any other questions?"', "Any other questions? Done."),
    ({"type": "change_case:capital_word_frequency", "relation": "at least", "n": 2},
     "This is VERY IMPORTANT.", "This is Very Important."),
    ({"type": "change_case:english_capital"}, EN.upper(), EN),
    ({"type": "change_case:english_lowercase"}, EN.lower(), EN),
    ({"type": "punctuation:no_comma"}, "No commas here.", "Well, one comma."),
    ({"type": "startend:quotation"}, '"Quoted text."', '"Half quoted.'),
]


def test_all_25_instruction_types_are_covered():
    assert len(INSTRUCTIONS) == 25
    assert {spec["type"] for spec, _, _ in CASES} == set(INSTRUCTIONS)


@pytest.mark.parametrize("spec,good,bad", CASES, ids=[f"{c[0]['type']}-{i}" for i, c in enumerate(CASES)])
def test_instruction_checks(spec, good, bad):
    assert check(spec, good)
    assert not check(spec, bad)
    assert not check(spec, "")


def test_loose_checking_strips_first_last_lines_and_asterisks():
    quote = {"type": "startend:quotation"}
    resp = 'Sure, here you go:\n"Quoted text."'
    assert not check(quote, resp) and check_loose(quote, resp)
    comma = {"type": "punctuation:no_comma"}
    resp = "Hello, friend!\nNo commas in the body.\nBye, now."
    assert not check(comma, resp) and check_loose(comma, resp)
    ps = {"type": "detectable_content:postscript", "marker": "P.S."}
    assert not check_loose(ps, "No postscript at all.")
    title = {"type": "keywords:existence", "keywords": ["harbor"]}
    assert check_loose(title, "**harbor**") and not check_loose(title, "harbour")


@pytest.mark.parametrize("lang,text", [
    ("en", "This is a simple sentence and it is written in English for the test."),
    ("de", "Ich habe heute keine Zeit, weil ich mit dem Hund in den Park gehe."),
    ("fr", "Je pense que nous allons au marché avec les enfants ce matin."),
    ("es", "Los niños juegan en el parque y nosotros caminamos por la playa."),
    ("it", "Il gatto dorme sul divano e gli amici sono in cucina."),
    ("pt", "Nós gostamos de caminhar com os amigos e a família no parque."),
    ("ru", "Сегодня хорошая погода, и мы идём гулять в парк."),
    ("uk", "Сьогодні гарна погода, і ми їдемо до річки."),
    ("el", "Σήμερα ο καιρός είναι πολύ ωραίος."),
    ("ar", "الطقس جميل اليوم ونحن نذهب إلى الحديقة."),
    ("hi", "आज मौसम बहुत अच्छा है और हम पार्क जा रहे हैं।"),
    ("zh", "今天天气很好，我们去公园散步。"),
    ("ja", "今日はとても良い天気なので、公園に行きます。"),
    ("ko", "오늘 날씨가 아주 좋아서 공원에 갑니다."),
    ("th", "วันนี้อากาศดีมาก เราไปสวนสาธารณะกัน"),
])
def test_language_detector(lang, text):
    assert detect_language(text) == lang


def test_language_detector_edge_cases():
    assert detect_language("") == "und"
    assert detect_language("12345 !!! ???") == "und"
    assert detect_language(EN.upper()) == "en"


def test_conflicting_instructions_are_never_drawn_together():
    assert not compatible("change_case:english_capital", "change_case:english_lowercase")
    assert not compatible("detectable_format:json_format", "detectable_format:title")
    assert not compatible("combination:two_responses", "length_constraints:number_paragraphs")
    assert compatible("punctuation:no_comma", "detectable_format:title")
    env = get_env("ifeval")
    for seed in range(40):
        types = [s["type"] for s in env.generate(seed, 14).answer["instructions"]]
        assert len(types) == len(set(types)) == 8
        assert all(compatible(a, b) for i, a in enumerate(types) for b in types[i + 1:])


def test_env_rewards_and_difficulty():
    env = get_env("ifeval")
    assert [len(env.generate(0, d).answer["instructions"]) for d in (0, 1, 2, 5, 14, 30)] == [1, 1, 2, 3, 8, 8]
    p = env.generate(0, 2)
    p.answer = {"instructions": [{"type": "punctuation:no_comma"},
                                 {"type": "keywords:existence", "keywords": ["harbor"]}]}
    half = env.verify(p, "A quiet day, nothing more.")
    assert (half.reward, half.correct) == (0.0, False)
    half = env.verify(p, "A quiet day at the harbor, nothing more.")
    assert (half.reward, half.correct) == (0.5, False)
    assert [v["pass"] for v in half.info["instructions"]] == [False, True]
    full = env.verify(p, "A quiet day at the harbor.")
    assert (full.reward, full.correct) == (1.0, True)
    # the answer after any thinking is judged: commas or the keyword in the thinking count for nothing
    assert env.verify(p, "<think>Hmm, well, the harbor.</think>\nA quiet day at the harbor.").correct
    assert env.verify(p, "<think>The harbor.</think>\nA quiet day.").reward == 0.5
    strict_all = get_env("ifeval", reward="all")
    assert strict_all.verify(p, "A quiet day at the harbor, nothing more.").reward == 0.0
    assert env.verify(p, "   ").format_ok is False
    with pytest.raises(ValueError, match="reward"):
        get_env("ifeval", reward="sum")


def test_references_follow_every_instruction_in_strict_and_loose_mode():
    strict, loose = get_env("ifeval"), get_env("ifeval", loose=True)
    for seed in range(30):
        for d in (0, 4, 9, 14):
            p = strict.generate(seed, d)
            ref = strict.reference_response(p)
            assert strict.verify(p, ref).correct and loose.verify(p, ref).correct
            for bad in strict.corruptions(p):
                assert not strict.verify(p, bad).correct
