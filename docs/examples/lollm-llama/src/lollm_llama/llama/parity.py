"""The parity reference of the ``llama`` family: transformers' LlamaForCausalLM, fed the GGUF by us when it must be.

``lollm parity`` and the conformance kit call :func:`reference` as
``reference(checkpoint, dtype)``: ``checkpoint`` is the :class:`lollm.load.loader.Checkpoint`
lollm read (``.path`` the folder, ``.fmt`` "safetensors" or "gguf", ``.config``
config.json as a dict or the GGUF metadata, ``.weights`` the tensors under the
file's names, for GGUF a :class:`lollm.gguf.GGUFTensorSource` whose ``.gguf.path``
is the file); ``dtype`` a torch floating dtype. It returns
``run(ids) -> (logits, hidden_states)``: ids (1, T) int64 on the CPU, logits (T, V)
float, hidden_states the ``num_layers + 1`` tensors (1, T, C) of transformers'
``output_hidden_states``.

* safetensors: transformers' own load of the same files
  (:func:`lollm.proof.parity.default_reference`).
* GGUF: transformers' GGUF loader falls short for llama: it drops attention and MLP
  biases, linear RoPE scaling and ``rope_freqs.weight`` (llama3 scaling), so a
  Llama 3.1+ GGUF would be compared against a model with the wrong RoPE. Here the
  file is read with **gguf-py** (llama.cpp's own Python library, not lollm's reader):
  every tensor dequantized to float32 by ``gguf.quants.dequantize``, renamed with
  gguf-py's ``TensorNameMap`` (the converter's table, not our name map), q/k rows
  put back by inverting llama.cpp's permutation as an index (not our reshape), into
  a LlamaForCausalLM built from a LlamaConfig made of the metadata. The divisors of
  ``rope_freqs.weight`` then divide transformers' RoPE speeds (``inv_freq``), which
  is where llama.cpp applies them. Everything else is transformers' math.
"""

from __future__ import annotations

import torch

from lollm.errors import LollmError
from lollm.proof.parity import default_reference


def reference(checkpoint, dtype: torch.dtype):
    """(see the module docstring) Raises LollmError for a GGUF the reference cannot build."""
    if checkpoint.fmt != "gguf":
        return default_reference(checkpoint, dtype)
    model = gguf_reference_model(checkpoint.weights.gguf.path, dtype)

    @torch.inference_mode()
    def run(ids: torch.Tensor):
        out = model(ids, output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), [h.float() for h in out.hidden_states]

    return run


def converter_row_order(rows: int, heads: int) -> torch.Tensor:
    """Where llama.cpp's converter takes each stored row from: ``stored[r] = hf[order[r]]``.

    Inside each head of D rows, stored row ``2 j + half`` is Hugging Face row ``half * D/2 + j``.
    """
    D = rows // heads
    order = [h * D + half * (D // 2) + j for h in range(heads) for j in range(D // 2) for half in (0, 1)]
    return torch.tensor(order)


def _metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise LollmError(f"llama parity reference: the GGUF has no {key!r}")
        return default
    return field.contents()


def gguf_reference_model(path, dtype: torch.dtype):
    """transformers' LlamaForCausalLM holding the dequantized tensors of the GGUF at ``path``, in eval mode.

    Raises LollmError naming what the reference cannot build: another architecture,
    a RoPE scaling it does not build, a tensor missing, left unused or left unloaded.
    """
    import gguf
    import numpy as np
    from transformers import LlamaForCausalLM

    reader = gguf.GGUFReader(str(path))
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise LollmError(f"llama parity reference: general.architecture is {arch!r}, not 'llama'")
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            [int(n) for n in reversed(t.shape.tolist())])
    config = _transformers_config(reader, tensors)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = _state_dict(model, config, tensors, gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers))
    factors = tensors.pop("rope_freqs.weight", None)
    if tensors:
        raise LollmError(f"llama parity reference: GGUF tensors left unused: {sorted(tensors)[:4]}")
    model.load_state_dict({name: value.to(dtype) for name, value in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # the RoPE buffers are not in the state dict: compute them, then apply rope_freqs where llama.cpp does
    rotary = type(model.model.rotary_emb)(config)
    if factors is not None:
        rotary.inv_freq = rotary.inv_freq / factors.float()
        rotary.original_inv_freq = rotary.inv_freq.clone()
    model.model.rotary_emb = rotary
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise LollmError(f"llama parity reference: not loaded from the GGUF: {left[:4]}")
    return model.eval()


def _transformers_config(reader, tensors: dict[str, torch.Tensor]):
    """A transformers ``LlamaConfig`` made of the GGUF's ``llama.*`` metadata and which tensors it holds.

    Raises LollmError for a missing key or a RoPE scaling other than none / linear.
    """
    from transformers import LlamaConfig

    def key(name, default=None):
        return _metadata(reader, f"llama.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = str(key("rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise LollmError(f"llama parity reference: RoPE scaling {scaling!r} is not built here")
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return LlamaConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
    )


def _state_dict(model, config, tensors: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """transformers name -> tensor, each taken (popped) from ``tensors`` under gguf-py's name for it.

    ``names`` is gguf-py's ``TensorNameMap`` (the converter's own table). q_proj and
    k_proj rows go back to Hugging Face's order by inverting the converter's row order
    as an index. Raises LollmError naming a tensor the GGUF lacks.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    state = {}
    for hf_name in model.state_dict():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            raise LollmError(f"llama parity reference: the GGUF has no {gguf_name!r} for {hf_name!r}")
        value = tensors.pop(gguf_name)
        for proj, n in (("q_proj", heads), ("k_proj", kv_heads)):
            if f".{proj}." in hf_name:  # stored[r] = hf[order[r]]  =>  hf[order] = stored
                restored = torch.empty_like(value)
                restored[converter_row_order(value.shape[0], n)] = value
                value = restored
        state[hf_name] = value
    return state
