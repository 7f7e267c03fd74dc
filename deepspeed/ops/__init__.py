from . import adagrad, adam, lamb, lion, op_builder

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder"]
