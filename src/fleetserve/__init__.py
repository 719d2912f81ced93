"""fleetserve: serve transformer models fast on one machine and across a fleet."""

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]


def __getattr__(name: str):  # lazy: `import fleetserve` stays light (no torch import)
    if name == "LLM":
        from fleetserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from fleetserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from fleetserve.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(name)
