"""Language identification for IFEval's response-language and English-case instructions, with
``langdetect`` (the port of Google's language-detection that the IFEval reference checker calls),
its random trials seeded so the same text always gets the same answer. Returns an ISO 639-1 code
(``zh`` for both Chinese variants), or ``"und"`` when the text has no letters to judge.
Like the reference, it is meant for whole responses of a sentence or more: a few words can be
taken for another language (langdetect calls "i love my dog" Czech).
"""
from __future__ import annotations

import threading

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

_LOCK = threading.Lock()
_MAX_CHARS = 20_000  # langdetect reads at most 10,000 characters itself; this bounds the copy handed to it


def detect_language(text: str) -> str:
    """``text``'s language as langdetect says it (seeded), ``"und"`` when it finds no features."""
    from langdetect import DetectorFactory, LangDetectException, detect

    with _LOCK:  # the first call loads the profiles; the seed is the factory's, shared by every call
        DetectorFactory.seed = 0
        try:
            lang = detect(text[:_MAX_CHARS])
        except LangDetectException:
            return "und"
    return "zh" if lang.startswith("zh") else lang
