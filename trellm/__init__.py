"""trellm: an LLM inference engine and OpenAI-compatible server."""
from trellm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; keep `import trellm` light for the torch-free parts.
    if name == "LLM":
        from trellm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
