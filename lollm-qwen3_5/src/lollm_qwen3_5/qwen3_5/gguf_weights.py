"""A qwen3_5 GGUF written by llama.cpp's converter, read back as the checkpoint transformers holds.

llama.cpp's converter (``convert_hf_to_gguf.py``; the classes ``Qwen3_5TextModel`` ->
``_LinearAttentionVReorderBase`` -> ``Qwen3NextModel`` -> ``Qwen2MoeModel`` in its
``conversion/qwen.py``, with ``_QwenMtpMixin`` for the MTP layer) renames every tensor
and changes some of them. This module says, as data and small functions, how to
undo each change, so the model loads the same numbers as from safetensors:

==============================  ====================================  ===========================================
GGUF tensor                     model tensor                          what the converter did -> what we undo
==============================  ====================================  ===========================================
``blk.N.*norm.weight`` (all     ``...layernorm``, ``q_norm``,         stored ``w + 1`` (Qwen3.5's RMSNorm scales by
but ``ssm_norm``)               ``k_norm``, ``model.norm``, MTP norms (1 + w)) -> subtract 1
``blk.N.ssm_a``                 ``linear_attn.A_log``                 stored ``-exp(A_log)`` -> ``log(-ssm_a)``
``blk.N.ssm_dt.bias``           ``linear_attn.dt_bias``               renamed only
``blk.N.ssm_conv1d.weight``     ``linear_attn.conv1d.weight``         (C, 1, W) squeezed to (C, W) -> unsqueeze
value heads, when Hv != Hk      in_proj_qkv (v rows), in_proj_z,      reordered from grouped by key head to tiled
                                in_proj_a/b, A_log, dt_bias, conv1d   -> :func:`tiled_to_grouped` (rows; out_proj's
                                (v channels), out_proj (columns)      columns)
``blk.N.attn_q.weight``         ``self_attn.q_proj.weight``           kept whole: queries and output gates, per head
``blk.L.*`` (L = layers)        ``mtp.layers.0.*``                    the MTP layer as one more block;
``blk.L.nextn.eh_proj`` ...     ``mtp.fc``, ``pre_fc_norm_*``,        ``nextn.*`` names (:data:`GGUF_MTP_NAMES`)
                                ``mtp.norm``
==============================  ====================================  ===========================================

Value-head order: a DeltaNet query/key head serves ``r = Hv / Hk`` value heads.
transformers keeps them grouped by key head (``k0v0 k0v1 k1v0 k1v1``); ggml's
broadcast wants them tiled (``k0v0 k1v0 k0v1 k1v1``), so the converter reorders
every tensor with one entry per value head or value channel. With Hv == Hk
(Qwen3.5-0.8B) the order is the same and nothing moves.

:class:`ConvertedGGUF` is a TensorSource over the file that hands out each tensor
under its GGUF name but in the form transformers holds it (shape and numbers);
:func:`gguf_name_map` maps the names to the model's. A tensor packed by the
quantized load (docs/quantized-execution.md) keeps its blocks: only row moves can
be undone on blocks, so ``out_proj`` stays float when its columns were reordered.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import torch

from lollm.errors import WeightsError

from .config import Qwen3_5Config

#: GGUF name -> model name for the decoder (``{i}``: a block index; gguf-py's ``MODEL_TENSORS[QWEN35]``).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    # Gated DeltaNet layers
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
    # gated full-attention layers (biases only with attention_bias)
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    # SwiGLU MLP
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

#: The MTP block's own tensors (block index L = num_hidden_layers); its attention and MLP
#: use the decoder's names above, mapped to ``mtp.layers.0.*``.
GGUF_MTP_NAMES = {
    "blk.{i}.nextn.eh_proj.weight": "mtp.fc.weight",
    "blk.{i}.nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "blk.{i}.nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "blk.{i}.nextn.shared_head_norm.weight": "mtp.norm.weight",
}

#: Which GGUF tensors each kind of block holds (templates of :data:`GGUF_NAMES`); biases apart.
_COMMON = ("attn_norm.weight", "post_attention_norm.weight")
_LINEAR = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight",
           "ssm_a", "ssm_dt.bias", "ssm_norm.weight", "ssm_out.weight")
_FULL = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight")
_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
_MLP = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def expected_names(config: Qwen3_5Config) -> set[str]:
    """Every GGUF tensor name a converter-written file of ``config`` holds (MTP block included when it has one)."""
    names = {"token_embd.weight", "output_norm.weight"} | (set() if config.tie_word_embeddings else {"output.weight"})
    full_kinds = _FULL + (_BIASES if config.attention_bias else ())
    for i, kind in enumerate(config.layer_types):
        mixer = _LINEAR if kind == "linear_attention" else full_kinds
        names |= {f"blk.{i}.{t}" for t in _COMMON + mixer + _MLP}
    for j in range(config.mtp_num_hidden_layers):
        i = config.num_hidden_layers + j
        nextn = [t.format(i=i) for t in GGUF_MTP_NAMES]
        names |= {f"blk.{i}.{t}" for t in _COMMON + full_kinds + _MLP} | set(nextn)
    return names


def gguf_name_map(config: Qwen3_5Config) -> Callable[[str], str]:
    """GGUF name -> model name; a block index from ``num_hidden_layers`` on is the MTP layer.

    Raises WeightsError naming a tensor this family does not know.
    """
    layers = config.num_hidden_layers

    def name_map(gguf_name: str) -> str:
        match = _BLOCK.match(gguf_name)
        if match is None:
            template, index = gguf_name, None
        else:
            template, index = f"blk.{{i}}.{match[2]}", int(match[1])
        if index is not None and index >= layers:  # the MTP layer, one block past the decoder
            target = GGUF_MTP_NAMES.get(template) or GGUF_NAMES.get(template, "").replace("model.layers.", "mtp.layers.")
            index -= layers
        else:
            target = GGUF_NAMES.get(template)
        if not target:
            raise WeightsError(f"qwen3_5: unexpected tensor {gguf_name!r} in the GGUF file: no qwen3_5 weight has that name")
        return target if index is None else target.format(i=index)

    return name_map


def tiled_to_grouped(key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """The index that puts value heads back in transformers' order: ``grouped = tiled[index]``.

    The converter laid ``key_heads * per_key`` heads of ``width`` entries out as
    (per_key, key_heads, width) where transformers has (key_heads, per_key, width);
    entry (k, v, c) of the grouped order sits at ``(v * key_heads + k) * width + c``.
    """
    n = key_heads * per_key * width
    return torch.arange(n).reshape(per_key, key_heads, width).permute(1, 0, 2).reshape(n)


class ConvertedGGUF:
    """A TensorSource over a converter-written qwen3_5 GGUF: GGUF names, transformers' tensors.

    source: a :class:`lollm.gguf.GGUFTensorSource`; config: from :func:`.config.config_from_gguf`.
    Construction checks the file holds exactly :func:`expected_names` (WeightsError naming
    the first tensor missing or unexpected). ``read`` returns a tensor with the
    converter's changes undone (module docstring); ``read_raw`` the stored blocks, rows
    put back in order (a packed load); ``shape`` the shape transformers has.
    """

    fmt = "gguf"

    def __init__(self, source, config: Qwen3_5Config):
        self._source = source
        present, expected = set(source.names()), expected_names(config)
        for name in sorted(expected - present, key=_natural):
            raise WeightsError(f"qwen3_5: the GGUF file has no tensor {name!r}")
        for name in sorted(present - expected, key=_natural):
            raise WeightsError(f"qwen3_5: unexpected tensor {name!r} in the GGUF file: no qwen3_5 weight of this "
                               f"config has that name")
        c = config
        self._reorder = c.linear_num_value_heads != c.linear_num_key_heads
        per_key = c.linear_num_value_heads // c.linear_num_key_heads
        self._heads = tiled_to_grouped(c.linear_num_key_heads, per_key, 1)
        self._channels = tiled_to_grouped(c.linear_num_key_heads, per_key, c.linear_value_head_dim)
        qk = 2 * c.linear_num_key_heads * c.linear_key_head_dim  # q and k channels ahead of v in qkv / conv1d
        self._qkv = torch.cat((torch.arange(qk), qk + self._channels))

    def quantizable(self, pattern: str) -> str:
        """The family's QUANTIZABLE pattern for this file: out_proj left out when its columns were reordered."""
        return f"(?!.*linear_attn\\.out_proj)(?:{pattern})" if self._reorder else pattern

    def names(self) -> list[str]:
        return self._source.names()

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def __len__(self) -> int:
        return len(self._source)

    def dtype(self, name: str) -> str:
        return self._source.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._source.shape(name))
        return (shape[0], 1, shape[1]) if name.endswith("ssm_conv1d.weight") and len(shape) == 2 else shape

    def _rows(self, name: str) -> torch.Tensor | None:
        """The row order that undoes the value-head reorder of ``name`` (None: rows stay as they are)."""
        block = _BLOCK.match(name)
        if not self._reorder or block is None:
            return None
        kind = block[2].split(".")[0]  # "attn_qkv.weight" -> "attn_qkv", "ssm_a" -> "ssm_a"
        return {"attn_qkv": self._qkv, "ssm_conv1d": self._qkv, "attn_gate": self._channels, "ssm_beta": self._heads,
                "ssm_alpha": self._heads, "ssm_a": self._heads, "ssm_dt": self._heads}.get(kind)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as transformers holds it (float32): the converter's changes undone."""
        tensor = self._source.read(name)
        block = _BLOCK.match(name)
        leaf = block[2] if block else name
        # 1. Value heads back to grouped order (rows; out_proj's columns).
        rows = self._rows(name)
        if rows is not None:
            tensor = tensor.index_select(0, rows)
        if self._reorder and leaf == "ssm_out.weight":
            tensor = tensor.index_select(1, self._channels)
        # 2. The converter's arithmetic undone.
        if leaf == "ssm_a":
            return torch.log(-tensor)  # ssm_a = -exp(A_log)
        if leaf == "ssm_conv1d.weight":
            return tensor.unsqueeze(1)  # (C, W) -> (C, 1, W)
        if leaf.endswith("norm.weight") and leaf != "ssm_norm.weight":
            return tensor - 1.0  # stored 1 + w
        return tensor

    def read_slice(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """A slice of one tensor (--tp): read whole, undone, then cut."""
        whole = self.read(name)
        return torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim=dim).clone()

    def read_raw(self, name: str, start_row: int = 0, stop_row: int | None = None) -> np.ndarray:
        """The stored blocks of rows ``start_row .. stop_row``, rows in transformers' order (a packed load)."""
        if self._reorder and name.endswith("ssm_out.weight"):
            raise WeightsError(f"qwen3_5: {name!r} had its columns reordered by the converter; it cannot stay packed")
        rows = self._rows(name)
        if rows is None:
            return self._source.read_raw(name, start_row, stop_row)
        whole = self._source.read_raw(name)
        table = whole.reshape(len(rows), -1)
        stop_row = len(rows) if stop_row is None else min(stop_row, len(rows))
        return np.ascontiguousarray(table[rows[start_row:stop_row].numpy()]).reshape(-1)


def _natural(name: str) -> tuple:
    """Sort key: ``blk.2.x`` before ``blk.10.x``."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))
