"""The model zoo: every model is ``classifier(features(x))`` (see :class:`FedModel`)."""

from feddg.models.base import FedModel
from feddg.models.registry import MODELS, create_model, list_models, load_weights, model_capabilities

__all__ = ["MODELS", "FedModel", "create_model", "list_models", "load_weights", "model_capabilities"]
