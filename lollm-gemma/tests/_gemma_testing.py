"""Helpers of lollm-gemma's tests (a module with a unique name, so that test runs of
several distributions together never import another distribution's helpers).

Tiny random checkpoints are written by transformers itself from the *real*
hub config.json files shipped with lollm-core (:mod:`lollm.cli.hub_configs`),
shrunk to tiny dimensions with a sliding window of a few tokens, so that
prompts several windows long run in milliseconds. Each checkpoint is written
once per session (see the ``tiny`` fixture in conftest.py).
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path
from typing import Any, Callable

import torch

from lollm.load.options import LoadOptions
from lollm.cli.hub_configs import hub_configs_dir

REPO = Path(__file__).resolve().parents[2]
HUB_CONFIGS = hub_configs_dir()

#: The sliding window of the tiny checkpoints; prompts are several windows long.
WINDOW = 6


def long_text() -> str:
    """A plain, varied English text of 700+ Gemma tokens (past the 512-token window of Gemma 3 270M)."""
    things = ["river", "mountain", "library", "harbour", "forest", "market", "castle", "garden", "bridge", "desert"]
    people = ["a farmer", "two sailors", "the old teacher", "a young painter", "the mayor", "three children"]
    lines = []
    for i in range(34):
        lines.append(
            f"On day {i + 1}, {people[i % len(people)]} walked to the {things[i % len(things)]} "
            f"and wrote down what they saw near the {things[(i * 7 + 3) % len(things)]}."
        )
    return " ".join(lines) + " In the end, all of them agreed that"


def hub_config(name: str) -> dict[str, Any]:
    """config.json of a real hub checkpoint, e.g. ``hub_config("google__gemma-3-1b-it")``."""
    path = HUB_CONFIGS / name / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (is LOLLM_HUB_CONFIGS set to a wrong folder?)")
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# The tiny configs: real hub files, shrunk (every other key kept)
# ---------------------------------------------------------------------------
def tiny_gemma2() -> dict[str, Any]:
    from lollm.testing.tiny import shrink_config

    return shrink_config(hub_config("google__gemma-2-2b-it"), num_hidden_layers=4, sliding_window=WINDOW)


def tiny_gemma3_1b() -> dict[str, Any]:
    """gemma-3-1b-it: hub schema with ``sliding_window_pattern`` 6 (layers 0-4 sliding, 5 global)."""
    from lollm.testing.tiny import shrink_config

    return shrink_config(hub_config("google__gemma-3-1b-it"), num_hidden_layers=6, sliding_window=WINDOW)


def tiny_gemma3_270m() -> dict[str, Any]:
    """gemma-3-270m-it: hub RoPE keys plus an explicit ``layer_types`` list."""
    from lollm.testing.tiny import shrink_config

    return shrink_config(hub_config("google__gemma-3-270m-it"), num_hidden_layers=6, sliding_window=WINDOW)


def tiny_gemma3_4b() -> dict[str, Any]:
    """gemma-3-4b-it, multimodal: a tiny decoder under ``text_config`` (linear RoPE x8 on global
    layers kept), a tiny SigLIP vision tower beside it."""
    raw = hub_config("google__gemma-3-4b-it")
    out = copy.deepcopy(raw)
    out["text_config"] = {
        **raw["text_config"],  # model_type, rope_scaling (linear, factor 8) ...
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "sliding_window": WINDOW,
    }
    out["vision_config"] = {
        **raw["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
    }
    out.update(mm_tokens_per_image=4, boi_token_index=509, eoi_token_index=510, image_token_index=511)
    return out


def tiny_gemma4_text() -> dict[str, Any]:
    """The decoder of gemma-4-E2B-it as a ``gemma4_text`` config: 10 layers, the last 5 sharing
    KV caches (double-wide MLP there), per-layer embeddings, global head dim 2x the local one."""
    from lollm.testing.tiny import shrink_config

    text = hub_config("google__gemma-4-E2B-it")["text_config"]
    return shrink_config(
        text, num_hidden_layers=10, num_kv_shared_layers=5, sliding_window=WINDOW, global_head_dim=32,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
    )


def tiny_gemma4_k_eq_v() -> dict[str, Any]:
    """The E2B decoder with the larger Gemma 4 models' attention variant: global layers whose values
    are their keys (no v_proj), with their own KV-head count; no per-layer embeddings, no KV sharing."""
    return {**tiny_gemma4_text(), "attention_k_eq_v": True, "num_global_key_value_heads": 1,
            "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False}


def tiny_gemma4_multimodal() -> dict[str, Any]:
    """gemma-4-E2B-it as published (model_type "gemma4"): the tiny decoder plus tiny vision and audio towers."""
    raw = hub_config("google__gemma-4-E2B-it")
    out = copy.deepcopy(raw)
    out["text_config"] = tiny_gemma4_text()
    out["vision_config"] = {
        **raw["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16,
        "position_embedding_size": 64,
    }
    out["audio_config"] = {
        **raw["audio_config"], "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "subsampling_conv_channels": [8, 4], "output_proj_dims": 32,
    }
    # multimodal token ids must fit the tiny vocabulary (512)
    out.update(audio_token_id=505, boa_token_id=506, boi_token_id=507, eoa_token_id=508, eoa_token_index=508,
               eoi_token_id=509, image_token_id=510, video_token_id=511)
    return out


def tiny_gemma2_for_gguf() -> dict[str, Any]:
    """tiny_gemma2 with ``query_pre_attn_scalar`` = head_dim: a GGUF file does not carry that
    value, and llama.cpp derives it as head_dim (every size but 27B), so a checkpoint meant to
    round-trip through GGUF must use it (the real Gemma 2 2B/9B do: 256 = head_dim)."""
    cfg = tiny_gemma2()
    return {**cfg, "query_pre_attn_scalar": cfg["head_dim"]}


def tiny_gemma3_long() -> dict[str, Any]:
    """tiny gemma3 (270m layout) with a 4,200-position context, for 4,000-token generations."""
    return {**tiny_gemma3_270m(), "max_position_embeddings": 4200}


TINY: dict[str, Callable[[], dict[str, Any]]] = {
    "gemma2": tiny_gemma2,
    "gemma2-gguf": tiny_gemma2_for_gguf,
    "gemma3-long": tiny_gemma3_long,
    "gemma3-1b": tiny_gemma3_1b,
    "gemma3-270m": tiny_gemma3_270m,
    "gemma3-4b": tiny_gemma3_4b,
    "gemma4-e2b-text": tiny_gemma4_text,
    "gemma4-e2b": tiny_gemma4_multimodal,
    "gemma4-k-eq-v": tiny_gemma4_k_eq_v,
}


# ---------------------------------------------------------------------------
# Running ours and the reference
# ---------------------------------------------------------------------------
def load_ours(folder: Path):
    """Our model for a checkpoint folder, routed through the installed plugins, fp32 on the CPU."""
    from lollm.load.pipeline import open_model

    return open_model(str(folder), LoadOptions(device="cpu", dtype="float32")).model


@torch.inference_mode()
def reference_logits(folder: Path, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits (T, V) and hidden states for ``ids``, fp32, no cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    logits, hidden = out.logits[0].float(), [h.float() for h in out.hidden_states]
    del model
    gc.collect()
    return logits, hidden


def prompt_ids(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    """n random token ids in [3, vocab) (clear of pad/eos/bos and the multimodal ids at the top)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def assert_close_logits(ours: torch.Tensor, ref: torch.Tensor, ids: list[int], *, min_cosine: float = 0.9999) -> None:
    """Same argmax at every position and cosine >= min_cosine of each position's logits.

    ours, ref: (T, V). The cosine is computed in float64, a few rows at a time (a
    700-token prompt over Gemma's 262144-token vocabulary is 1.5 GB in float64).
    """
    assert ours.shape == ref.shape, f"shapes differ: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}"
    bad_argmax = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not bad_argmax, f"argmax differs at positions {bad_argmax} (token ids {[ids[p] for p in bad_argmax]})"
    cosines = torch.cat([
        torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
        for a, b in zip(ours.split(64), ref.split(64))
    ])
    worst = int(cosines.argmin())
    diff = float((ours[worst] - ref[worst]).abs().max())
    assert cosines[worst] >= min_cosine, f"cosine {float(cosines[worst]):.6f} at position {worst} (max |d| there {diff:.3g})"


