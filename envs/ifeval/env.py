"""The ``ifeval`` environment: a writing task with several verifiable instructions.

Difficulty ``d`` sets the number of instructions, ``1 + d // 2`` (at most 8). The generator draws
instruction types that can hold together (see ``_CONFLICTS``), then builds a compliant reference
response constructively: a draft from filler sentences is extended until every "at least"
requirement holds, "less than" thresholds are then drawn above the draft's counts, and the
result is checked with the verifier itself (another draw is made if it fails, so a problem always
has a verified reference).

``verify`` gives ``reward`` = the fraction of instructions followed (``reward="fraction"``, the
default) or 1/0 (``reward="all"``); ``correct`` means all were followed; ``info`` lists each
instruction's verdict. ``loose=True`` uses IFEval's loose checking.
"""
from __future__ import annotations

import json
import random
import re

from envs.base import Environment, Problem, Score, register, strip_think
from envs.ifeval import instructions as ins
from envs.ifeval.instructions import INSTRUCTIONS, RELATIONS, check, check_loose, describe

__all__ = ["IFEvalEnv", "build_problem"]

TASKS = [
    "Write a short essay about the history of bicycles.",
    "Describe a quiet morning in a small mountain village.",
    "Explain why people enjoy gardening.",
    "Write a letter to a friend about a recent trip to the sea.",
    "Give advice to a student who is starting university.",
    "Write a product description for a new kind of reusable water bottle.",
    "Summarize the benefits of learning a second language.",
    "Write a story about a robot who learns to paint.",
    "Describe how a public library could attract more visitors.",
    "Write a blog post about cooking dinner for a large family.",
    "Explain the rules of a board game that you invent.",
    "Write a speech for the opening of a new community park.",
]

FILLER = {
    "en": [
        "This is a topic that rewards careful thought.",
        "Many people have strong opinions about it.",
        "The first step is to look at the facts.",
        "It helps to start with a small plan.",
        "Good habits grow over time with patience.",
        "A calm mind makes better choices.",
        "The details often tell the most useful story.",
        "Friends and family can offer fresh ideas.",
        "Every good project begins with a question.",
        "The best results come from steady work.",
        "It is wise to learn from past mistakes.",
        "Small changes can lead to big improvements.",
        "The weather was mild and the streets were quiet.",
        "People in the town were happy to help.",
        "Reading about the subject can be a joy.",
        "A good story needs a strong ending.",
        "There is always more to learn about the world.",
        "Time spent outdoors is good for the mind.",
        "The plan worked better than anyone expected.",
        "We should keep our goals clear and simple to follow.",
    ],
    "de": [
        "Das ist ein Thema mit vielen Seiten.",
        "Die Menschen in der Stadt sind sehr freundlich.",
        "Wir gehen am Morgen in den Park.",
        "Es ist gut wenn man einen Plan hat.",
        "Die Sonne scheint und der Himmel ist blau.",
        "Ich denke oft an die Zeit am See.",
        "Man kann von jedem Tag etwas lernen.",
        "Die Kinder spielen gern mit dem Hund.",
    ],
    "fr": [
        "Le soleil brille sur la petite ville.",
        "Les enfants jouent dans le jardin avec le chien.",
        "Il est important de prendre son temps.",
        "Nous aimons marcher le long de la rivière.",
        "La vie est pleine de petites surprises.",
        "Je pense que ce projet est une bonne idée.",
        "Les amis sont toujours là pour nous aider.",
        "Une bonne histoire a besoin d'une belle fin.",
    ],
    "es": [
        "El sol brilla sobre la pequeña ciudad.",
        "Los niños juegan en el parque con el perro.",
        "Es importante tener un buen plan.",
        "Nos gusta caminar por la playa al atardecer.",
        "La vida está llena de pequeñas sorpresas.",
        "Creo que este proyecto es una buena idea.",
        "Los amigos siempre están para ayudar.",
        "Una buena historia necesita un final feliz.",
    ],
    "it": [
        "Il sole splende sulla piccola città.",
        "I bambini giocano nel parco con il cane.",
        "È importante avere un buon piano.",
        "Ci piace camminare lungo il fiume.",
        "La vita è piena di piccole sorprese.",
        "Penso che questo progetto sia una buona idea.",
        "Gli amici sono sempre pronti ad aiutare.",
        "Una bella storia ha bisogno di un finale felice.",
    ],
    "pt": [
        "O sol brilha sobre a pequena cidade.",
        "As crianças brincam no parque com o cão.",
        "É importante ter um bom plano.",
        "Nós gostamos de caminhar ao longo do rio.",
        "A vida está cheia de pequenas surpresas.",
        "Eu acho que este projeto é uma boa ideia.",
        "Os amigos estão sempre prontos para ajudar.",
        "Uma boa história precisa de um final feliz.",
    ],
    "ru": [
        "Солнце светит над маленьким городом.",
        "Дети играют в парке с собакой.",
        "Важно иметь хороший план.",
        "Мы любим гулять вдоль реки.",
        "Жизнь полна маленьких сюрпризов.",
        "Я думаю что это хорошая идея.",
        "Друзья всегда готовы помочь.",
        "Хорошей истории нужен счастливый конец.",
    ],
}
LANGUAGES = [k for k in FILLER if k != "en"]
# keywords match as substrings (as IFEval's): none may hide inside a common word ("ember" was credited in "remember",
# "November"; "compass" in "encompass")
KEYWORDS = ["lantern", "harbor", "meadow", "kettle", "orchard", "glacier", "violin", "canyon",
            "pebble", "falcon", "pepper", "quartz", "saddle", "thunder", "walnut", "zephyr"]
