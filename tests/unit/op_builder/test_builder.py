"""Build errors, compatibility reasons, cache safety, prebuild selection."""

import os
import stat
from pathlib import Path

import pytest

import deepspeed_ext.op_builder.builder as builder_mod
from deepspeed_ext.op_builder import ALL_OPS, CPUOpBuilder, CUDAOpBuilder, OpBuildError, prebuild


def test_every_op_is_registered():
    assert {"cpu_adam", "cpu_adagrad", "cpu_lion", "fused_adam", "fused_lamb"} <= set(ALL_OPS)


def test_failed_build_names_op_command_error_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_EXT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "broken.cpp"
    src.write_text("#include <torch/library.h>\nint f() { return 1 }\n")

    class Broken(CPUOpBuilder):
        NAME = "broken_op"
        SOURCES = (str(src),)

    with pytest.raises(OpBuildError) as info:
        Broken().load()
    msg = str(info.value)
    assert "op 'broken_op'" in msg
    assert "compiler command:" in msg and "broken.cpp" in msg and "-O3" in msg
    assert "expected" in msg  # the compiler's own first error line
    assert "likely fix:" in msg


def test_cuda_major_mismatch_names_both_versions(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(builder_mod, "cuda_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(builder_mod, "nvcc_version", lambda _: "13.0")

    class Op(CUDAOpBuilder):
        NAME = "x"

    compat = Op().is_compatible()
    assert not compat
    assert "13.0" in compat.reason and "12.4" in compat.reason


def test_cuda_ops_incompatible_on_cpu_torch_with_reason():
    import torch

    if torch.version.cuda is not None:
        pytest.skip("CPU torch build only")
    compat = ALL_OPS["fused_adam"]().is_compatible()
    assert not compat and "CPU-only" in compat.reason
    with pytest.raises(OpBuildError, match="fused_adam"):
        ALL_OPS["fused_adam"]().load()


def test_cache_is_private(tmp_path, monkeypatch):
    base = tmp_path / "c"
    base.mkdir(mode=0o777)
    os.chmod(base, 0o777)
    monkeypatch.setenv("DS_EXT_CACHE_DIR", str(base))
    root = builder_mod.cache_root()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(base.stat().st_mode) & 0o022 == 0  # loosened base was tightened


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to chown a directory to another user")
def test_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    base = tmp_path / "theirs"
    base.mkdir()
    os.chown(base, 65534, 65534)
    monkeypatch.setenv("DS_EXT_CACHE_DIR", str(base))
    with pytest.raises(OpBuildError, match="owned by uid 65534"):
        builder_mod.cache_root()


def test_prebuild_selection(monkeypatch):
    for k in list(os.environ):
        if k.startswith("DS_BUILD_"):
            monkeypatch.delenv(k)
    assert prebuild.selected_ops() == []
    monkeypatch.setenv("DS_BUILD_OPS", "1")
    monkeypatch.setenv("DS_BUILD_CPU_LION", "0")
    chosen = prebuild.selected_ops()
    assert "cpu_adam" in chosen and "cpu_lion" not in chosen
    monkeypatch.setenv("DS_BUILD_OPS", "0")
    monkeypatch.setenv("DS_BUILD_CPU_ADAGRAD", "1")
    assert prebuild.selected_ops() == ["cpu_adagrad"]


def test_explicitly_requested_incompatible_prebuild_fails(monkeypatch):
    import torch

    if torch.version.cuda is not None:
        pytest.skip("CPU torch build only")
    for k in list(os.environ):
        if k.startswith("DS_BUILD_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("DS_BUILD_FUSED_ADAM", "1")
    with pytest.raises(OpBuildError, match="DS_BUILD_FUSED_ADAM=1"):
        prebuild.prebuild_extensions()


def test_bad_simd_override(monkeypatch):
    from deepspeed_ext.op_builder import cpu_features

    monkeypatch.setenv("DS_SIMD", "sse9")
    with pytest.raises(ValueError, match="DS_SIMD='sse9'"):
        cpu_features.simd_level()


def test_sources_exist_for_every_op():
    for name, cls in ALL_OPS.items():
        for s in cls().sources():
            assert Path(s).is_file(), f"{name}: missing source {s}"


def test_missing_ninja_is_named_with_the_fix(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv("DS_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)

    class Fresh(ALL_OPS["cpu_lion"]):  # a name no earlier test has loaded in this process
        NAME = "cpu_lion_fresh"

    with pytest.raises(OpBuildError, match=r"op 'cpu_lion_fresh'.*pip install ninja"):
        Fresh().load()


_NUMBER_CHECK = """#include <torch/library.h>
#include <cstdint>
namespace {
void need_positive(int64_t n) { TORCH_CHECK(n > 0, "n must be > 0, got ", n, " (", 0.5, ")"); }
}  // namespace
TORCH_LIBRARY(ds_%s, m) { m.def("need_positive(int n) -> ()", &need_positive); }
"""


def _static_libstdcxx_op(tmp_path: Path, monkeypatch, name: str) -> type[CPUOpBuilder]:
    """An op built by a g++ wrapper that links libstdc++ statically ([Note: one libstdc++])."""
    import shutil

    if shutil.which("readelf") is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and readelf (binutils)")
    wrapper = tmp_path / "cxx"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("DS_EXT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / f"{name}.cpp"
    src.write_text(_NUMBER_CHECK % name)

    class Op(CPUOpBuilder):
        NAME = name
        SOURCES = (str(src),)

    return Op


def test_a_static_libstdcxx_toolchain_still_links_the_shared_one(tmp_path, monkeypatch):
    """Seen on a GPU image: with its own libstdc++ copy an op's error messages broke off at
    the first number (here) or crashed the process (there)."""
    op = _static_libstdcxx_op(tmp_path, monkeypatch, "one_stdcxx")().load()
    with pytest.raises(RuntimeError, match=r"n must be > 0, got -3 \(0\.5\)"):
        op.need_positive(-3)


def test_an_op_with_its_own_libstdcxx_is_refused_with_the_fix(tmp_path, monkeypatch):
    Op = _static_libstdcxx_op(tmp_path, monkeypatch, "own_stdcxx")
    monkeypatch.setattr(Op, "ld_flags", lambda self: ["-fopenmp"])  # without the guard flag
    with pytest.raises(OpBuildError, match=r"op 'own_stdcxx'.*linked libstdc\+\+ statically.*CXX"):
        Op().load()
    assert not list((tmp_path / "cache").rglob("own_stdcxx*.so"))  # nothing left to load
