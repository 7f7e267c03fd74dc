"""`python -m deepspeed_ext.launcher.bind CORES -- COMMAND...`: run COMMAND on CORES only
('0-3,8'). The launcher's --bind_cores_to_rank uses it where numactl is not installed: the
affinity is set before the command starts, so every thread it makes inherits it."""

from __future__ import annotations

import os
import sys

from deepspeed_ext.utils.numa import parse_range_list


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m deepspeed_ext.launcher.bind CORES -- COMMAND...", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, parse_range_list(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