FORBIDDEN = ["very", "really", "basically", "actually", "simply", "obviously", "clearly",
             "literally", "totally", "awesome"]
KEYWORD_TEMPLATES = ["The {k} caught my attention.", "I thought about the {k} again.",
                     "A {k} can change the whole picture.", "Nobody forgot the {k} that day."]
LETTERS = list("etaoinsrlh")
END_PHRASES = ["Is there anything else I can help with?", "Let me know if you have additional questions.",
               "Any other questions?", "That is all for today."]
TITLES = ["A Quiet Journey", "Notes on a Small Idea", "The Long Road Home", "Lessons From the Garden",
          "A Day to Remember", "Simple Steps Forward"]
FIRST_WORDS = ["Today", "Finally", "Meanwhile", "Overall", "Imagine", "Sometimes"]
PLACEHOLDERS = ["name", "address", "date", "city", "phone number", "company"]

_LAYOUT = {"length_constraints:number_paragraphs", "length_constraints:nth_paragraph_first_word",
           "detectable_format:multiple_sections"}
_CASE = {"change_case:english_capital", "change_case:english_lowercase", "change_case:capital_word_frequency",
         "language:response_language"}
_WRAP = {"detectable_format:json_format", "startend:quotation", "combination:two_responses",
         "combination:repeat_prompt"}
_CONFLICTS: dict[str, set[str]] = {
    "detectable_format:json_format": _LAYOUT | {"detectable_format:number_bullet_lists", "detectable_format:title",
                                                "detectable_content:postscript", "startend:end_checker",
                                                "detectable_format:constrained_response"},
    "combination:two_responses": _LAYOUT | {"detectable_format:number_bullet_lists"},
    "combination:repeat_prompt": {"language:response_language", "length_constraints:nth_paragraph_first_word"},
    "language:response_language": {"keywords:existence", "keywords:frequency", "detectable_format:constrained_response",
                                   "startend:end_checker", "length_constraints:nth_paragraph_first_word"},
    "change_case:english_lowercase": {"detectable_format:multiple_sections", "detectable_format:constrained_response"},
    "change_case:english_capital": {"detectable_format:constrained_response"},
}
for _group in (_LAYOUT, _CASE, _WRAP):
    for _t in _group:
        _CONFLICTS.setdefault(_t, set()).update(_group - {_t})
for _t, _others in list(_CONFLICTS.items()):
    for _o in _others:
        _CONFLICTS.setdefault(_o, set()).add(_t)

MAX_INSTRUCTIONS = 8


def compatible(a: str, b: str) -> bool:
    return a != b and b not in _CONFLICTS.get(a, set())


