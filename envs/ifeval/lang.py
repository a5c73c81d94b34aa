"""A small, dependency-free language identifier for IFEval's response-language instruction.

Two stages: (1) the dominant Unicode script decides languages with their own script (Cyrillic,
Greek, Arabic, Hebrew, Devanagari, Bengali, Tamil, Telugu, Kannada, Malayalam, Gujarati,
Gurmukhi, Thai, Hangul, kana, Han); (2) for Latin script, the language whose stopwords cover the
most tokens wins, with a few diacritics as tie-breakers. Returns an ISO 639-1 code, or ``"und"``
when there is no evidence. It is meant for whole responses of a sentence or more, not for
single words.
"""
from __future__ import annotations

import re

__all__ = ["detect_language", "LANGUAGE_NAMES"]

LANGUAGE_NAMES = {
    "en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian",
    "pt": "Portuguese", "nl": "Dutch", "sv": "Swedish", "pl": "Polish", "fi": "Finnish",
    "tr": "Turkish", "vi": "Vietnamese", "sw": "Swahili", "id": "Indonesian",
    "ru": "Russian", "uk": "Ukrainian", "bg": "Bulgarian", "el": "Greek", "ar": "Arabic",
    "fa": "Persian", "ur": "Urdu", "he": "Hebrew", "hi": "Hindi", "mr": "Marathi", "ne": "Nepali",
    "bn": "Bengali", "ta": "Tamil", "te": "Telugu", "kn": "Kannada", "ml": "Malayalam",
    "gu": "Gujarati", "pa": "Punjabi", "th": "Thai", "ko": "Korean", "ja": "Japanese",
    "zh": "Chinese",
}

# (first, last, script) code-point ranges
_SCRIPTS = [
    (0x0041, 0x024F, "latin"), (0x1E00, 0x1EFF, "latin"),
    (0x0370, 0x03FF, "greek"), (0x1F00, 0x1FFF, "greek"),
    (0x0400, 0x052F, "cyrillic"),
    (0x0590, 0x05FF, "hebrew"),
    (0x0600, 0x06FF, "arabic"), (0x0750, 0x077F, "arabic"), (0xFB50, 0xFDFF, "arabic"), (0xFE70, 0xFEFF, "arabic"),
    (0x0900, 0x097F, "devanagari"), (0x0980, 0x09FF, "bengali"), (0x0A00, 0x0A7F, "gurmukhi"),
    (0x0A80, 0x0AFF, "gujarati"), (0x0B80, 0x0BFF, "tamil"), (0x0C00, 0x0C7F, "telugu"),
    (0x0C80, 0x0CFF, "kannada"), (0x0D00, 0x0D7F, "malayalam"), (0x0E00, 0x0E7F, "thai"),
    (0x1100, 0x11FF, "hangul"), (0x3130, 0x318F, "hangul"), (0xAC00, 0xD7AF, "hangul"),
    (0x3040, 0x30FF, "kana"), (0x4E00, 0x9FFF, "han"), (0x3400, 0x4DBF, "han"),
]

_SCRIPT_LANG = {
    "greek": "el", "hebrew": "he", "bengali": "bn", "gurmukhi": "pa", "gujarati": "gu",
    "tamil": "ta", "telugu": "te", "kannada": "kn", "malayalam": "ml", "thai": "th", "hangul": "ko",
}

