from .builder import CPUOpBuilder


class CPUAdagradBuilder(CPUOpBuilder):
    NAME = "cpu_adagrad"
    SOURCES = ("cpu_adagrad/cpu_adagrad_core.cpp", "bindings/cpu_adagrad.cpp")
    INCLUDES = ("includes", ".")
