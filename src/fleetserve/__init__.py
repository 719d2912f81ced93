"""fleetserve: serve transformer models fast on one machine and across a fleet."""

import os as _os

from fleetserve.core.sampling_params import SamplingParams
from fleetserve.outputs import CompletionOutput, RequestOutput

# OpenMP threads that wait at a barrier spin ~300k times (GNU's default) before sleeping.
# A decode step runs ~150 parallel regions; on a machine shared with other work, a
# spinning thread holds a core the thread it waits for needs, and one stream at 2
# threads fell to 1.2 tok/s (load ~9, SmolLM2 GGUF) against 19 with a short spin. The
# OpenMP runtime (torch's libgomp, which the C kernels share) reads this once, when torch
# is first imported: set GOMP_SPINCOUNT or OMP_WAIT_POLICY yourself to override.
DEFAULT_GOMP_SPINCOUNT = "1000"
SET_GOMP_SPINCOUNT = "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ
if SET_GOMP_SPINCOUNT:
    _os.environ["GOMP_SPINCOUNT"] = DEFAULT_GOMP_SPINCOUNT

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
