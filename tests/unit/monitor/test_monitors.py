"""The monitors write upstream's tags at sample counts, read back with each tool's own
reader: TensorBoard's event files, the W&B run, Comet's offline archive."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from deepspeed_ext.config import ConfigError, parse
from tests.helpers.distributed import run_ranks

from . import monitor_runs


def test_every_monitor_gets_upstreams_tags_at_sample_counts(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("comet_ml")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (seen,) = run_ranks(monitor_runs.train_with_every_monitor, 1, str(tmp_path), timeout=240)
    rows = [json.loads(x) for x in (tmp_path / "j" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["samples"]) for r in rows] == [(1, 4), (2, 8), (3, 12), (4, 16)]
    losses = {r["samples"]: r["loss"] for r in rows}

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"Train/Samples/train_loss", "Train/Samples/lr"} <= set(tags), tags
    events = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in events] == [4, 8, 12, 16]
    assert [e.value for e in events] == pytest.approx([losses[s] for s in (4, 8, 12, 16)])

    assert (seen["project"], seen["group"]) == ("proj", "grp")
    assert seen["summary"]["Train/Samples/lr"] == pytest.approx(0.05)
    assert seen["summary"]["Train/Samples/train_loss"] == pytest.approx(losses[12])  # committed

    (archive,) = tmp_path.glob("*.zip")
    messages = zipfile.ZipFile(archive).read("messages.json").decode().splitlines()
    metrics = [json.loads(m)["payload"]["metric"] for m in messages if '"metric_msg"' in m]
    comet_loss = [
        (m["step"], m["metricValue"]) for m in metrics if m["metricName"].endswith("train_loss")
    ]
    # samples_log_interval 8: at most once per 8 samples per tag (upstream's rule)
    assert [s for s, _ in comet_loss] == [4, 12]
    assert [v for _, v in comet_loss] == pytest.approx([losses[4], losses[12]])


@pytest.mark.parametrize(
    ("section", "module", "pip"),
    [
        ("wandb", "wandb", "wandb"),
        ("comet", "comet_ml", "comet-ml"),
        ("tensorboard", "tensorboard", "tensorboard"),
    ],
)
def test_a_monitor_without_its_package_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, section: str, module: str, pip: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as e:
        parse({section: {"enabled": True}})
    assert e.value.problems == [
        f"{section}.enabled: the {module} package is not installed; pip install {pip}, or set "
        f"{section}.enabled to false"
    ]
