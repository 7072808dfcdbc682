from specdec.model.config import LlamaConfig
from specdec.model.llama import LlamaModel, resolve_dtype

__all__ = ["LlamaConfig", "LlamaModel", "resolve_dtype"]
