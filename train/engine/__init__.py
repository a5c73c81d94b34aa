"""Generation engines behind one contract (see :mod:`train.engine.base`)."""
from train.engine.base import Completion, ContextLengthError, Engine, SamplingParams  # noqa: F401
