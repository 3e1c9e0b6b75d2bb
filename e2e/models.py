"""Small random-weight GGUF models for the end-to-end harness.

No weights can be downloaded here, so the models are written with the ``gguf`` package: random
f16 matrices, unit norms, and the tokenizer of ``llama.cpp/models/ggml-vocab-llama-spm.gguf``
(SentencePiece, 32000 tokens) from the llama.cpp source tree. The output is gibberish, which is
fine: only the shape of the KV cache matters, and sampling is greedy so runs are reproducible.

Models (cached as ``$CACHE/models/<name>.gguf``):

- ``llama``  plain attention, 8 layers x 512 dims, 8 KV heads of 64: K+V at f16 is
  2 * 8 * 512 * 2 = 16 KiB per token.
- ``llama12`` plain attention, 12 layers x 512 dims, 4 KV heads of 64: 12,288 B per token in
  512-byte rows (24 insertion points per turn).
- ``llama32`` plain attention with Llama-3-8B's KV layout: 32 layers, 8 KV heads of 128
  (128 KiB per token at f16), on 1024 dims with a small FFN.
- ``qwen35`` hybrid (Qwen3.5 layout: gated-delta-net recurrent layers, full attention every 4th
  layer): 8 layers x 512 dims, layers 3 and 7 attention (8 KV heads of 64 -> 4 KiB KV per token),
  6 recurrent layers whose whole state (~0.86 MiB) is rewritten every save.
- ``lfm2``   hybrid (LFM2 short-convolution layers + attention), a fallback with a tiny
  recurrent state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_FILE = "models/ggml-vocab-llama-spm.gguf"
MODEL_REV = "1"  # bump to regenerate cached models


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    arch: str
    n_layer: int
    n_attn_layers: int
    kv_bytes_per_token: int  # K + V of all attention layers, f16
    recurrent_bytes: int  # whole recurrent state of one sequence (f32), 0 if none

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["path"] = str(self.path)
        return d


def _tokenizer_fields(src: Path):
    import gguf

    r = gguf.GGUFReader(str(src))
    out = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer."):
            out[k] = f.contents()
    return out


def _add_tokenizer(w, fields: dict) -> None:
    w.add_tokenizer_model(fields["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in fields:
        w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_scores(fields["tokenizer.ggml.scores"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
    w.add_unk_token_id(int(fields["tokenizer.ggml.unknown_token_id"]))
    w.add_add_bos_token(bool(fields.get("tokenizer.ggml.add_bos_token", True)))
    w.add_add_eos_token(bool(fields.get("tokenizer.ggml.add_eos_token", False)))


class _Tensors:
    def __init__(self, writer, seed: int):
        self.w = writer
        self.rng = np.random.default_rng(seed)

    def mat(self, name: str, n_in: int, n_out: int, std: float | None = None) -> None:
        """ggml shape {n_in, n_out} == numpy (n_out, n_in)."""
        std = std if std is not None else 1.0 / np.sqrt(n_in)
        a = (self.rng.standard_normal((n_out, n_in), dtype=np.float32) * std).astype(np.float16)
        self.w.add_tensor(name, a)

    def vec(self, name: str, n: int, value: float = 1.0, shape=None) -> None:
        a = np.full(shape or (n,), value, dtype=np.float32)
        self.w.add_tensor(name, a)

    def vec_rand(self, name: str, shape, lo: float, hi: float) -> None:
        a = self.rng.uniform(lo, hi, size=shape).astype(np.float32)
        self.w.add_tensor(name, a)


def _write(path: Path, arch: str, build) -> None:
    import gguf

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


def _common(w, arch: str, name: str, n_layer: int, n_embd: int, n_ff: int, n_ctx: int) -> None:
    import gguf

    w.add_name(name)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)


def write_llama(
    path: Path, vocab_src: Path, n_layer=8, n_embd=512, n_head=8, n_head_kv=8, n_ff=1408, n_ctx=4096, seed=1
) -> ModelInfo:
    tok = _tokenizer_fields(vocab_src)
    n_vocab = len(tok["tokenizer.ggml.tokens"])
    hd = n_embd // n_head

    def build(w):
        _common(w, "llama", "kvcfs-e2e-llama", n_layer, n_embd, n_ff, n_ctx)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(10000.0)
        w.add_vocab_size(n_vocab)
        _add_tokenizer(w, tok)
        t = _Tensors(w, seed)
        t.mat("token_embd.weight", n_embd, n_vocab, std=1.0)
        t.vec("output_norm.weight", n_embd)
        t.mat("output.weight", n_embd, n_vocab)
        for i in range(n_layer):
            t.vec(f"blk.{i}.attn_norm.weight", n_embd)
            t.mat(f"blk.{i}.attn_q.weight", n_embd, n_head * hd)
            t.mat(f"blk.{i}.attn_k.weight", n_embd, n_head_kv * hd)
            t.mat(f"blk.{i}.attn_v.weight", n_embd, n_head_kv * hd)
            t.mat(f"blk.{i}.attn_output.weight", n_head * hd, n_embd)
            t.vec(f"blk.{i}.ffn_norm.weight", n_embd)
            t.mat(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_down.weight", n_ff, n_embd)

    if not path.exists():
        _write(path, "llama", build)
    return ModelInfo(
        path.stem.rsplit("-r", 1)[0],
        path,
        "llama",
        n_layer,
        n_layer,
        kv_bytes_per_token=2 * n_layer * n_head_kv * hd * 2,
        recurrent_bytes=0,
    )


def write_llama12(path: Path, vocab_src: Path) -> ModelInfo:
    """12 layers, 4 KV heads of 64: 12,288 B of K+V per token (512-byte rows, 24 insertion points)."""
    return write_llama(path, vocab_src, n_layer=12, n_head_kv=4)


def write_llama32(path: Path, vocab_src: Path) -> ModelInfo:
    """Llama-3-8B's KV shape (32 layers, 8 KV heads of 128: 128 KiB a token at f16) on a narrow
    model (1024 dims, no GQA, small FFN), so a long context is affordable on a CPU."""
    return write_llama(path, vocab_src, n_layer=32, n_embd=1024, n_head=8, n_head_kv=8, n_ff=1024)


def write_qwen35(
    path: Path,
    vocab_src: Path,
    n_layer=8,
    n_embd=512,
    n_head=8,
    n_head_kv=8,
    head_dim=64,
    n_ff=1408,
    n_ctx=4096,
    d_state=64,
    n_k_heads=8,
    n_v_heads=8,
    d_conv=4,
    attn_interval=4,
    seed=2,
) -> ModelInfo:
    """Qwen3.5-style hybrid: gated delta net (linear attention) + full attention every 4th layer."""
    tok = _tokenizer_fields(vocab_src)
    n_vocab = len(tok["tokenizer.ggml.tokens"])
    key_dim = d_state * n_k_heads
    value_dim = d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    is_attn = [(i + 1) % attn_interval == 0 for i in range(n_layer)]

    def build(w):
        _common(w, "qwen35", "kvcfs-e2e-qwen35", n_layer, n_embd, n_ff, n_ctx)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000000.0)
        w.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])
        w.add_uint32("qwen35.ssm.conv_kernel", d_conv)
        w.add_uint32("qwen35.ssm.inner_size", value_dim)
        w.add_uint32("qwen35.ssm.state_size", d_state)
        w.add_uint32("qwen35.ssm.time_step_rank", n_v_heads)
        w.add_uint32("qwen35.ssm.group_count", n_k_heads)
        w.add_uint32("qwen35.full_attention_interval", attn_interval)
        w.add_vocab_size(n_vocab)
        _add_tokenizer(w, tok)
        t = _Tensors(w, seed)
        t.mat("token_embd.weight", n_embd, n_vocab, std=1.0)
        t.vec("output_norm.weight", n_embd)
        t.mat("output.weight", n_embd, n_vocab)
        for i in range(n_layer):
            t.vec(f"blk.{i}.attn_norm.weight", n_embd)
            t.vec(f"blk.{i}.post_attention_norm.weight", n_embd)
            if is_attn[i]:
                t.mat(f"blk.{i}.attn_q.weight", n_embd, head_dim * n_head * 2)
                t.mat(f"blk.{i}.attn_k.weight", n_embd, head_dim * n_head_kv)
                t.mat(f"blk.{i}.attn_v.weight", n_embd, head_dim * n_head_kv)
                t.mat(f"blk.{i}.attn_output.weight", head_dim * n_head, n_embd)
                t.vec(f"blk.{i}.attn_q_norm.weight", head_dim)
                t.vec(f"blk.{i}.attn_k_norm.weight", head_dim)
            else:
                t.mat(f"blk.{i}.attn_qkv.weight", n_embd, conv_dim)
                t.mat(f"blk.{i}.attn_gate.weight", n_embd, value_dim)
                # conv1d {d_conv, conv_dim}: f32, like the converter writes it
                t.vec_rand(f"blk.{i}.ssm_conv1d.weight", (conv_dim, d_conv), -0.5, 0.5)
                t.vec_rand(f"blk.{i}.ssm_dt.bias", (n_v_heads,), -1.0, 1.0)
                t.vec_rand(f"blk.{i}.ssm_a", (n_v_heads,), -1.0, -0.1)
                t.mat(f"blk.{i}.ssm_beta.weight", n_embd, n_v_heads)
                t.mat(f"blk.{i}.ssm_alpha.weight", n_embd, n_v_heads)
                t.vec(f"blk.{i}.ssm_norm.weight", d_state)
                t.mat(f"blk.{i}.ssm_out.weight", value_dim, n_embd)
            t.mat(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_down.weight", n_ff, n_embd)

    if not path.exists():
        _write(path, "qwen35", build)
    n_attn = sum(is_attn)
    n_recr = n_layer - n_attn
    # per recurrent layer: conv state (d_conv-1) x conv_dim f32 + delta-net state d_state^2 x heads f32
    rec = n_recr * ((d_conv - 1) * conv_dim * 4 + d_state * d_state * n_v_heads * 4)
    return ModelInfo(
        "qwen35",
        path,
        "qwen35",
        n_layer,
        n_attn,
        kv_bytes_per_token=2 * n_attn * n_head_kv * head_dim * 2,
        recurrent_bytes=rec,
    )


def write_lfm2(
    path: Path,
    vocab_src: Path,
    n_layer=8,
    n_embd=512,
    n_head=8,
    n_head_kv=8,
    n_ff=1408,
    n_ctx=4096,
    l_cache=3,
    attn_layers=(2, 5, 7),
    seed=3,
) -> ModelInfo:
    """LFM2-style hybrid: short-convolution recurrent layers + attention layers."""
    tok = _tokenizer_fields(vocab_src)
    n_vocab = len(tok["tokenizer.ggml.tokens"])
    hd = n_embd // n_head
    kv_heads = [n_head_kv if i in attn_layers else 0 for i in range(n_layer)]

    def build(w):
        _common(w, "lfm2", "kvcfs-e2e-lfm2", n_layer, n_embd, n_ff, n_ctx)
        w.add_head_count(n_head)
        w.add_head_count_kv(kv_heads)
        w.add_rope_freq_base(1000000.0)
        w.add_uint32("lfm2.shortconv.l_cache", l_cache)
        w.add_vocab_size(n_vocab)
        _add_tokenizer(w, tok)
        t = _Tensors(w, seed)
        t.mat("token_embd.weight", n_embd, n_vocab, std=1.0)
        t.vec("token_embd_norm.weight", n_embd)
        for i in range(n_layer):
            t.vec(f"blk.{i}.attn_norm.weight", n_embd)
            t.vec(f"blk.{i}.ffn_norm.weight", n_embd)
            t.mat(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
            t.mat(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
            if kv_heads[i]:
                t.mat(f"blk.{i}.attn_q.weight", n_embd, n_embd)
                t.mat(f"blk.{i}.attn_k.weight", n_embd, n_head_kv * hd)
                t.mat(f"blk.{i}.attn_v.weight", n_embd, n_head_kv * hd)
                t.mat(f"blk.{i}.attn_output.weight", n_embd, n_embd)
                t.vec(f"blk.{i}.attn_q_norm.weight", hd)
                t.vec(f"blk.{i}.attn_k_norm.weight", hd)
            else:
                t.vec_rand(f"blk.{i}.shortconv.conv.weight", (n_embd, l_cache), -0.5, 0.5)
                t.mat(f"blk.{i}.shortconv.in_proj.weight", n_embd, 3 * n_embd)
                t.mat(f"blk.{i}.shortconv.out_proj.weight", n_embd, n_embd)

    if not path.exists():
        _write(path, "lfm2", build)
    n_attn = len(attn_layers)
    rec = (n_layer - n_attn) * n_embd * (l_cache - 1) * 4
    return ModelInfo(
        "lfm2", path, "lfm2", n_layer, n_attn, kv_bytes_per_token=2 * n_attn * n_head_kv * hd * 2, recurrent_bytes=rec
    )


WRITERS = {
    "llama": write_llama,
    "llama12": write_llama12,
    "llama32": write_llama32,
    "qwen35": write_qwen35,
    "lfm2": write_lfm2,
}


def ensure_model(name: str, cache: Path, src_tree: Path) -> ModelInfo:
    vocab = src_tree / VOCAB_FILE
    if not vocab.exists():
        raise FileNotFoundError(vocab)
    d = cache / "models"
    d.mkdir(parents=True, exist_ok=True)
    return WRITERS[name](d / f"{name}-r{MODEL_REV}.gguf", vocab)


if __name__ == "__main__":  # python -m e2e.models [names...]
    import sys

    from .build import cache_dir, src_tree

    for n in sys.argv[1:] or list(WRITERS):
        print(ensure_model(n, cache_dir(), src_tree()).to_json())
