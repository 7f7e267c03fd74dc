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


def test_exit_handler_hands_the_gil_to_waiting_threads():
    """A gloo thread of a group that outlives the handler (a user's model holds it) may still
    be waiting for the GIL to free its last finished work; the handler lets it run before
    interpreter finalization, where taking the GIL would kill the thread (SIGABRT)."""
    import threading

    from deepspeed_ext.comm import init

    go, ran = threading.Event(), threading.Event()

    def waiter() -> None:
        go.wait()
        ran.set()  # needs the GIL, as freeing a Python-made tensor does

    t = threading.Thread(target=waiter)
    t.start()
    go.set()
    init._destroy_at_exit()  # no process group here: the releases, then the hand-over
    handed = ran.is_set()
    t.join()
    assert handed, "the thread waiting for the GIL did not run during the exit handler"
