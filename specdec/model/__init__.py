from specdec.model.config import ModelConfig
from specdec.model.decoder import Model, load_model, resolve_dtype
from specdec.model.source import ModelSource, ModelSourceError, resolve_model_source

__all__ = ["Model", "ModelConfig", "ModelSource", "ModelSourceError", "load_model", "resolve_dtype",
           "resolve_model_source"]
