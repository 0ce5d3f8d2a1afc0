"""CIFAR-10 models (AlexNet, VGG-16, Inception-V3, a small ViT, small test models) and the registry that builds
them by name."""

from tapp_core.model.graph import ModelError
from tapp_core.model.zoo.alexnet import AlexNet
from tapp_core.model.zoo.inception import InceptionV3
from tapp_core.model.zoo.registry import INPUT_SHAPE, MODEL_NAMES, build_model, build_traced_model
from tapp_core.model.zoo.small import MLP, TinyBranchy, TinyCNN
from tapp_core.model.zoo.vgg import VGG16
from tapp_core.model.zoo.vit import ViT

__all__ = [
    "INPUT_SHAPE",
    "MLP",
    "MODEL_NAMES",
    "VGG16",
    "AlexNet",
    "InceptionV3",
    "ModelError",
    "TinyBranchy",
    "TinyCNN",
    "ViT",
    "build_model",
    "build_traced_model",
]
