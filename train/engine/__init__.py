"""Generation engines behind one contract (see :mod:`train.engine.base`)."""
from train.engine.base import Completion, ContextLengthError, Engine, SamplingParams  # noqa: F401


def __getattr__(name):  # lazy: importing the contract never pulls in the model
    if name == "TorchEngine":
        from train.engine.torch_engine import TorchEngine

        return TorchEngine
    if name == "VLLMEngine":
        from train.engine.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
