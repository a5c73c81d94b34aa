"""IFEval instructions against hand-written responses, loose checking, language identification and
the environment's rewards."""
from __future__ import annotations

import pytest

from envs import get_env
from envs.ifeval import INSTRUCTIONS, check, check_loose, detect_language
from envs.ifeval.instructions import count_keyword, count_sentences, split_sentences
from envs.ifeval.env import _violations, compatible

EN = "The cat sat on the mat. It was a sunny day and the birds were singing."

# (spec, response that follows it, response that does not)
CASES = [
    ({"type": "keywords:existence", "keywords": ["harbor", "violin"]},
     "A violin played by the Harbor.", "A viola played by the harbour."),
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


@pytest.mark.timeout(60)
def test_title_and_capital_words_as_the_reference_counts_them():
    """The reference's TitleChecker takes ``<<a <b> c>>`` (any text on the line between the first ``<<`` and the last
    ``>>``); its capital-word count tokenizes like nltk (WELL-KNOWN, U.S.A one word each; DON'T two)."""
    import random
    import re

    from envs.ifeval.instructions import count_capital_words, has_title

    title = {"type": "detectable_format:title"}
    assert check(title, "<<a <b> c>>\nbody") and not check(title, "<< >>\n<<\n>>")
    rng = random.Random(0)
    for _ in range(3000):  # against the reference's own expression
        t = "".join(rng.choice("<<>> a\n") for _ in range(rng.randint(0, 14)))
        assert has_title(t) == any(m.lstrip("<").rstrip(">").strip() for m in re.findall(r"<<[^\n]+>>", t)), t
    assert not has_title("<<" * 200_000)  # the regex backtracks quadratically here (minutes; the mark's timeout)
    assert count_capital_words("WELL-KNOWN U.S.A. DON'T stop") == 4
    cap = {"type": "change_case:capital_word_frequency", "relation": "less than", "n": 5}
    assert check(cap, "The WELL-KNOWN U.S.A. team, DON'T worry.")


def test_first_person_english_is_english_and_italian_is_italian():
    """langdetect, as the IFEval reference: a stopword count called first-person English Polish ("i", "do",
    "to" are Polish stopwords), failing correct all-caps and all-lowercase answers, and Italian Portuguese."""
    text = "I want to do it now. I hope I can do it well, and I do not know what to do after that."
    assert detect_language(text) == "en"
    assert check({"type": "change_case:english_capital"}, text.upper())
    assert check({"type": "change_case:english_lowercase"}, text.lower())
    assert not check({"type": "change_case:english_capital"}, text)
    assert detect_language("Oggi vado a scuola e poi a casa con i miei amici.") == "it"
    assert detect_language("Mi piace andare a correre ogni mattina.") == "it"
    assert detect_language("今天天气很好。" * 20_000) == "zh"  # long inputs: bounded, deterministic


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



def test_an_answer_after_thinking_is_judged_as_written_and_prompts_keep_examples_apart():
    """A policy answers ``<think>...</think>\\n\\n`` + answer (the warm-up SFT's format): the blank lines put "paragraph
    N starts with W" one paragraph off (every compliant answer failed it, and ones starting paragraph N-1 with W
    passed). The request to repeat is named (the whole prompt carries the other instructions' words), and an
    instruction after a multi-line example (bullets, sections) starts a line of its own."""

    env = get_env("ifeval")
    seen = 0
    for seed in range(200):
        p = env.generate(seed, 14)
        types = {s["type"] for s in p.answer["instructions"]}
        ref = env.reference_response(p)
        assert env.verify(p, "<think>plan</think>\n\n" + ref).correct, (seed, types)
        if "length_constraints:nth_paragraph_first_word" in types:
            seen += 1
        for s in p.answer["instructions"]:
            if s["type"] == "combination:repeat_prompt":
                assert f'request "{s["prompt_to_repeat"]}"' in p.prompt
        for example_end in ("* This is point 2", "[content of section 2]"):
            if example_end in p.prompt:
                assert p.prompt.split(example_end, 1)[1][:1] in ("", "\n"), p.prompt
    assert seen >= 5
    spec = {"type": "length_constraints:nth_paragraph_first_word", "n": 3, "nth": 2, "word": "today"}
    p = env.problem("Write.", {"instructions": [spec]}, 0, 0)
    follows, violates = "One.\n\nToday two.\n\nThree.", "Today one.\n\nTwo.\n\nThree."
    assert env.verify(p, "<think>x</think>\n\n" + follows).correct
    assert not env.verify(p, "<think>x</think>\n\n" + violates).correct


# -- agreement with official IFEval (google-research instruction_following_eval) ----------------
def test_sentences_follow_ifeval_splitter_not_line_breaks():
    # line breaks are spaces: a list of bare lines is one sentence (no reward for "at least N")
    lines = "Apples\nBananas\nCherries\nDates\nEggs"
    assert count_sentences(lines) == 1
    assert not check({"type": "length_constraints:number_sentences", "relation": "at least", "n": 5}, lines)
    # titles, decimals and a.m./p.m. do not end a sentence
    dr = "Dr. Smith met Mr. Jones at 3.5 p.m. today."
    assert split_sentences(dr) == [dr]
    assert check({"type": "length_constraints:number_sentences", "relation": "less than", "n": 2}, dr)
    assert count_sentences("Mrs. Brown and St. Louis are here.") == 1
    assert count_sentences("She has a Ph.D. in math. Impressive!") == 2
    assert count_sentences("Visit example.com for more. Then call.") == 2
    assert count_sentences("It costs 4.99 dollars. Cheap.") == 2
    assert count_sentences("Plan B. Then plan C.") == 1  # a single letter's period is kept
    # acronyms and company suffixes end a sentence only before a typical sentence starter
    assert count_sentences("The U.S.A. economy grew. It did.") == 2
    assert count_sentences("I live in the U.S. He lives in the U.K. too.") == 2
    assert count_sentences("Acme Inc. is big. Really big.") == 2
    assert count_sentences("We met at Acme Inc. They were nice.") == 2
    # an ellipsis ends a sentence; a closing quote may follow the period
    assert count_sentences("Wait... what happened? Nothing.") == 3
    assert split_sentences('He said "stop." Then he left.') == ['He said "stop."', "Then he left."]
    assert count_sentences("Line one.\nLine two.\n\nLine three") == 3
    # punctuation-only pieces and mid-token periods add nothing
    assert count_sentences("Hello!!! World???") == 2
    assert count_sentences("See config.yaml now. Done.") == 2
    assert count_sentences("") == count_sentences("  \n ") == 0


def test_two_responses_allow_an_empty_first_or_last_part():
    spec = {"type": "combination:two_responses"}
    assert check(spec, "******\nFirst answer.\n******\nSecond answer.")
    assert check(spec, "First.\n******\nSecond.\n******")
    assert check(spec, "******\nFirst.\n******\nSecond.\n******")
    assert not check(spec, "First.\n******\n\n******\nSecond.")  # empty part in the middle
    assert not check(spec, "******\nOnly one.\n******")
    assert not check(spec, "A.\n******\nB.\n******\nC.")
    assert not check(spec, "******\nSame.\n******\nSame.\n******")


def test_keywords_match_as_substrings_but_forbidden_words_as_whole_words():
    assert check({"type": "keywords:existence", "keywords": ["lantern", "harbor"]}, "Two lanterns lit the harbors.")
    text = "embers, embers, embers and an ember"
    assert count_keyword(text, "ember") == 4
    assert not check({"type": "keywords:frequency", "keyword": "ember", "relation": "less than", "n": 2}, text)
    assert check({"type": "keywords:frequency", "keyword": "ember", "relation": "at least", "n": 4}, text)
    assert count_keyword("A Day to Remember", "EMBER") == 1
    forbid = {"type": "keywords:forbidden_words", "words": ["very", "real"]}
    assert check(forbid, "Every day is really fine.") and not check(forbid, "It was VERY fine.")
    # the environment's corruptions remove keywords hidden inside longer words too
    ref = "<<A Day to Remember>>\nThe harbor was calm."
    for spec in ({"type": "keywords:existence", "keywords": ["ember", "harbor"]},
                 {"type": "keywords:frequency", "keyword": "ember", "relation": "at least", "n": 1}):
        assert check(spec, ref) and not check(spec, _violations(spec, ref))


def test_json_format_survives_deep_nesting():
    spec = {"type": "detectable_format:json_format"}
    deep = "[" * 100_000 + "]" * 100_000
    assert check(spec, deep) is False and check_loose(spec, deep) is False
    assert check(spec, "[" * 50 + "]" * 50)


def test_nth_paragraph_first_word_follows_ifeval():
    spec = {"type": "length_constraints:nth_paragraph_first_word", "n": 2, "nth": 2, "word": "today"}
    assert check(spec, "Intro.\n\nToday's weather is mild.")  # cut at the apostrophe
    assert check(spec, 'Intro.\n\n"Today," she said.')  # leading quote dropped, cut at the comma
    assert not check(spec, "Intro.\n\n**Today** is fine.")  # markdown stays part of the word
    assert check_loose(spec, "Intro.\n\n**Today** is fine.")  # ... but loose mode removes the stars
    assert not check(spec, "Intro.\n\nToday: fine.")  # only . , ? ! and quotes end the word
    assert not check(spec, "Intro.\n \nToday is fine.")  # a line with a space does not split
    assert check(spec, "Intro.\n\n\nToday is fine.")  # split on "\n\n" exactly; the rest is stripped
    # the count skips empty pieces, but the nth piece is taken from the raw split (IFEval does so)
    assert not check(spec, "Intro.\n\n\n\nToday is fine.")
    assert not check(spec, "Intro.\n\nToday is fine.\n\nOutro.")


def test_no_keyword_hides_in_a_common_word_and_the_pronoun_I_ends_a_sentence():
    """Keywords match as substrings (IFEval's rule), so "ember" was credited in "remember"/"November" (and "less than"
    versions refused ordinary text) and "compass" in "encompass"; a sentence ending in the pronoun "I." was not ended
    (the lone-letter rule for "plan B. then"), so "at least 2 sentences" refused two."""
    from envs.ifeval.env import KEYWORDS

    common = ("remember members November September December encompass temperature together whether another "
              "important however different thought through")
    assert [k for k in KEYWORDS if count_keyword(common, k)] == []
    assert count_sentences("Cook what the family likes, and so did I. Everyone ate well.") == 2
    assert count_sentences("We chose plan B. then we left.") == 1 and count_sentences("Ask at 5 p.m. today.") == 1


# -- edges of the checkers that the cases above leave open (each pins an IFEval reference rule) ------------------
def test_checkers_follow_the_reference_at_their_edges():
    def ok(spec, text):
        return check(spec, text)

    # every keyword must appear, and any forbidden word fails the response
    assert not ok({"type": "keywords:existence", "keywords": ["harbor", "violin"]}, "Only the harbor.")
    forbid = {"type": "keywords:forbidden_words", "words": ["very", "really"]}
    assert not ok(forbid, "It was really nice.")
    # the letter is compared case-insensitively, however the instruction spells it
    assert ok({"type": "keywords:letter_frequency", "letter": "Z", "relation": "at least", "n": 3}, "zig zag zoo")
    # "***" paragraphs: an empty first/last piece is dropped, an empty one inside fails
    paras = {"type": "length_constraints:number_paragraphs", "n": 2}
    assert ok(paras, "***\nFirst part.\n***\nSecond part.")
    assert not ok(paras, "First part.\n***\n\n***\nSecond part.")
    # bullets: "*" or "-" after optional indentation; a "**bold**" line is no bullet
    bullets = {"type": "detectable_format:number_bullet_lists", "n": 2}
    assert ok(bullets, "**Note**\n* one\n* two")
    assert ok(bullets, "List:\n  - one\n\t- two")
    # placeholders do not span lines
    assert not ok({"type": "detectable_content:number_placeholders", "n": 1}, "Dear [first\nname], hello.")
    # postscripts: "P. S." and "P. P. S" (a space after each period) count
    assert ok({"type": "detectable_content:postscript", "marker": "P.S."}, "Hello.\nP. S. Bring snacks.")
    assert ok({"type": "detectable_content:postscript", "marker": "P.P.S"}, "Hello.\nP. P. S Bring snacks.")
    # the option may sit inside a longer answer
    assert ok({"type": "detectable_format:constrained_response"}, "I thought about it. My answer is yes.")
    # sections: at least N, and "SECTION1" (no space) also marks one
    sections = {"type": "detectable_format:multiple_sections", "splitter": "SECTION", "n": 2}
    assert ok(sections, "SECTION 1\na\nSECTION 2\nb\nSECTION 3\nc")
    assert ok(sections, "SECTION1\nintro\nSECTION2\nmain")
    # any spelling of the json fence
    assert ok({"type": "detectable_format:json_format"}, '```JSON\n{"a": 1}\n```')
    # the end phrase is matched case-insensitively
    assert ok({"type": "startend:end_checker", "end_phrase": "Any other questions?"}, "Done. any OTHER questions?")
    # all capitals / all lowercase must also be English
    german = "Das ist ein schöner Tag und wir gehen heute mit dem Hund in den Park."
    assert not ok({"type": "change_case:english_capital"}, german.upper())
    assert not ok({"type": "change_case:english_lowercase"}, german.lower())
    # a lone quotation mark does not wrap anything
    assert not ok({"type": "startend:quotation"}, ' " ')
    # a response of only whitespace follows nothing, strictly or loosely; a non-string is no response
    for spec in ({"type": "punctuation:no_comma"}, {"type": "keywords:forbidden_words", "words": ["very"]}):
        assert not check(spec, "  \n\t ") and not check_loose(spec, "  \n\t ")
        assert check_loose(spec, None) is False and check(spec, None) is False


def test_loose_variants_that_are_empty_do_not_count_and_each_is_stripped():
    no_comma = {"type": "punctuation:no_comma"}
    # dropping the only line leaves nothing: an empty text would follow "no commas", but it is no response
    assert not check_loose(no_comma, "Hello, world")
    # only the variant without first and last line, stripped, is one paragraph starting with "Today"
    spec = {"type": "length_constraints:nth_paragraph_first_word", "n": 1, "nth": 1, "word": "today"}
    resp = "Sure.\n\n\nToday is fine.\n\nBye."
    assert not check(spec, resp) and check_loose(spec, resp)


def test_sentence_splitter_rules_at_their_edges():
    assert count_sentences("Wait..what happened? Nothing.") == 3  # two or more periods end a sentence
    assert count_sentences("We met at Acme Inc. This was fun.") == 2  # "This" starts a sentence
    assert count_sentences("One\ue001two three.") == 1  # private-use characters in the input are plain spaces


def test_loose_environment_and_its_settings():
    strict, loose = get_env("ifeval"), get_env("ifeval", loose=True)
    p = strict.generate(0, 0)
    p.answer = {"instructions": [{"type": "startend:quotation"}]}
    resp = 'Sure, here you go:\n"Quoted text."'
    s, l = strict.verify(p, resp), loose.verify(p, resp)
    assert (s.correct, s.info["loose"]) == (False, False)
    assert (l.correct, l.reward, l.info["loose"]) == (True, 1.0, True)
    # a negative difficulty is difficulty 0 (one instruction); the cap is the first difficulty with the most
    q = strict.generate(0, -3)
    assert q.difficulty == 0 and len(q.answer["instructions"]) == 1
    from envs.ifeval.env import MAX_INSTRUCTIONS

    cap = strict.max_difficulty
    assert len(strict.generate(1, cap).answer["instructions"]) == MAX_INSTRUCTIONS
    assert len(strict.generate(1, cap - 1).answer["instructions"]) < MAX_INSTRUCTIONS
    # the empty response is always among the corruptions
    assert strict.corruptions(p)[0] == ""


def test_instructions_that_cannot_hold_together_are_never_paired():
    for t in INSTRUCTIONS:
        assert not compatible(t, t)
    # "My answer is yes." is neither all capitals nor all lowercase
    for case in ("change_case:english_capital", "change_case:english_lowercase"):
        assert not compatible(case, "detectable_format:constrained_response")
    # English keywords, options and end phrases are never asked of a response in another language
    env = get_env("ifeval")
    english_only = {"keywords:existence", "keywords:frequency", "detectable_format:constrained_response",
                    "startend:end_checker"}
    seen = 0
    for seed in range(40):
        types = {s["type"] for s in env.generate(seed, 14).answer["instructions"]}
        if "language:response_language" in types:
            seen += 1
            assert not types & english_only, (seed, types)
    assert seen >= 3
