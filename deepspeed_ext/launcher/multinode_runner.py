"""The multi-node backends, named as upstream's: each turns the parsed `deepspeed` arguments
and the active resources (host -> slot ids) into the one command that starts the job.

- pdsh: one `launch.py` per host over ssh; that launcher starts the host's ranks and keeps
  the job's control connection ([Note: job control channel]).
- openmpi, mpich, impi, mvapich, slurm: the MPI launcher (or srun) starts every rank itself;
  the ranks find their place from its variables (deepspeed_ext.comm.env) and MASTER_ADDR /
  MASTER_PORT, which are exported to them.

Where upstream's backends fail their users, these do not: user ssh options are appended to,
--include/--exclude/--num_nodes/--num_gpus work with the MPI backends (a hostfile of the
active resources is written for them), arguments with spaces, quotes or `%` reach the script
unchanged, and Open MPI is not pinned to an interface named eth0.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, MutableMapping

PDSH_MAX_FAN_OUT = 1024
LAUNCH_MODULE = "deepspeed_ext.launcher.launch"


class MultiNodeRunner(ABC):
    """One backend. `exports` are variables every rank gets (the launcher's PYTHON*/NCCL*/...
    variables and .deepspeed_env), kept unquoted: each backend quotes them its own way."""

    launcher = ""  # the --launcher value
    tool = ""  # the executable whose presence means the backend is installed
    install_hint = ""

    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.user_arguments = self.parse_user_args()
        self.user_script: str = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self.launcher or self.__class__.__name__

    def backend_exists(self) -> bool:
        return shutil.which(self.tool) is not None

    def add_export(self, key: str, var: str) -> None:
        self.exports[key.strip()] = var.strip()

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    def python_exec(self) -> list[str]:
        """What runs the script: the interpreter (with -m for --module) unless --no_python."""
        if self.args.no_python:
            return []
        return [sys.executable, "-u", *(["-m"] if self.args.module else [])]

    def script_cmd(self) -> list[str]:
        """The rank's own command: interpreter (unless --no_python), script, its arguments."""
        return self.python_exec() + [self.user_script, *self.user_arguments]

    def master_exports(self, world_size: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": str(self.args.master_addr),
            "MASTER_PORT": str(self.args.master_port),
            "WORLD_SIZE": str(world_size),
        }

    @abstractmethod
    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        """The command that starts the job; may add to `environment` (the command's env)."""


class PDSHRunner(MultiNodeRunner):
    launcher = "pdsh"
    tool = "pdsh"
    install_hint = "apt-get install pdsh (and passwordless ssh to every host)"
    control = ""  # the runner's control address, set before get_cmd

    def _remote(self, arg: str) -> str:
        """One word of the remote shell command: quoted, and `%` kept from pdsh's substitution."""
        return shlex.quote(arg).replace("%", "%%")

    def launch_args(self) -> list[str]:
        a = self.args
        out = [
            f"--world_info={self.world_info_base64}",
            "--node_rank=%n",  # pdsh fills in each host's index and name
            "--node_host=%h",
            f"--master_addr={a.master_addr}",
            f"--master_port={a.master_port}",
        ]
        if self.control:
            out.append(f"--control={self.control}")
        for flag in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
            if getattr(a, flag):
                out.append(f"--{flag}")
        if a.bind_core_list is not None:
            out.append(f"--bind_core_list={self._remote(a.bind_core_list)}")
        if a.enable_each_rank_log != "None":
            out.append(f"--enable_each_rank_log={self._remote(a.enable_each_rank_log)}")
        return out

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:  # after the user's own options, never instead
            mine = environment.get("PDSH_SSH_ARGS_APPEND", "").strip()
            environment["PDSH_SSH_ARGS_APPEND"] = f"{mine} -p {self.args.ssh_port}".strip()
        hosts = ",".join(active_resources)
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts]
        pdsh += shlex.split(self.args.launcher_args)
        exports = "".join(
            f"export {k}={self._remote(v)}; " for k, v in self.exports.items() if _valid_name(k)
        )
        venv = f"source {self._remote(self.args.venv_script)}; " if self.args.venv_script else ""
        remote = (
            f"{exports}{venv}cd {self._remote(os.path.abspath('.'))}; "
            + " ".join([self._remote(sys.executable), "-u", "-m", LAUNCH_MODULE])
            + " "
            + " ".join(self.launch_args())
            + " "
            + " ".join(self._remote(w) for w in [self.user_script, *self.user_arguments])
        )
        return [*pdsh, remote]

    def kill_cmd(self, active_resources: Mapping[str, list[int]]) -> list[str]:
        """Last resort when hosts do not stop when told: stop this job's node launchers by
        the control token on their command line (no other job has it)."""
        token = self.control.rsplit(":", 1)[-1]
        if not token:
            return []  # an empty pattern would match every process
        hosts = ",".join(active_resources)
        return ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", hosts, f"pkill -TERM -f {token}"]


