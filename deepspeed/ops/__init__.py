from . import adagrad, adam, aio, lamb, lion, op_builder

__all__ = ["adagrad", "adam", "aio", "lamb", "lion", "op_builder"]
