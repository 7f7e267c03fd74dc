#!/usr/bin/env bash
# Create a separate virtual environment holding UPSTREAM DeepSpeed, used only
# as a benchmark peer (we run it, we never copy from it).
#
# Idempotent: re-running reuses the venv and skips what is already installed.
# Prints the venv's python path on stdout (logs go to stderr).
#
# Environment knobs:
#   DS_UPSTREAM_VENV     venv location (default ~/.cache/deepspeed_ext/upstream-venv)
#   DS_UPSTREAM_PYTHON   base interpreter (default: python3 on PATH, 3.11 here)
#   DS_UPSTREAM_VERSION  deepspeed version (default 0.19.8)
#   TORCH_VERSION        torch version (default 2.13.0; must be a CPU wheel
#                        reachable via pip's find-links, e.g. /opt/wheels)
#   DS_UPSTREAM_TORCH_EXT  where upstream JIT-builds its ops (default
#                        $DS_UPSTREAM_VENV/torch_extensions, kept apart from
#                        ~/.cache/torch_extensions); upstream_cpu_adam.py uses
#                        the same default
#   DS_UPSTREAM_SKIP_PREBUILD=1  skip the cpu_adam JIT pre-build (~1.5 min)
#
# Pitfalls handled here:
#   * torch is installed FIRST and explicitly, so nothing later pulls a
#     multi-GB CUDA build from PyPI; later installs are constrained to it.
#   * deepspeed's setup.py imports torch, so it is installed with
#     --no-build-isolation (build isolation would fetch a fresh, CUDA, torch).
#   * DS_BUILD_OPS=0: no ahead-of-time op build; ops JIT-build on first use.
#   * DS_ACCELERATOR=cpu: no GPU here; makes accelerator detection explicit
#     (without it upstream falls back to CPU anyway, with a warning).
#   * MAX_JOBS=1: the machine has 2 shared cores.
#   * This repository is itself a package named `deepspeed` (with a
#     deepspeed.egg-info at its root). Any python started with the repo root
#     as cwd or on PYTHONPATH would import/see OUR package instead of
#     upstream, and pip would think deepspeed is already installed. So: run
#     from a neutral directory, unset PYTHONPATH, use `python -P` (3.11+: do
#     not prepend cwd / script dir), and check where things are installed.
set -euo pipefail

VENV="${DS_UPSTREAM_VENV:-$HOME/.cache/deepspeed_ext/upstream-venv}"
BASE_PY="${DS_UPSTREAM_PYTHON:-python3}"
DS_VERSION="${DS_UPSTREAM_VERSION:-0.19.8}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"  # absolute

unset PYTHONPATH PYTHONHOME PYTHONSTARTUP
export DS_ACCELERATOR=cpu
export TORCH_EXTENSIONS_DIR="${DS_UPSTREAM_TORCH_EXT:-$VENV/torch_extensions}"
export DS_BUILD_OPS=0
export MAX_JOBS="${MAX_JOBS:-1}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[setup_upstream] $*" >&2; }