# -- drawing instructions ------------------------------------------------------------------------
def _draw_specs(rng: random.Random, k: int, task: str) -> list[dict]:
    types = list(INSTRUCTIONS)
    rng.shuffle(types)
    chosen: list[str] = []
    for t in types:
        if len(chosen) == k:
            break
        if all(compatible(t, c) for c in chosen):
            chosen.append(t)
    kw = rng.sample(KEYWORDS, 4)
    specs = []
    for t in chosen:
        s: dict = {"type": t}
        if t == "keywords:existence":
            s["keywords"] = kw[:2]
        elif t == "keywords:frequency":
            s.update(keyword=kw[2], relation=rng.choice(RELATIONS), n=rng.randint(1, 3))
        elif t == "keywords:forbidden_words":
            s["words"] = rng.sample(FORBIDDEN, 2)
        elif t == "keywords:letter_frequency":
            s.update(letter=rng.choice(LETTERS), relation=rng.choice(RELATIONS), n=rng.randint(5, 25))
        elif t == "language:response_language":
            s["language"] = rng.choice(LANGUAGES)
        elif t == "length_constraints:number_sentences":
            s.update(relation=rng.choice(RELATIONS), n=rng.randint(2, 8))
        elif t in ("length_constraints:number_paragraphs", "detectable_format:multiple_sections"):
            s["n"] = rng.randint(2, 4)
            if t == "detectable_format:multiple_sections":
                s["splitter"] = rng.choice(["Section", "SECTION"])
        elif t == "length_constraints:number_words":
            s.update(relation=rng.choice(RELATIONS), n=rng.randint(20, 90))
        elif t == "length_constraints:nth_paragraph_first_word":
            n = rng.randint(2, 4)
            s.update(n=n, nth=rng.randint(2, n), word=rng.choice(FIRST_WORDS))
        elif t in ("detectable_content:number_placeholders", "detectable_format:number_highlighted_sections"):
            s["n"] = rng.randint(1, 3)
        elif t == "detectable_content:postscript":
            s["marker"] = rng.choice(["P.S.", "P.P.S"])
        elif t == "detectable_format:number_bullet_lists":
            s["n"] = rng.randint(2, 4)
        elif t == "combination:repeat_prompt":
            s["prompt_to_repeat"] = task
        elif t == "startend:end_checker":
            s["end_phrase"] = rng.choice(END_PHRASES)
        elif t == "change_case:capital_word_frequency":
            s.update(relation=rng.choice(RELATIONS), n=rng.randint(2, 6))
        specs.append(s)
    return specs


# -- building a compliant response -------------------------------------------------------------
def _by_type(specs: list[dict]) -> dict[str, dict]:
    return {s["type"]: s for s in specs}


def _at_least(spec: dict) -> bool:
    return spec.get("relation", "at least") == "at least"


def _render(specs: dict[str, dict], blocks: list[list[list[str]]], extras: dict) -> str:
    """The full response from sentence blocks (one list of blocks per response body)."""
    layout = next((t for t in _LAYOUT if t in specs), None)
    bodies = []
    for b, body_blocks in enumerate(blocks):
        texts = [" ".join(sents) for sents in body_blocks]
        if b == 0 and "detectable_format:number_bullet_lists" in specs:
            texts[0] += "\n" + "\n".join(f"- {item}" for item in extras["bullets"])
        if layout == "detectable_format:multiple_sections":
            sp = specs[layout]["splitter"]
            texts = [f"{sp} {i + 1}\n{t}" for i, t in enumerate(texts)]
        if b == 0 and "detectable_format:title" in specs:
            texts[0] = f"<<{extras['title']}>>\n{texts[0]}"
        if b == 0 and "combination:repeat_prompt" in specs:
            texts[0] = specs["combination:repeat_prompt"]["prompt_to_repeat"] + "\n" + texts[0]
        sep = "\n***\n" if layout == "length_constraints:number_paragraphs" else "\n\n"
        bodies.append(sep.join(texts))
    text = "\n******\n".join(bodies)
    if "detectable_content:postscript" in specs:
        text += f"\n{specs['detectable_content:postscript']['marker']} {extras['ps']}"
    if "startend:end_checker" in specs:
        text += " " + specs["startend:end_checker"]["end_phrase"]
    if "change_case:english_capital" in specs:
        text = text.upper()
    elif "change_case:english_lowercase" in specs:
        text = text.lower()
    if "detectable_format:json_format" in specs:
        key = "RESPONSE" if "change_case:english_capital" in specs else "response"
        text = json.dumps({key: text}, ensure_ascii=False)
    if "startend:quotation" in specs:
        text = f'"{text}"'
    return text


def _unmet(specs: dict[str, dict], text: str) -> list[str]:
    """'at least' requirements the draft does not meet yet."""
    need = []
    for t, s in specs.items():
        if t in ("keywords:existence", "detectable_format:constrained_response") or (
                _at_least(s) and t in ("keywords:frequency", "keywords:letter_frequency",
                                       "length_constraints:number_sentences", "length_constraints:number_words",
                                       "change_case:capital_word_frequency",
                                       "detectable_content:number_placeholders",
                                       "detectable_format:number_highlighted_sections")):
            if not check(s, text):
                need.append(t)
    return need


