"""sparseserve: long-context LLM serving with dynamic sparse attention over a two-tier KV cache."""
from sparseserve.outputs import CompletionOutput, Logprob, RequestOutput
from sparseserve.request import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # torch-heavy pieces load on first use, so `import sparseserve` stays light
    if name == "LLM":
        from sparseserve.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from sparseserve.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineArgs":
        from sparseserve.engine.args import EngineArgs
        return EngineArgs
    raise AttributeError(name)
