"""OpBuilder: turns a short declarative op class into a loaded torch.ops library.

[Note: op loading]
load() tries, in order:
  1. the prebuilt library installed in the wheel (DS_BUILD_OPS=1 at install time), when it
     was built for a SIMD level this machine has;
  2. a JIT build that is already in the cache and whose stamp (hash of sources, flags,
     torch and Python versions) matches: loaded directly, without asking ninja (fast);
  3. a JIT build with torch.utils.cpp_extension.load + ninja, under a build lock.
Each op registers `TORCH_LIBRARY(ds_<name>, m)`, so a loaded op is `torch.ops.ds_<name>`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from . import cpu_features
from .build_lock import BuildLock
from .errors import OpBuildError

CSRC = Path(__file__).resolve().parent.parent / "csrc"
PREBUILT_PACKAGE = "deepspeed_ext.ops.prebuilt"


class Compat:
    """Result of is_compatible(): truthy when compatible, else carries the reason.

    Upstream's is_compatible() returns a bool, so `if b.is_compatible():` must keep working.
    """

    def __init__(self, reason: str | None = None) -> None:
        self.reason = reason

    def __bool__(self) -> bool:
        return self.reason is None

    def __repr__(self) -> str:
        return "Compat(ok)" if self.reason is None else f"Compat(no: {self.reason})"


def cache_root() -> Path:
    """Per-user, per-torch, per-Python build cache, created 0700.

    A shared world-writable cache would let another user replace the .so we load.
    """
    import torch  # lazily: op_builder must import without torch

    base = os.environ.get("DS_EXT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deepspeed_ext"
    )
    tv = torch.__version__.split("+")[0]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    root = Path(base) / f"torch{tv}_{py}"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_private(Path(base))
    _check_private(root)
    return root


def _check_private(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.getuid():
        raise OpBuildError(
            f"op build cache {path} is owned by uid {st.st_uid}, not you (uid {os.getuid()}); "
            "another user could replace the compiled ops. Set DS_EXT_CACHE_DIR to a directory "
            "of your own."
        )
    if st.st_mode & 0o022:
        # Ours but group/world-writable (e.g. made under a loose umask): tighten it.
        os.chmod(path, 0o700)


class OpBuilder:
    """Base of every op: subclasses only declare what to compile."""

    NAME: ClassVar[str] = ""
    SOURCES: ClassVar[tuple[str, ...]] = ()  # relative to csrc/
    INCLUDES: ClassVar[tuple[str, ...]] = ("includes",)
    BUILD_VAR_SUFFIX: ClassVar[str] = ""  # DS_BUILD_<SUFFIX>; defaults to NAME.upper()

    # -- what subclasses may override ------------------------------------------------------
    def is_compatible(self, verbose: bool = False) -> Compat:
        return Compat()

    def cxx_flags(self) -> list[str]:
        # No -std: torch's headers pick theirs (C++20 for torch 2.13); our own sources are
        # held to C++17 by the CI compile check (.ci/compile_cuda.sh).
        return ["-O3", "-g0", "-fvisibility=hidden"]

    def ld_flags(self) -> list[str]:
        # [Note: one libstdc++] A toolchain that links libstdc++ statically (seen on a GPU
        # image: its g++ is a wrapper, and the ops it built had no libstdc++.so in their
        # NEEDED list) gives the op a second copy of iostreams whose locale was never set
        # up: the first TORCH_CHECK message that formats a number crashes the process.
        # Naming the shared library by file, before the driver's own libraries, resolves
        # every libstdc++ symbol to the copy torch uses (the driver rewrites a plain
        # -lstdc++ to the static archive). _check_one_libstdcxx refuses a build that still
        # carries its own copy.
        return ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []

    def nvcc_flags(self) -> list[str]:
        return []

    def variant(self) -> str:
        """Part of the library name that changes with the build (e.g. the SIMD level)."""
        return ""

    # -- derived -----------------------------------------------------------------------------
    @classmethod
    def build_var(cls) -> str:
        return "DS_BUILD_" + (cls.BUILD_VAR_SUFFIX or cls.NAME.upper())

    @property
    def namespace(self) -> str:
        return f"ds_{self.NAME}"

    def lib_name(self) -> str:
        v = self.variant()
        return f"{self.NAME}_{v}" if v else self.NAME

    def absolute_name(self) -> str:
        return f"{PREBUILT_PACKAGE}.{self.NAME}_op"

    def sources(self) -> list[str]:
        return [str(CSRC / s) for s in self.SOURCES]

    def include_paths(self) -> list[str]:
        return [str(CSRC / i) for i in self.INCLUDES]

    def with_cuda(self) -> bool:
        return False

    def build_dir(self) -> Path:
        return cache_root() / self.lib_name()

    def _stamp(self) -> str:
        """Hash of everything that changes the binary: sources, headers, flags, versions."""
        import torch

        h = hashlib.sha256()
        files = list(self.sources())
        # Headers: the shared includes/, and those beside each source (its core's header).
        # Not all of csrc/, or editing one op would rebuild every other.
        dirs = {Path(i) for i in self.include_paths() if Path(i) != CSRC}
        dirs |= {Path(src).parent for src in self.sources()}
        for d in sorted(dirs):
            files += sorted(str(p) for p in d.iterdir() if p.suffix in (".h", ".cuh", ".hpp"))
        for f in files:
            h.update(f.encode())
            h.update(Path(f).read_bytes())
        for part in (self.cxx_flags(), self.nvcc_flags(), self.ld_flags()):
            h.update(repr(part).encode())
        h.update(torch.__version__.encode())
        h.update(sys.version.encode())
        return h.hexdigest()[:16]

    # -- loading ---------------------------------------------------------------------------------
    def is_loaded(self) -> bool:
        return self.namespace in _loaded

    def load(self, verbose: bool = False) -> Any:
        """Load the op and return its `torch.ops.ds_<name>` namespace."""
        import torch

        if self.namespace in _loaded:
            return getattr(torch.ops, self.namespace)
        compat = self.is_compatible()
        if not compat:
            raise OpBuildError(f"op '{self.NAME}' cannot be used on this machine: {compat.reason}")
        lib = self._prebuilt_path() or self._jit_load(verbose)
        torch.ops.load_library(str(lib))
        _loaded[self.namespace] = str(lib)
        return getattr(torch.ops, self.namespace)

    def prebuilt_path(self) -> Path | None:
        return self._prebuilt_path()

    def _prebuilt_path(self) -> Path | None:
        try:
            spec = importlib.util.find_spec(PREBUILT_PACKAGE)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        for loc in spec.submodule_search_locations:
            for p in sorted(Path(loc).glob(f"{self.lib_name()}_op*.so")):
                return p
        return None

    def cached_path(self) -> Path | None:
        """The JIT-built library if present and up to date, else None."""
        d = self.build_dir()
        so = d / f"{self.lib_name()}.so"
        stamp = d / "stamp"
        if so.exists() and stamp.exists() and stamp.read_text().strip() == self._stamp():
            return so
        return None

    def _jit_load(self, verbose: bool) -> Path:
        cached = self.cached_path()
        if cached is not None:
            return cached
        d = self.build_dir()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        with BuildLock(d / "build.lock", op=self.NAME):
            cached = self.cached_path()  # another process may have built it while we waited
            if cached is not None:
                return cached
            # We hold the lock, so any torch 'lock' baton here is left by a killed build:
            # torch would wait on it forever.
            (d / "lock").unlink(missing_ok=True)
            return self._jit_build(d, verbose)

    def _jit_build(self, d: Path, verbose: bool) -> Path:
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            raise OpBuildError(
                f"op '{self.NAME}' must be built (first use) but ninja is not available; "
                "fix: pip install ninja (or install the op prebuilt: DS_BUILD_OPS=1 pip install "
                "--no-build-isolation .)"
            )
        stamp = self._stamp()
        (d / "stamp").unlink(missing_ok=True)
        print(f"[deepspeed_ext] building op '{self.NAME}' (first use) in {d}", file=sys.stderr)
        t0 = time.perf_counter()
        try:
            cpp_extension.load(
                name=self.lib_name(),
                sources=self.sources(),
                extra_include_paths=self.include_paths(),
                extra_cflags=self.cxx_flags(),
                extra_cuda_cflags=self.nvcc_flags(),
                extra_ldflags=self.ld_flags(),
                build_directory=str(d),
                with_cuda=self.with_cuda(),
                is_python_module=False,
                is_standalone=False,
                verbose=verbose,
            )
        except Exception as exc:  # noqa: BLE001 - rewrapped with the compiler's own lines
            raise self._build_error(d, exc) from None
        _check_one_libstdcxx(self.NAME, d / f"{self.lib_name()}.so")
        (d / "stamp").write_text(stamp)
        dt = time.perf_counter() - t0
        print(f"[deepspeed_ext] built op '{self.NAME}' in {dt:.1f} s", file=sys.stderr)
        return d / f"{self.lib_name()}.so"

    def _build_error(self, d: Path, exc: BaseException) -> OpBuildError:
        text = str(exc)
        cmd = _ninja_compile_command(d / "build.ninja")
        errors = [ln for ln in text.splitlines() if re.search(r"error|fatal", ln, re.I)]
        first = "\n    ".join(errors[:8]) or "\n    ".join(text.splitlines()[-8:])
        return OpBuildError(
            f"building op '{self.NAME}' failed.\n"
            f"  compiler command: {cmd or '(see build.ninja in ' + str(d) + ')'}\n"
            f"  first errors:\n    {first}\n"
            f"  likely fix: {self.build_hint(text)}\n"
            f"  build directory: {d} (rerun with verbose=True for the full log)"
        )

    def build_hint(self, log: str) -> str:
        if re.search(r"(command not found|No such file).*(c\+\+|g\+\+|gcc)|compiler .* not", log):
            return "install a C++17 compiler (e.g. apt-get install g++) or set CXX"
        if "ninja" in log.lower() and "not" in log.lower():
            return "pip install ninja"
        if re.search(r"Python\.h|pybind11", log):
            return "install the Python development headers (python3-dev)"
        return (
            "check the compiler error above; `ds_report` shows the compiler, torch and "
            "SIMD settings used"
        )

    # -- install-time prebuild (setup.py) ----------------------------------------------------------
    def builder(self) -> Any:
        """A setuptools Extension for DS_BUILD_OPS=1 installs."""
        from torch.utils.cpp_extension import CppExtension, CUDAExtension

        ext = CUDAExtension if self.with_cuda() else CppExtension
        flags: dict[str, list[str]] = {"cxx": self.cxx_flags()}
        if self.with_cuda():
            flags["nvcc"] = self.nvcc_flags()
        src_root = Path(__file__).resolve().parent.parent
        return ext(
            name=f"{PREBUILT_PACKAGE}.{self.lib_name()}_op",
            sources=[os.path.relpath(s, src_root) for s in self.sources()],
            include_dirs=self.include_paths(),
            extra_compile_args=flags,
            extra_link_args=self.ld_flags(),
        )


def _ninja_compile_command(ninja_file: Path) -> str:
    """The first compile command of a torch-generated build.ninja, variables expanded."""
    if not ninja_file.exists():
        return ""
    text = ninja_file.read_text()
    variables = dict(re.findall(r"^(\w+) = (.*)$", text, re.M))
    m = re.search(r"^rule compile\n\s*command = (.*)$", text, re.M)
    if not m:
        return ""
    build = re.search(r"^build (\S+): compile (\S+)", text, re.M)
    local = {"out": build.group(1), "in": build.group(2)} if build else {}

    def expand(v: re.Match[str]) -> str:
        return local.get(v.group(1)) or variables.get(v.group(1)) or ""

    return re.sub(r"\$(\w+)", expand, m.group(1)).strip()


def _check_one_libstdcxx(op: str, so: Path) -> None:
    """[Note: one libstdc++]: an op that links libstdc++ statically would crash the process at
    its first error message; refuse it here, with the fix. Needs readelf (binutils, which
    every toolchain that built the op has); without it the check is skipped."""
    readelf = shutil.which("readelf")
    if readelf is None or not sys.platform.startswith("linux"):
        return
    out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or "libstdc++" in out.stdout:
        return
    so.unlink(missing_ok=True)
    cxx = os.environ.get("CXX", "c++")
    raise OpBuildError(
        f"op '{op}': the C++ toolchain ({cxx}) linked libstdc++ statically into {so.name} "
        "(its NEEDED list has no libstdc++.so), so the op would crash at its first error "
        "message; fix: set CXX to a g++ that links libstdc++ dynamically (the default for "
        "g++; look for -static-libstdc++ in a wrapper or specs file)"
    )


# namespace -> library path, for every op this process has loaded
_loaded: dict[str, str] = {}


class CPUOpBuilder(OpBuilder):
    """A CPU op whose binary depends on the machine's SIMD level."""

    def simd(self) -> str:
        return cpu_features.simd_level()

    def variant(self) -> str:
        return self.simd()

    def cxx_flags(self) -> list[str]:
        # [Note: CPU op threads] at::parallel_for is an inline template whose OpenMP pragma
        # compiles into *our* object: without -fopenmp it silently runs on one thread.
        # Linking libgomp.so.1 binds to the copy torch has already loaded (same soname), so
        # torch.set_num_threads governs our kernels too.
        return [*super().cxx_flags(), *cpu_features.simd_flags(self.simd()), "-fopenmp"]

    def ld_flags(self) -> list[str]:
        return [*super().ld_flags(), "-fopenmp"]

    def is_compatible(self, verbose: bool = False) -> Compat:
        if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
            return Compat(f"unsupported CPU architecture {platform.machine()}")
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return Compat("no C++ compiler found (install g++ or set CXX)")
        return Compat()


class CUDAOpBuilder(OpBuilder):
    """A CUDA op: needs a CUDA build of torch, a GPU and an nvcc whose major matches torch's."""

    def with_cuda(self) -> bool:
        return True

    def nvcc_flags(self) -> list[str]:
        return ["-O3", "--use_fast_math", "-lineinfo"]

    def is_compatible(self, verbose: bool = False) -> Compat:
        try:
            import torch
        except ImportError:
            return Compat("torch is not installed")
        if torch.version.cuda is None:
            return Compat(f"torch {torch.__version__} is a CPU-only build")
        nvcc = cuda_nvcc()
        if nvcc is None:
            return Compat("nvcc not found (set CUDA_HOME to the CUDA toolkit)")
        tk = nvcc_version(nvcc)
        if tk and tk.split(".")[0] != torch.version.cuda.split(".")[0]:
            return Compat(
                f"CUDA toolkit {tk} ({nvcc}) and torch's CUDA {torch.version.cuda} differ in "
                "major version; install a matching toolkit or point CUDA_HOME at one"
            )
        return Compat()


def cuda_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


def nvcc_version(nvcc: str) -> str | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out.stdout)
    return m.group(1) if m else None
