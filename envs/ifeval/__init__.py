"""IFEval-style instruction following: the 25 instruction types, their strict and loose checks,
language identification (langdetect, as the reference) and the ``ifeval`` environment."""
from envs.ifeval.instructions import INSTRUCTIONS, check, check_loose, describe  # noqa: F401
from envs.ifeval.lang import detect_language  # noqa: F401
