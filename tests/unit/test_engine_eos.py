"""Where the engine's EOS ids come from (transformers' rule), how a request cuts its
output at a stop id or at max_new_tokens, and device names."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.llm import resolve_device  # noqa: E402
from hybridkv.engine.models.loader import eos_token_ids  # noqa: E402
from hybridkv.errors import EngineError, SchedulerError  # noqa: E402
from hybridkv.sched import Request  # noqa: E402


def write(folder, config, generation=None):
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_generation_config_wins_even_without_an_eos(tmp_path):
    """transformers loads generation_config.json when present: its eos (or none) counts,
    config.json's is then ignored."""
    assert eos_token_ids(write(tmp_path, {"eos_token_id": 2}, {"pad_token_id": 0})) == ()
    assert eos_token_ids(write(tmp_path, {"eos_token_id": 2}, {"eos_token_id": [5, 7]})) == (5, 7)
    assert eos_token_ids(write(tmp_path, {"eos_token_id": 2}, {"eos_token_id": None})) == ()


def test_config_eos_without_generation_config(tmp_path):
    assert eos_token_ids(write(tmp_path, {"eos_token_id": 257})) == (257,)
    assert eos_token_ids(write(tmp_path, {"eos_token_id": [1, 2]})) == (1, 2)
    assert eos_token_ids(write(tmp_path, {"text_config": {"eos_token_id": 9}})) == (9,)
    assert eos_token_ids(write(tmp_path, {"model_type": "qwen3"})) == ()
    with pytest.raises(EngineError, match="eos_token_id"):
        eos_token_ids(write(tmp_path, {"eos_token_id": "</s>"}))


def request(max_new_tokens=5, stop=()):
    return Request("r", [1, 2], max_new_tokens, stop_token_ids=frozenset(stop))


def test_emit_cuts_after_the_first_stop_id_and_at_max_new_tokens():
    req = request(stop={9})
    assert req.num_to_emit([4, 9, 5]) == 2  # the stop id is emitted, what follows is not
    req.emit([4])
    assert not req.done
    req.emit([9])
    assert req.done and req.finish_reason == "stop" and req.output == [4, 9]
    with pytest.raises(SchedulerError):
        req.emit([3])

    req = request(max_new_tokens=3)
    assert req.num_to_emit([4, 5, 6, 7]) == 3
    with pytest.raises(SchedulerError):  # not cut first
        req.emit([4, 5, 6, 7])
    req.emit([4, 5, 6])
    assert req.finish_reason == "length"


def test_stop_id_at_the_last_allowed_token_is_a_stop():
    req = request(max_new_tokens=2, stop={9})
    req.emit([4, 9])
    assert req.finish_reason == "stop"


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(EngineError):
        resolve_device("tpu")
    with pytest.raises(EngineError):
        resolve_device("not a device")
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="CUDA"):
            resolve_device("cuda")