# ---------------------------------------------------------------------------
# GGUF files written the way llama.cpp's converter writes them
# ---------------------------------------------------------------------------
def sentencepiece_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style (``tokenizer.ggml.model = "llama"``) vocabulary of ``size`` pieces:
    <pad> <eos> <bos> <unk>, the 256 byte-fallback pieces <0x00>..<0xFF>, then word pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256  # control, unknown, byte
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [f"\u2581{c}" for c in letters] + list(letters)
    words += [f"\u2581{a}{b}" for a in letters for b in letters]
    for w in words:
        if len(tokens) >= size:
            break
        tokens.append(w)
        types.append(1)
    assert len(tokens) == size, f"vocabulary of {size} pieces asked, {len(tokens)} made"
    scores = [0.0] * 260 + [-float(i) for i in range(size - 260)]
    return tokens, scores, types


def write_gemma2_gguf(folder: Path, out: Path) -> Path:
    """Convert a tiny gemma2 safetensors checkpoint to GGUF as llama.cpp's ``Gemma2Model`` does:
    its metadata keys, gguf-py's tensor names (``TensorNameMap``, independent of our map), +1 on
    every ``*norm.weight``, no lm_head, a SentencePiece vocabulary; every tensor F32."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tensors = load_file(str(folder / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), "gemma2")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    tokens, scores, types = sentencepiece_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2, n_layers)
    for name, value in tensors.items():
        if name == "lm_head.weight":
            continue  # the converter skips it (tied)
        value = value.float()
        if name.endswith("norm.weight"):
            value = value + 1  # Gemma2Model.modify_tensors
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_gemma4_gguf(folder: Path, out: Path) -> Path:
    """Convert a tiny gemma4_text safetensors checkpoint to GGUF as llama.cpp's ``Gemma4Model``
    (conversion/gemma.py, over ``Gemma3Model`` and ``TextModel``) does: its metadata keys (the
    values the last writer leaves), gguf-py's tensor names (``TensorNameMap``, independent of our
    map; ``layer_scalar`` gets ``.weight`` appended first, as ``Gemma4Model.filter_tensors``
    does), no +1 on the norms (``norm_shift`` is 0), the extra ``rope_freqs`` tensor of
    ``generate_extra_tensors``, no lm_head; every tensor F32.

    The converter reads the hub spelling ``global_head_dim`` / ``num_global_key_value_heads``;
    transformers 5.24 writes them as ``per_layer_config`` overrides, read back here.
    """
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert cfg["model_type"] == "gemma4_text", "text layout only"
    tensors = load_file(str(folder / "model.safetensors"))
    n_layers = cfg["num_hidden_layers"]
    types = cfg["layer_types"]
    # hub spelling of the global layers' shapes
    overrides = [cfg.get("per_layer_config", {}).get(str(i), {}) for i in range(n_layers)]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    global_head_dim = cfg.get("global_head_dim") or overrides[full[0]].get("head_dim", cfg["head_dim"])
    global_kv = cfg.get("num_global_key_value_heads")
    if global_kv is None and "num_key_value_heads" in overrides[full[0]]:
        global_kv = overrides[full[0]]["num_key_value_heads"]
    rope = cfg["rope_parameters"]

    writer = gguf.GGUFWriter(str(out), "gemma4")
    # TextModel.set_gguf_parameters
    writer.add_block_count(n_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # Gemma3Model.set_gguf_parameters
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    # Gemma4Model.set_gguf_parameters
    shared = cfg["num_kv_shared_layers"]
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in types]
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(cfg["head_dim"])
    writer.add_value_length_swa(cfg["head_dim"])
    if cfg.get("use_double_wide_mlp"):
        n_ff = cfg["intermediate_size"]
        writer.add_feed_forward_length([n_ff if i < n_layers - shared else 2 * n_ff for i in range(n_layers)])
    if global_kv is not None:
        writer.add_head_count_kv([cfg["num_key_value_heads"] if s else global_kv for s in swa])
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(cfg["head_dim"])
    # the vocabulary (Gemma4Model.set_vocab writes tokenizer model "gemma4")
    tokens, scores, token_types = sentencepiece_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n_layers)
    # generate_extra_tensors: proportional RoPE of the global layers as frequency factors
    n_rot = int(global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    freqs = torch.tensor([1.0] * n_rot + [1e30] * (global_head_dim // 2 - n_rot), dtype=torch.float32)
    writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", freqs.numpy())
    for name, value in tensors.items():
        if name == "lm_head.weight":
            continue
        if name.endswith("layer_scalar"):
            name += ".weight"  # Gemma4Model.filter_tensors
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def lollm_run(model: str, picture: Path, *extra: str, n: int = 8) -> dict:
    """``lollm run MODEL --image PICTURE *extra -p "what is this?" --json``, greedy, ``n`` tokens, float32 CPU:
    its JSON record (the last line); the command must exit 0."""
    from typer.testing import CliRunner

    from lollm.cli import app

    done = CliRunner().invoke(app, ["run", model, "--image", str(picture), *extra, "-p", "what is this?", "-n", str(n),
                                    "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32"],
                              catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout.strip().splitlines()[-1])
