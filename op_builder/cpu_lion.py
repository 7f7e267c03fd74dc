from .builder import CPUOpBuilder


class CPULionBuilder(CPUOpBuilder):
    NAME = "cpu_lion"
    SOURCES = ("cpu_lion/cpu_lion_core.cpp", "bindings/cpu_lion.cpp")
    INCLUDES = ("includes", ".")
