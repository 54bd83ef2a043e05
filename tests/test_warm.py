"""tests/warm.py's switch: GRPO_TEST_WARM=0 makes every launch a real train.py / torchrun."""
from __future__ import annotations

import sys

from tests import util, warm


def test_switched_off_every_launch_is_cold(monkeypatch):
    monkeypatch.setenv(warm.SWITCH_ENV, "0")
    assert not warm.enabled()
    torchrun, entry = util.torchrun_parts(warm=True)
    assert torchrun == [sys.executable, "-m", "torch.distributed.run"]
    assert entry == str(util.ROOT / "train.py")
    assert warm.SOCKET_ENV not in util.env(warm=True)
    p = util.train_py(["--help"], timeout=120)  # the real process: its own interpreter
    assert p.returncode == 0 and "--dry-run" in p.stdout, p.stderr
    assert p.args[:2] == [sys.executable, str(util.ROOT / "train.py")]
    monkeypatch.setenv(warm.SWITCH_ENV, "1")
    assert warm.enabled() and util.torchrun_parts(warm=True)[1].endswith("warm_rank.py")
