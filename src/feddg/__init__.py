"""feddg: federated domain generalization in PyTorch."""

__version__ = "0.1.0"
