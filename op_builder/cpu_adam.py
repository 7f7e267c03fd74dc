from .builder import CPUOpBuilder


class CPUAdamBuilder(CPUOpBuilder):
    NAME = "cpu_adam"
    SOURCES = ("cpu_adam/cpu_adam_core.cpp", "bindings/cpu_adam.cpp")
    INCLUDES = ("includes", ".")
