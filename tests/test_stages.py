import pytest
import torch

from feddg.models import create_model
from feddg.models.stages import conv_stages

MODELS = ["cnn", "lenet", "hfedf-cnn", "alexnet", "resnet18", "vgg11", "swin_tiny_test"]


@pytest.mark.parametrize("name", MODELS)
def test_each_stage_is_called_once_with_a_feature_map(name):
    model = create_model(name, num_classes=10, in_channels=3, image_size=32).eval()
    names = conv_stages(model)
    modules = dict(model.named_modules())
    calls: list[tuple[str, tuple[int, ...]]] = []
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: calls.append((n, tuple(o.shape)))) for n in names]
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert [n for n, _ in calls] == names  # each once, listed in the order the forward runs them
    assert all(len(shape) == 4 and shape[0] == 2 for _, shape in calls), calls


def test_unknown_model_is_rejected():
    with pytest.raises(TypeError, match="stages.py"):
        conv_stages(torch.nn.Linear(2, 2))