WORKDIR="$(mktemp -d)"
trap 'rm -rf "$WORKDIR"' EXIT
cd "$WORKDIR"   # neutral cwd: never the repo root (see pitfalls above)

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV with $("$BASE_PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$BASE_PY" -m venv "$VENV"
    "$VENV/bin/python" -P -m pip install -q --upgrade pip setuptools wheel >&2
else
    log "reusing venv at $VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -P -m pip)
pip_() { "${PIP[@]}" "$@" >&2; }  # keep stdout for the final path

# have DIST VERSION: true if DIST is installed inside the venv at exactly
# VERSION (for torch, a local tag such as +cpu is allowed).
have() {
    "$PY" -P - "$1" "$2" "$VENV" <<'PYEOF'
import os, sys
from importlib import metadata
name, want, venv = sys.argv[1:4]
try:
    dist = metadata.distribution(name)
except metadata.PackageNotFoundError:
    sys.exit(1)
loc = os.path.realpath(str(dist.locate_file("")))
if not loc.startswith(os.path.realpath(venv) + os.sep):
    sys.exit(1)
v = dist.version
ok = v == want or (name == "torch" and v.split("+")[0] == want)
sys.exit(0 if ok else 1)
PYEOF
}

# 1. torch (CPU) first, explicitly pinned.
if have torch "$TORCH_VERSION"; then
    log "torch $TORCH_VERSION already present"
else
    log "installing torch==$TORCH_VERSION (CPU wheel via find-links)"
    pip_ install "torch==$TORCH_VERSION" numpy
fi
# Refuse to continue with a CUDA torch.
"$PY" -P - <<'PYEOF'
import sys, torch
if torch.version.cuda is not None:
    sys.exit(f"torch {torch.__version__} is a CUDA build; expected CPU-only")
print(f"[setup_upstream] torch {torch.__version__} (cpu-only)", file=sys.stderr)
PYEOF

CONSTRAINTS="$WORKDIR/constraints.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

# 2. deepspeed's other needs (the release's requirements/requirements.txt
#    minus torch; nvidia-ml-py is only added on CUDA machines), with torch
#    pinned so pip cannot swap it.
log "installing deepspeed's other requirements"
pip_ install -q -c "$CONSTRAINTS" \
    einops hjson msgpack ninja numpy "packaging>=20.0" psutil py-cpuinfo \
    "pydantic>=2.0.0" tqdm

# 3. deepspeed itself, no prebuilt ops, no build isolation.
if have deepspeed "$DS_VERSION"; then
    log "deepspeed $DS_VERSION already present"
else
    log "installing deepspeed==$DS_VERSION (DS_BUILD_OPS=0, --no-build-isolation)"
    pip_ install -c "$CONSTRAINTS" --no-build-isolation \
        "deepspeed==$DS_VERSION"
fi

"$PY" -P - "$VENV" <<'PYEOF'
import os, sys, torch, deepspeed
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(deepspeed.__file__).startswith(venv + os.sep), deepspeed.__file__
assert torch.version.cuda is None, torch.__version__
print(f"[setup_upstream] ok: deepspeed {deepspeed.__version__} from {os.path.dirname(deepspeed.__file__)}, "
      f"torch {torch.__version__}", file=sys.stderr)
PYEOF

# 4. JIT-build upstream's cpu_adam op (and the engine's CPU ops) once (it builds on first use; ~85 s on
#    2 cores), so benchmark runs do not pay for it. Quick when already built.
if [ "${DS_UPSTREAM_SKIP_PREBUILD:-0}" != 1 ]; then
    log "ensuring upstream cpu_adam op is built in $TORCH_EXTENSIONS_DIR (first time ~1.5 min)"
    "$PY" -P - <<'PYEOF'
import sys, time, torch
t0 = time.perf_counter()
from deepspeed.ops.adam import DeepSpeedCPUAdam
p = torch.nn.Parameter(torch.zeros(16))
p.grad = torch.ones(16)
opt = DeepSpeedCPUAdam([p], lr=1e-3, adamw_mode=True)
opt.step()
assert torch.all(p < 0), p
print(f"[setup_upstream] cpu_adam ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
PYEOF
    # The engine on CPU (bench/ddp_step.py) also JIT-builds the CPU FusedAdam (the config
    # optimizer Adam/AdamW without offload) and the shared-memory comm op its comm backend
    # loads at init: ~3 min the first time, quick once built.
    log "ensuring upstream fused_adam and deepspeed_shm_comm ops are built (first time ~3 min)"
    "$PY" -P - <<'PYEOF'
import sys, time, torch
t0 = time.perf_counter()
from deepspeed.accelerator import get_accelerator
for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load()
print(f"[setup_upstream] fused_adam, shm_comm ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
PYEOF
fi

echo "$PY"
