"""Hostfile format (`host slots=N`, comments, blank lines) and --include/--exclude syntax."""

import pytest

from deepspeed_ext.launcher.hostfile import (
    HostfileError,
    fetch_hostfile,
    parse_hostfile,
    parse_inclusion_exclusion,
    parse_resource_filter,
)

HOSTFILE = """
# the cluster
worker-0 slots=4
worker-1 slots=2   # trailing comment

   worker-2    slots=8
"""


def test_parse_keeps_order_and_skips_comments_and_blanks():
    pool = parse_hostfile(HOSTFILE.splitlines())
    assert pool == {"worker-0": 4, "worker-1": 2, "worker-2": 8}
    assert list(pool) == ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("worker-0 slots=4\nworker-0 slots=2\n", "listed twice"),
        ("worker-0\n", "bad entry"),
        ("worker-0 slots=four\n", "bad entry"),
        ("worker-0 slots=4 extra\n", "bad entry"),
        ("# only a comment\n\n", "lists no hosts"),
        ("worker-0 slots=0\n", "slots=0: give it 1 or more"),  # it ran nothing, rc 0
    ],
)
def test_bad_hostfiles_are_rejected_with_the_line(text, needle):
    with pytest.raises(HostfileError, match=needle):
        parse_hostfile(text.splitlines(), source="hf")


def test_error_names_file_and_line():
    with pytest.raises(HostfileError, match=r"^hf:3: bad entry"):
        parse_hostfile(["a slots=1", "", "b slots"], source="hf")


def test_fetch_hostfile(tmp_path):
    assert fetch_hostfile(str(tmp_path / "missing")) is None
    f = tmp_path / "hostfile"
    f.write_text("localhost slots=2\n")
    assert fetch_hostfile(str(f)) == {"localhost": 2}


POOL = {"worker-0": 4, "worker-1": 2, "worker-2": 3}


@pytest.mark.parametrize(
    "include, exclude, expected",
    [
        ("", "", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1], "worker-2": [0, 1, 2]}),
        ("worker-1", "", {"worker-1": [0, 1]}),
        ("worker-0:0,2@worker-2", "", {"worker-0": [0, 2], "worker-2": [0, 1, 2]}),
        # the hostfile's host order decides rank order, whatever order the filter names
        ("worker-2:1@worker-0:3", "", {"worker-0": [3], "worker-2": [1]}),
        # include keeps the slot order given, without duplicates
        ("worker-0:2,0,2", "", {"worker-0": [2, 0]}),
        ("", "worker-1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1, 2]}),
        (
            "",
            "worker-0:0,3@worker-2:1",
            {"worker-0": [1, 2], "worker-1": [0, 1], "worker-2": [0, 2]},
        ),
        ("", "worker-1:0,1", {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1, 2]}),
    ],
)
def test_include_exclude(include, exclude, expected):
    got = parse_inclusion_exclusion(POOL, include, exclude)
    assert got == expected
    assert list(got) == list(expected)


@pytest.mark.parametrize(
    "include, exclude, needle",
    [
        ("worker-0", "worker-1", "mutually exclusive"),
        ("worker-9", "", "'worker-9' .* not in the pool"),
        ("", "worker-9:0", "'worker-9' .* not in the pool"),
        ("worker-1:5", "", "no slot 5 on host 'worker-1'"),
        ("worker-1:a", "", "bad slot list"),
    ],
)
def test_filter_errors(include, exclude, needle):
    with pytest.raises(HostfileError, match=needle):
        parse_inclusion_exclusion(POOL, include, exclude)


def test_filter_on_explicit_slot_ids():
    """The local pool's slots can be GPU ids (CUDA_VISIBLE_DEVICES=2,3), not 0..n-1."""
    assert parse_resource_filter({"localhost": [2, 3]}, "localhost:3") == {"localhost": [3]}
    assert parse_resource_filter({"localhost": [2, 3]}, "", "localhost:2") == {"localhost": [3]}
    with pytest.raises(HostfileError, match="no slot 0"):
        parse_resource_filter({"localhost": [2, 3]}, "localhost:0")
