import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.helpers importable however pytest is invoked
# Every rank and launcher job the suite spawns checks, as a GPU would, that collectives get
# device tensors and async copies are waited for ([Note: device-strict mode]).
os.environ.setdefault("DS_EXT_DEVICE_STRICT", "1")


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
