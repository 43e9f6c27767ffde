"""The tiny model is deterministic and its cache is trusted only while its content hash holds."""

from __future__ import annotations

import json
from pathlib import Path

from cachefleet_e2e.vllm_server import TinyModel, tiny_model


def manifest(path: Path) -> dict[str, str]:
    files: dict[str, str] = json.loads((path / "manifest.json").read_text())["files"]
    return files


def test_two_builds_are_byte_identical_and_a_build_is_reused_while_intact(
    vllm_interpreter: Path, tiny: TinyModel, tmp_path: Path
) -> None:
    one = tiny_model(vllm_interpreter, tmp_path / "one")
    two = tiny_model(vllm_interpreter, tmp_path / "two")
    assert one.built
    assert two.built
    assert one.digest == two.digest == tiny.digest
    hashes = manifest(one.path)
    assert hashes == manifest(two.path)
    assert set(hashes) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for name in hashes:
        assert (one.path / name).read_bytes() == (two.path / name).read_bytes(), name
    config = json.loads((one.path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # CPU attention

    # The directory is reused while its files keep their hashes, and rebuilt otherwise.
    again = tiny_model(vllm_interpreter, one.path)
    assert (again.built, again.digest) == (False, one.digest)
    weights = one.path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a damaged copy is not trusted
    repaired = tiny_model(vllm_interpreter, one.path)
    assert (repaired.built, repaired.digest) == (True, one.digest)
