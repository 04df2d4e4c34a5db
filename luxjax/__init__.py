"""luxjax: a JAX/XLA inference engine and OpenAI-compatible server for vision-language LLMs."""
from luxjax.api import Generation, Model, load

__all__ = ["Generation", "Model", "load"]
__version__ = "0.1.0"
