"""Mutated configs (bench/config_fuzz.py, fixed seed, a sample of the soak): the validator and
deepspeed.initialize raise nothing but config errors, and every rejection names the key."""

from __future__ import annotations

from collections import Counter

from tests.helpers.distributed import run_ranks

from . import fuzz_runs

fuzz = fuzz_runs.load()


def test_mutated_configs_are_rejected_by_key_and_never_crash_the_validator():
    known = fuzz._known_keys()
    cases = fuzz.sample(300, seed=7)
    results = [fuzz.validate_one(cfg, path, known) for cfg, _, _, path in cases]
    bad = [(c[2], c[3], r) for c, r in zip(cases, results) if r[0] in ("uncaught", "unnamed")]
    assert bad == []
    counts = Counter(r for r, _ in results)
    assert counts["rejected"] > 100 and counts["accepted"] > 50  # the sample exercises both


def test_mutated_configs_through_initialize():
    cases = [(cfg, path) for cfg, _, _, path in fuzz.sample(40, seed=11)]
    results = run_ranks(fuzz_runs.initialize_many, 1, cases, timeout=240)[0]
    bad = [(path, r) for (_, path), r in zip(cases, results) if r[0] in ("uncaught", "unnamed")]
    assert bad == []


def test_the_name_check_is_not_vacuous():
    known = fuzz._known_keys()
    assert fuzz.names_a_key("zero_optimization.stag: unknown key", "zero_optimization.stag", known)
    assert not fuzz.names_a_key("something went wrong", "fp16.enabled", known)
