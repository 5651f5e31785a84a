"""The ``fake_kube`` pytest fixture: a started ``FakeKube`` with ``.kubeconfig`` written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .fake import FakeKube


@pytest.fixture
def fake_kube(tmp_path: Path) -> Iterator[FakeKube]:
    """A started ``FakeKube``; ``fake_kube.kubeconfig`` is a kubeconfig file for it."""
    kube = FakeKube().start()
    kube.kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        yield kube
    finally:
        kube.stop()
