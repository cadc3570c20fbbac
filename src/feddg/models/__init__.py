"""The model zoo: every model is ``classifier(features(x))`` (see :class:`FedModel`)."""

from feddg.models.base import FedModel
from feddg.models.registry import (
    MODELS,
    check_model_params,
    create_model,
    list_models,
    load_weights,
    model_capabilities,
    model_inputs,
    model_targets,
)

__all__ = ["MODELS", "FedModel", "check_model_params", "create_model", "list_models", "load_weights",
           "model_capabilities", "model_inputs", "model_targets"]