def build_reference(specs_list: list[dict], task: str, rng: random.Random) -> str:
    """A response that follows every instruction (verified by the caller)."""
    specs = _by_type(specs_list)
    lang = specs.get("language:response_language", {}).get("language", "en")
    bank = FILLER[lang]
    order = rng.sample(range(len(bank)), len(bank))
    cursor = [0]

    def next_sentence() -> str:
        s = bank[order[cursor[0] % len(order)]]
        cursor[0] += 1
        return s

    layout = next((t for t in _LAYOUT if t in specs), None)
    n_blocks = specs[layout]["n"] if layout else rng.randint(1, 2)
    n_bodies = 2 if "combination:two_responses" in specs else 1
    blocks = [[[next_sentence()] for _ in range(n_blocks)] for _ in range(n_bodies)]
    if "length_constraints:nth_paragraph_first_word" in specs:
        s = specs["length_constraints:nth_paragraph_first_word"]
        first = blocks[0][s["nth"] - 1]
        first[0] = f"{s['word']} {first[0][0].lower()}{first[0][1:]}"
    extras = {
        "bullets": [next_sentence() for _ in range(specs.get("detectable_format:number_bullet_lists", {}).get("n", 0))],
        "title": rng.choice(TITLES) if lang == "en" else " ".join(bank[0].rstrip(".").split()[:3]),
        "ps": next_sentence(),
    }
    forbidden = set(specs.get("keywords:forbidden_words", {}).get("words", []))
    kw_templates = [t for t in KEYWORD_TEMPLATES if not any(f in t.split() for f in forbidden)]
    slot = 0
    for _ in range(200):
        text = _render(specs, blocks, extras)
        need = _unmet(specs, text)
        if not need:
            break
        t = need[0]
        body = blocks[slot % n_bodies]
        block = body[(slot // n_bodies) % len(body)]
        slot += 1
        if t == "keywords:existence":
            missing = [k for k in specs[t]["keywords"] if ins.count_keyword(text, k) == 0]
            block.append(kw_templates[slot % len(kw_templates)].format(k=missing[0]))
        elif t == "keywords:frequency":
            block.append(kw_templates[slot % len(kw_templates)].format(k=specs[t]["keyword"]))
        elif t == "detectable_format:constrained_response":
            block.append(rng.choice(ins.CONSTRAINED_OPTIONS))
        elif t == "keywords:letter_frequency":
            letter = specs[t]["letter"]
            block.append(max(bank, key=lambda s: (s.lower().count(letter), s)))
        elif t == "change_case:capital_word_frequency":
            words = next_sentence().split()
            words[0] = words[0].upper()
            block.append(" ".join(words))
        elif t == "detectable_content:number_placeholders":
            block.append(next_sentence().rstrip(".") + f" [{PLACEHOLDERS[slot % len(PLACEHOLDERS)]}].")
        elif t == "detectable_format:number_highlighted_sections":
            words = next_sentence().split()
            words[0] = f"*{words[0]}*"
            block.append(" ".join(words))
        else:  # more words / sentences
            block.append(next_sentence())
    text = _render(specs, blocks, extras)
    # "less than" thresholds: above what the finished response has
    counters = {
        "keywords:frequency": lambda s: ins.count_keyword(text, s["keyword"]),
        "keywords:letter_frequency": lambda s: text.lower().count(s["letter"]),
        "length_constraints:number_sentences": lambda s: ins.count_sentences(text),
        "length_constraints:number_words": lambda s: ins.count_words(text),
        "change_case:capital_word_frequency": lambda s: ins.count_capital_words(text),
    }
    for t, s in specs.items():
        if t in counters and not _at_least(s):
            c = counters[t](s)
            s["n"] = c + rng.randint(1, max(2, c // 4 + 1))
    return text


def _violations(spec: dict, ref: str) -> str:
    """The reference changed so that ``spec`` no longer holds (for the self-check)."""
    t = spec["type"]
    rel = spec.get("relation", "at least")
    if t == "keywords:existence":  # keywords match as substrings ("Harbors" holds "harbor")
        return re.sub("|".join(re.escape(k) for k in spec["keywords"]), "thing", ref, flags=re.I)
    if t == "keywords:frequency":
        if rel == "at least":
            return re.sub(re.escape(spec["keyword"]), "thing", ref, flags=re.I)
        return ref + (" " + spec["keyword"]) * spec["n"]
    if t == "keywords:forbidden_words":
        return spec["words"][0] + " " + ref
    if t == "keywords:letter_frequency":
        if rel == "at least":
            return re.sub(re.escape(spec["letter"]), "", ref, flags=re.I)
        return ref + " " + spec["letter"] * spec["n"]
    if t == "language:response_language":
        return " ".join(FILLER["en"])
    if t in ("length_constraints:number_sentences", "length_constraints:number_words"):
        return "Yes" if rel == "at least" else ref + " Yes." * (spec["n"] + 1)
    if t == "length_constraints:number_paragraphs":
        return ref.replace("***", "")
    if t == "length_constraints:nth_paragraph_first_word":
        return re.sub(r"\n\s*\n", "\n", ref)
    if t == "detectable_content:number_placeholders":
        return ref.replace("[", "(").replace("]", ")")
    if t == "detectable_content:postscript":
        return re.sub(r"[Pp]\.\s?([Pp]\.\s?)?[Ss]\.?", "PS", ref)
    if t == "detectable_format:number_bullet_lists":
        return ref + "\n- one more point"
    if t == "detectable_format:constrained_response":
        return re.sub(r"My answer is (yes|no|maybe)\.", "I am not sure", ref)
    if t == "detectable_format:number_highlighted_sections":
        return ref.replace("*", "")
    if t == "detectable_format:multiple_sections":
        return re.sub(re.escape(spec["splitter"]) + r"\s?\d+", "", ref)
    if t == "detectable_format:json_format":
        return "Here it is: " + ref
    if t == "detectable_format:title":
        return ref.replace("<<", "").replace(">>", "")
    if t == "combination:two_responses":
        return ref.replace("******", "")
    if t == "combination:repeat_prompt":
        return "Sure. " + ref
    if t == "startend:end_checker":
        return ref.rstrip().rstrip('"') + " Goodbye."
    if t == "change_case:capital_word_frequency":
        return re.sub(r"\w+", lambda m: m.group(0).lower(), ref) if rel == "at least" else ref + " WOW" * spec["n"]
    if t == "change_case:english_capital":
        return ref.lower()
    if t == "change_case:english_lowercase":
        return ref.upper()
    if t == "punctuation:no_comma":
        return ref.replace(" ", ", ", 1)
    if t == "startend:quotation":
        return ref.strip().strip('"')
    raise ValueError(f"no violation for {t}")


def build_problem(rng: random.Random, k: int) -> tuple[str, list[dict], str]:
    """(prompt, instructions, reference response) with ``k`` instructions; the reference is checked."""
    for _ in range(50):
        task = rng.choice(TASKS)
        specs = _draw_specs(rng, k, task)
        ref = build_reference(specs, task, rng)
        if all(check(s, ref) for s in specs):
            prompt = last = task
            for d in (describe(s) for s in specs):  # after a multi-line example (bullets, sections), on a new line
                prompt += ("\n" if "\n" in last else " ") + d
                last = d
            return prompt, specs, ref
    raise RuntimeError(f"could not build a compliant IFEval reference with {k} instructions")


@register("ifeval")
class IFEvalEnv(Environment):
    """IFEval-style verifiable instructions; difficulty = number of instructions (1 + d // 2)."""

    family = "ifeval"
    description = "a writing task with 1 + d//2 IFEval instructions (25 types); reward = fraction followed"
    instruction = ""
    free_form = True
    max_difficulty = 2 * (MAX_INSTRUCTIONS - 1)

    def __init__(self, loose: bool = False, reward: str = "fraction"):
        if reward not in ("fraction", "all"):
            raise ValueError(f"ifeval reward must be 'fraction' or 'all', got {reward!r}")
        self.loose = bool(loose)
        self.reward_mode = reward

    def generate(self, seed: int, difficulty: int) -> Problem:
        d = max(0, int(difficulty))
        k = min(1 + d // 2, MAX_INSTRUCTIONS)
        prompt, specs, ref = build_problem(self.rng(seed, d), k)
        return self.problem(prompt, {"instructions": specs}, seed, d, reference=ref)

    def check(self, problem: Problem, response: str) -> Score:
        specs = problem.answer["instructions"]
        # the answer is judged, not the thinking before it, nor the blank lines after it ("</think>\n\n": a first
        # empty paragraph put "paragraph N starts with W" one paragraph off)
        response = strip_think(response).lstrip()
        if not response.strip():
            return Score.zero("empty response", format_ok=False)
        fn = check_loose if self.loose else check
        verdicts = [{"type": s["type"], "pass": bool(fn(s, response))} for s in specs]
        passed = sum(v["pass"] for v in verdicts)
        all_ok = passed == len(specs)
        reward = passed / len(specs) if self.reward_mode == "fraction" else float(all_ok)
        return Score(reward, all_ok, True, {"instructions": verdicts, "loose": self.loose})

    def format_answer(self, answer) -> str:
        return json.dumps(answer["instructions"], ensure_ascii=False)

    def reference_response(self, problem: Problem) -> str:
        return problem.meta["reference"]

    def corruptions(self, problem: Problem) -> list[str]:
        ref = self.reference_response(problem)
        return [""] + [_violations(s, ref) for s in problem.answer["instructions"]]
