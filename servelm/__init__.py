"""servelm: an LLM serving engine with an OpenAI-compatible API and the tools around it."""

from servelm.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for.
    if name == "LLM":
        from servelm.llm import LLM

        return LLM
    raise AttributeError(name)
