"""Generation engines behind one contract (see :mod:`train.engine.base`)."""
from train.engine.base import Completion, ContextLengthError, Engine, SamplingParams  # noqa: F401


def __getattr__(name):  # lazy: importing the contract never pulls in the model
    if name == "TorchEngine":
        from train.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(name)