def _valid_name(key: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) is not None


class MPIFamilyRunner(MultiNodeRunner):
    """Backends where the MPI launcher starts every rank itself."""

    def __init__(
        self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]
    ) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = dict(resource_pool)  # upstream's signature; `active` is used

    def per_node(self, active: Mapping[str, list[int]]) -> tuple[int, int]:
        """(ranks per host, ranks in all) where every host runs as many; else ValueError."""
        counts = {len(s) for s in active.values()}
        if len(counts) != 1:
            shape = ", ".join(f"{h}: {len(s)}" for h, s in active.items())
            raise ValueError(
                f"--launcher {self.launcher} needs the same number of ranks on every host ({shape})"
            )
        per_node = counts.pop()
        return per_node, per_node * len(active)

    def rank_env(
        self, total: int, per_node: int, defaults: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Every rank's variables: the backend's defaults, the exports (which win), rank 0's
        address and the world size, and the thread count of --bind_cores_to_rank."""
        return {
            **(defaults or {}),
            **self.exports,
            **self.master_exports(total),
            **self.bind_env(per_node),
        }

    def hostfile(self, active: Mapping[str, list[int]], with_slots: bool = True) -> str:
        """A hostfile of exactly the active resources (so --include/--exclude apply)."""
        fd, path = tempfile.mkstemp(prefix="deepspeed_hosts_", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            for host, slots in active.items():
                f.write(f"{host} slots={len(slots)}\n" if with_slots else f"{host}\n")
        return path

    def bind_env(self, per_node: int) -> dict[str, str]:
        if not self.args.bind_cores_to_rank:
            return {}
        from deepspeed_ext.utils import numa

        threads, _ = numa.cores_for_rank(self.args.bind_core_list, per_node, 0)
        return {"OMP_NUM_THREADS": str(threads)}


class OpenMPIRunner(MPIFamilyRunner):
    launcher = "openmpi"
    tool = "ompi_info"
    install_hint = "apt-get install openmpi-bin"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        total = sum(len(s) for s in active_resources.values())
        cmd = ["mpirun", "-n", str(total), "-hostfile", self.hostfile(active_resources)]
        cmd += ["--mca", "btl", "^openib", *shlex.split(self.args.launcher_args)]
        per_node = max(len(s) for s in active_resources.values())
        for k, v in self.rank_env(total, per_node, {"UCX_TLS": "tcp"}).items():
            cmd += ["-x", f"{k}={v}"]
        return cmd + self.script_cmd()


class MPICHRunner(MPIFamilyRunner):
    launcher = "mpich"
    tool = "mpirun"
    install_hint = "apt-get install mpich"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        per_node, total = self.per_node(active_resources)
        cmd = ["mpirun", "-n", str(total), "-ppn", str(per_node)]
        cmd += shlex.split(self.args.launcher_args)
        env = {**self.rank_env(total, per_node), "LOCAL_SIZE": str(per_node)}
        for k, v in env.items():
            cmd += ["-genv", k, v]
        cmd += ["-hosts", ",".join(active_resources)]
        return cmd + self.script_cmd()


class IMPIRunner(MPIFamilyRunner):
    launcher = "impi"
    tool = "mpirun"
    install_hint = "install Intel MPI and source its vars.sh"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        per_node, total = self.per_node(active_resources)
        cmd = ["mpirun", "-ppn", str(per_node), *shlex.split(self.args.launcher_args)]
        env = {**self.rank_env(total, per_node), "LOCAL_SIZE": str(per_node)}
        env["I_MPI_PIN"] = "0"  # our binding (if any), not Intel MPI's
        for k, v in env.items():
            cmd += ["-genv", k, v]
        cmd += ["-hosts", ",".join(active_resources)]
        for rank in range(total):  # one argument set per rank, with its rank in its env
            if rank:
                cmd.append(":")
            cmd += [
                "-n",
                "1",
                "-env",
                "RANK",
                str(rank),
                "-env",
                "LOCAL_RANK",
                str(rank % per_node),
            ]
            cmd += self.script_cmd()
        return cmd


class MVAPICHRunner(MPIFamilyRunner):
    launcher = "mvapich"
    tool = "mpiname"
    install_hint = "install MVAPICH2 (mpiname on PATH)"
    # as upstream: no CMA (missing on many kernels), backtraces on failure, DL support
    DEFAULT_EXPORTS = {
        "MV2_SMP_USE_CMA": "0",
        "MV2_DEBUG_SHOW_BACKTRACE": "1",
        "MV2_SUPPORT_DL": "1",
        "MV2_ENABLE_AFFINITY": "0",
        "MV2_INTER_ALLGATHER_TUNING": "5",
        "MV2_CUDA_USE_NAIVE": "0",
    }

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        per_node, total = self.per_node(active_resources)
        hostfile = self.hostfile(active_resources, with_slots=False)
        cmd = ["mpirun", "-np", str(total), "-ppn", str(per_node), "--hostfile", hostfile]
        cmd += shlex.split(self.args.launcher_args)
        for k, v in self.rank_env(total, per_node, self.DEFAULT_EXPORTS).items():
            cmd += ["-env", f"{k}={v}"]
        return cmd + self.script_cmd()


class SlurmRunner(MPIFamilyRunner):
    launcher = "slurm"
    tool = "srun"
    install_hint = "run inside a Slurm allocation (srun on PATH)"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, list[int]]
    ) -> list[str]:
        total = sum(len(s) for s in active_resources.values())
        counts = {len(s) for s in active_resources.values()}
        cmd = ["srun", "-n", str(total), "--nodes", str(len(active_resources))]
        cmd += ["--nodelist", ",".join(active_resources)]
        if len(counts) == 1:
            cmd += ["--ntasks-per-node", str(next(iter(counts)))]
        user = shlex.split(self.args.launcher_args)
        if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in user):
            cmd.append("--kill-on-bad-exit=1")  # one failed rank ends the step on every node
        cmd += user
        comment = getattr(self.args, "slurm_comment", "")
        if comment:
            cmd += ["--comment", comment]
        env = self.rank_env(total, max(counts))
        for k, v in env.items():
            if "," in v:  # srun splits --export at commas
                raise ValueError(f"--launcher slurm cannot export {k}={v!r}: it contains a comma")
        cmd.append(",".join(["--export=ALL", *(f"{k}={v}" for k, v in env.items())]))
        return cmd + self.script_cmd()


RUNNERS: dict[str, type[MultiNodeRunner]] = {
    "pdsh": PDSHRunner,
    "openmpi": OpenMPIRunner,
    "mpich": MPICHRunner,
    "impi": IMPIRunner,
    "mvapich": MVAPICHRunner,
    "slurm": SlurmRunner,
}
