"""launcher.stop_grace_s: the time between SIGTERM and SIGKILL at the end of a run covers the trainer's final
checkpoint (12 bytes per parameter at 100 MB/s on top of 30 s), unless the config names it."""
from __future__ import annotations

import pytest

from areal_mq.config import config_from_dict
from areal_mq.launch.launcher import CHECKPOINT_WRITE_MBPS, checkpoint_bytes, default_stop_grace_s


def test_the_grace_grows_with_the_checkpoint(tmp_path):
    from areal_mq.engines.shapes import hf_config

    hf_config("qwen2.5-7b").save_pretrained(str(tmp_path))  # the public 7B config, nothing downloaded
    nbytes = checkpoint_bytes(tmp_path)
    assert 85e9 < nbytes < 95e9  # 7.6 B parameters x 12 bytes
    cfg = config_from_dict({"model": {"name": str(tmp_path)}})
    assert default_stop_grace_s(cfg) == pytest.approx(30.0 + nbytes / (CHECKPOINT_WRITE_MBPS * 1e6))
    assert default_stop_grace_s(cfg) > 15 * 60


def test_a_named_grace_wins_and_a_model_without_config_gets_30_s(tmp_path):
    assert default_stop_grace_s(config_from_dict({"launcher": {"stop_grace_s": 12}})) == 12
    assert default_stop_grace_s(config_from_dict({"model": {"name": str(tmp_path / "nothing")}})) == 30.0
    with pytest.raises(Exception, match="stop_grace_s"):
        config_from_dict({"launcher": {"stop_grace_s": 0}})