_STOPWORDS = {
    "en": "the and of to a in is it that for you was with on as have be at this are not but from or by "
          "they we his her an which will can there all were when your one their what so if about would",
    "de": "der die das und ist nicht ein eine ich sie es zu den mit von auf für sich dem des im auch "
          "wir aber wie noch nach bei aus wenn nur oder sind war hat einen einem",
    "fr": "le la les et des est un une du que qui dans pour pas sur au ce il elle nous vous avec "
          "sont mais ou je ne se plus par son ses cette aux été leur",
    "es": "el la los las y de que en un una es por con para no se del al lo como más pero sus le ya "
          "o este esta son muy también fue hay nos",
    "it": "il lo la gli le e di che un una è per non con del della si sono come ma più anche nel "
          "alla questo questa ci ho hanno dei nella al",
    "pt": "o a os as e de que em um uma é para com não do da dos das se por mais como mas foi ao ele "
          "ela isso você são está também seu sua na no",
    "nl": "de het een en van is dat niet ik je op te in met voor zijn maar ook er aan als bij om dan "
          "wat nog wel naar uit hij zij ze",
    "sv": "och att det som en på är av för med till den har inte om ett men var jag så de han hon "
          "vi kan från eller när",
    "pl": "i w na z że się nie jest do to jak ale co po tak od za czy o jego już tylko dla są był "
          "była przez być",
    "fi": "ja on ei se että hän oli ovat mutta kun tai niin kuin myös ole mitä jos olla sen hänen "
          "vain jo nyt tämä",
    "tr": "ve bir bu da de için ile ne çok ama gibi daha ben sen o var yok olarak kadar en mi değil "
          "sonra her şey",
    "vi": "và của là có không một những được cho các trong người này với đã để như khi thì cũng "
          "tôi bạn về",
    "sw": "na ya wa kwa ni la za katika kuwa hii lakini pia au huo hiyo yake wake sana kama watu "
          "ili hata",
    "id": "dan yang di ini itu dengan untuk tidak dari dalam akan pada juga ke saya ada bisa "
          "mereka atau kami kita",
}
_STOP = {lang: set(words.split()) for lang, words in _STOPWORDS.items()}
_DIACRITIC_HINTS = {
    "de": "äöüß", "fr": "çèêëîôœàù", "es": "ñ¿¡", "pt": "ãõç", "it": "ìòàè", "pl": "ąęłńśźż",
    "tr": "ğışç", "vi": "ơưđạảấầẩẫậắằẳẵặẹẻẽếềểễệỉịọỏốồổỗộớờởỡợụủứừửữựỳỵỷỹ", "sv": "åäö",
    "fi": "äö",
}
_WORD = re.compile(r"[^\W\d_]+")
_MAX_CHARS = 20_000  # enough evidence; keeps the detector O(1) on huge inputs


def _script(ch: str) -> str | None:
    o = ord(ch)
    for lo, hi, name in _SCRIPTS:
        if lo <= o <= hi:
            return name
    return None


def detect_language(text: str) -> str:
    """ISO 639-1 code of the language of ``text`` (``"und"`` if undetermined)."""
    if not isinstance(text, str):
        return "und"
    text = text[:_MAX_CHARS]
    counts: dict[str, int] = {}
    for ch in text:
        if ch.isalpha():
            s = _script(ch)
            if s:
                counts[s] = counts.get(s, 0) + 1
    if not counts:
        return "und"
    script = max(counts, key=counts.get)
    if script in _SCRIPT_LANG:
        return _SCRIPT_LANG[script]
    if script in ("kana", "han"):
        kana, han = counts.get("kana", 0), counts.get("han", 0)
        return "ja" if kana > 0.05 * (han + kana) else "zh"
    if script == "cyrillic":
        if any(c in text for c in "іїєґІЇЄҐ"):
            return "uk"
        return "ru"
    if script == "arabic":
        if any(c in text for c in "ٹڈڑںھے"):
            return "ur"
        if any(c in text for c in "پچژگکی"):
            return "fa"
        return "ar"
    if script == "devanagari":
        return "hi"
    # Latin script: stopword coverage, diacritics break ties
    tokens = [t.lower() for t in _WORD.findall(text)]
    if not tokens:
        return "und"
    low = text.lower()
    best, best_score = "und", 0.0
    for lang, stop in _STOP.items():
        hits = sum(1 for t in tokens if t in stop)
        score = hits + 0.5 * sum(low.count(c) > 0 for c in _DIACRITIC_HINTS.get(lang, ""))
        if score > best_score:
            best, best_score = lang, score
    return best
