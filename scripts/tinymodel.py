"""Build the tiny Llama that the real-vLLM test tier serves: deterministic, offline, cached.

Run with vLLM's own interpreter (``.venv-vllm/bin/python scripts/tinymodel.py OUT``): it
needs torch, transformers, tokenizers and safetensors, which the project's venv does not
promise. Nothing is downloaded:

* the tokenizer is a byte-level BPE trained here, with ``tokenizers``, on a corpus made
  here from a fixed word list and a fixed seed, plus chat special tokens and a chat
  template (so ``/tokenize`` with ``messages`` and ``/v1/chat/completions`` work);
* the model is ``LlamaForCausalLM`` with random weights from a fixed seed: 2 layers,
  hidden 128, 4 attention heads of 32 (vLLM's CPU attention needs head_dim >= 32),
  2 KV heads, bfloat16; about 0.5 KiB of KV cache per token.

Every file is written with sorted keys and no timestamps, so two builds are byte-identical
(tests/vllm/test_tinymodel.py builds twice and compares). ``OUT/manifest.json`` records the
recipe (a hash of this file and of the versions of the libraries that write the files) and
the sha256 of every file; a later run whose recipe matches and whose files still hash the
same reuses the directory instead of building (about 0.1 s instead of several seconds).

Prints one JSON line: ``{"path", "built", "digest", "seconds"}`` (digest: sha256 over the
manifest's file hashes, the model's identity).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Libraries whose versions decide the bytes written (part of the recipe).
LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")
SEED = 20261205
MANIFEST = "manifest.json"
#: The tokenizer's vocabulary (the BPE stops earlier if the corpus runs out of merges).
VOCAB_SIZE = 1024
MAX_POSITIONS = 4096
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
#: The corpus's words (the sentences are drawn from them with SEED).
WORDS = (
    "the a an of to in on for with and or but cache caches cached caching prefix block "
    "blocks token tokens model server servers request requests answer answers tenant "
    "tenants router route routes routing sidecar fleet pod pods queue queued waiting "
    "running memory bytes hit hits miss misses evict evicted eviction store stored "
    "hello world question questions what why how when where who is are was were be been "
    "system user assistant chat message messages conversation turn turns long short "
    "first second third last next previous one two three four five six seven eight nine "
    "ten hundred thousand price prices cost saving savings latency fast slow warm cold "
    "kubernetes operator invalidation version epoch redis metrics prometheus vllm "
    "please tell me about your explain describe summarise compare list name give"
)


def recipe() -> str:
    """Hash of what decides the output: this file and the writing libraries' versions."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for name in LIBRARIES:
        h.update(f"\0{name}={importlib.metadata.version(name)}".encode())
    return h.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def digest_of(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def reusable(out: Path, wanted: str) -> dict[str, str] | None:
    """The directory's file hashes when it holds an intact build of this recipe."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("recipe") != wanted:
        return None
    hashes = file_hashes(out)
    return hashes if hashes == manifest.get("files") else None


def corpus() -> list[str]:
    rng = random.Random(SEED)
    vocabulary = WORDS.split()
    lines = []
    for _ in range(4000):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(4, 16))]
        lines.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return lines


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # Round-trip through JSON with sorted keys: the file's bytes do not depend on the
    # library's map ordering.
    write_json(out / "tokenizer.json", json.loads(tokenizer.to_str()))
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"},
    )
    size: int = tokenizer.get_vocab_size()
    return size


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    bos, eos, pad = (SPECIAL_TOKENS.index(t) for t in ("<s>", "</s>", "<pad>"))
    config = LlamaConfig(
        vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **MODEL
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(
        dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["torch_dtype"] = config_dict["dtype"] = "bfloat16"
    write_json(out / "config.json", config_dict)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad},
    )


def build(out: Path, wanted: str) -> dict[str, str]:
    """Build into a fresh sibling directory, then swap it in (a crash leaves no half model)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)
    try:
        build_model(staging, build_tokenizer(staging))
        hashes = file_hashes(staging)
        write_json(staging / MANIFEST, {"recipe": wanted, "files": hashes})
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(staging, out)
        except OSError:
            # Another build (a second test session) put its copy there first: the same
            # bytes, if it is intact.
            if reusable(out, wanted) != hashes:
                raise
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return hashes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory of the model (created or reused)")
    parser.add_argument("--force", action="store_true", help="build even if OUT is reusable")
    args = parser.parse_args(argv)
    started = time.monotonic()
    out: Path = args.out.resolve()
    wanted = recipe()
    hashes = None if args.force else reusable(out, wanted)
    built = hashes is None
    if hashes is None:
        hashes = build(out, wanted)
    report = {
        "path": str(out),
        "built": built,
        "digest": digest_of(hashes),
        "seconds": round(time.monotonic() - started, 3),
    }
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
