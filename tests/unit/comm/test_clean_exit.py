"""[Note: clean exit]: the process group we create is really freed at exit (its gloo worker
threads joined) while the interpreter is whole, even after an optimizer imported
torch.distributed.nn, whose group=WORLD defaults would otherwise pin it until interpreter
finalization, where a worker thread releasing its last work aborts the process."""

from tests.helpers.distributed import run_ranks
from tests.unit.comm.exit_runs import threads_around_destroy


def test_exit_destroy_joins_gloo_threads():
    for rank, (before, after) in enumerate(run_ranks(threads_around_destroy, 2)):
        assert after < before, (
            f"rank {rank}: {before} threads before the exit-time destroy, {after} after: "
            "the gloo process group is still alive"
        )
