"""Tiny random vision checkpoints: a learner's way to try images without a real checkpoint (docs/vision.md).

:func:`write_tiny_vision_checkpoint` writes, in one folder, a tiny random ``*ForConditionalGeneration``
of a first-party vision family ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe"), everything a published
checkpoint has that lollm reads:

* config.json and model.safetensors, written by transformers (:func:`lollm.testing.tiny.write_tiny_checkpoint`)
  from the conformance kit's tiny configs (:data:`FIRST_PARTY_VISION`: a 64-wide decoder, a 1- or
  2-layer tower), its weights spread (``SENSITIVE_INIT_STD``) so that a wrong image path shows in the logits;
* preprocessor_config.json, the family's image processor at the tiny sizes;
* a tokenizer whose special tokens sit at the config's image ids, and the family's real chat
  template (shipped in ``lollm/cli/data/hub_configs``), which renders image content parts.

The Gemma checkpoints are the ones llama.cpp's ``convert_hf_to_gguf.py`` converts (text GGUF and
``--mmproj``): a SentencePiece tokenizer as Gemma's (the converter cannot hash a tiny byte-level BPE),
Gemma 3's tower under the published tensor names (``vision_tower.vision_model.*``: the converter maps
no other) and ``query_pre_attn_scalar`` equal to ``head_dim`` (a GGUF file has no key for it: llama.cpp
scales by ``head_dim``). The Qwen3.5 ones have a byte-level BPE tokenizer: the converter refuses it
(``BPE pre-tokenizer was not recognized``), so they have no GGUF form.

From the command line: ``python -m lollm.testing.tiny_vision gemma3 tiny-gemma3-vision``.
Needs ``lollm-core[parity]`` (transformers, sentencepiece) and ``tokenizers``; never pytest.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lollm.testing.tiny import CORPUS, SENSITIVE_INIT_STD, _syllable_words, kit_config, write_tiny_checkpoint, write_tiny_tokenizer

@dataclass(frozen=True)
class VisionSetup:
    """What the vision check needs of a family.

    config:          () -> the tiny ``*ForConditionalGeneration`` config.json (a dict), written by
                     transformers' class ``reference_class`` (tiny tower, decoder and image tokens).
    processor:       () -> transformers' image processor for it (a slow PIL class: no torchvision);
                     called as ``processor(images=[...], return_tensors="pt")``, and saved beside the
                     checkpoint (``preprocessor_config.json``, which a dynamic-resolution tower reads).
    reference_class: the transformers class name, e.g. ``"Gemma3ForConditionalGeneration"``.
    relabel:         optional, config dict -> the config.json this family reads, for a family whose model
                     types transformers does not know (a copy made by ``lollm new-family`` relabels
                     transformers' types to its own); the reference reads transformers' config.json.
    """

    config: Callable[[], dict]
    processor: Callable[[], Any]
    reference_class: str
    relabel: Callable[[dict], dict] | None = None


def _gemma3_config() -> dict:
    """gemma-3-4b-it shrunk: the kit's decoder (window 6, shorter than an image), a 2-layer SigLIP on
    64 x 64 images in 8-pixel patches (an 8 x 8 grid), pooled 2 x 2 into 16 tokens per image."""
    from lollm.cli.hub_configs import hub_config

    raw = hub_config("google__gemma-3-4b-it")
    text = kit_config(raw)
    vocab = int(text["vocab_size"])
    vision = {**raw["vision_config"], "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 64, "patch_size": 8}
    return {**raw, "text_config": {**text, "model_type": raw["text_config"]["model_type"]}, "vision_config": vision,
            "mm_tokens_per_image": 16, "boi_token_index": vocab - 3, "eoi_token_index": vocab - 2,
            "image_token_index": vocab - 1}


def _gemma3_processor():
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 64, "width": 64})


#: Gemma 4's soft-token budget in the kit: the smallest its processor takes (70 tokens, 630 patches at most).
GEMMA4_SOFT_TOKENS = 70


def _multimodal(hub: str, vision: dict, **top) -> dict:
    """The hub config ``hub`` with the kit's decoder (:func:`lollm.testing.tiny.kit_config`) as its
    ``text_config``, its vision_config updated by ``vision``, no audio tower, and the top-level token ids
    of the tiny decoder (kit_config moves them under its vocabulary), plus ``top``."""
    from lollm.cli.hub_configs import hub_config

    raw = hub_config(hub)
    text = {**kit_config(raw), "model_type": raw["text_config"]["model_type"]}
    ids = {k: text[k] for k in raw if k.endswith(("_token_id", "_token_index")) and isinstance(text.get(k), int)}
    out = {**raw, **ids, "text_config": text, "vision_config": {**raw["vision_config"], **vision}, **top}
    if "audio_config" in out:
        out["audio_config"] = None  # the kit reads images only
    return out


def _gemma4_config() -> dict:
    """gemma-4-E2B-it shrunk: the kit's decoder (per-layer inputs, shared KV layers, window 6), a 2-layer
    tower of 16-pixel patches pooled 3 x 3, at most :data:`GEMMA4_SOFT_TOKENS` soft tokens per image."""
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16, "position_embedding_size": 64}
    return _multimodal("google__gemma-4-E2B-it", vision, vision_soft_tokens_per_image=GEMMA4_SOFT_TOKENS)


def _gemma4_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=GEMMA4_SOFT_TOKENS)


def _qwen3_5_config(hub: str) -> Callable[[], dict]:
    """``hub`` (Qwen3.5-0.8B, 35B-A3B) shrunk: the kit's decoder (linear and full attention, M-RoPE), a
    1-block ViT of 16-pixel patches merged 2 x 2, its position table a 4 x 4 grid (interpolated)."""
    def config() -> dict:
        out = _multimodal(hub, {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                                "num_position_embeddings": 16})
        out["vision_config"]["out_hidden_size"] = out["text_config"]["hidden_size"]
        if "num_experts" in out["text_config"]:
            out["text_config"].pop("intermediate_size", None)  # kit_config writes a dense width the MoE has none of
        return out
    return config


def _qwen3_5_processor():
    """Qwen3.5's processor with a small pixel budget, 64 x 96 .. 128 x 128 pixels: the kit's drawings become
    grids of 4 x 8 to 8 x 8 patches (at most 16 tokens), wide enough that a transposed order moves edges."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": 64 * 96, "longest_edge": 128 * 128}, patch_size=16,
                                    temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)


#: family name -> its setup, for the first-party families whose kit runs the check.
FIRST_PARTY_VISION = {
    "gemma3": VisionSetup(_gemma3_config, _gemma3_processor, "Gemma3ForConditionalGeneration"),
    "gemma4": VisionSetup(_gemma4_config, _gemma4_processor, "Gemma4ForConditionalGeneration"),
    "qwen3_5": VisionSetup(_qwen3_5_config("Qwen__Qwen3.5-0.8B"), _qwen3_5_processor, "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe": VisionSetup(_qwen3_5_config("Qwen__Qwen3.5-35B-A3B"), _qwen3_5_processor,
                               "Qwen3_5MoeForConditionalGeneration"),
}


def drawing(width: int, height: int, seed: int):
    """An RGB ``PIL.Image`` of ``width`` x ``height``: a coloured ground, an ellipse and a line placed by ``seed``."""
    from PIL import Image, ImageDraw

    g = torch.Generator().manual_seed(seed)
    r = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    img = Image.new("RGB", (width, height), (r(256), r(256), r(256)))
    draw = ImageDraw.Draw(img)
    draw.ellipse((r(width // 2), r(height // 2), width - r(width // 3), height - r(height // 3)),
                 fill=(r(256), r(256), r(256)))
    draw.line((0, r(height), width, r(height)), fill=(r(256), r(256), r(256)), width=3)
    return img


#: family -> (hub config folder whose chat_template.jinja the family uses, {config key: token text}).
#: Gemma 3's 4B folder has no template: every Gemma 3 "-it" checkpoint ships the same one (the 270M's here).
TOKENS = {
    "gemma3": ("google__gemma-3-270m-it", {"boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
                                           "image_token_index": "<image_soft_token>"}),
    "gemma4": ("google__gemma-4-E2B-it", {"boi_token_id": "<|image>", "eoi_token_id": "<image|>", "image_token_id": "<|image|>",
                                          "boa_token_id": "<|audio>", "eoa_token_id": "<audio|>", "audio_token_id": "<|audio|>",
                                          "video_token_id": "<|video|>"}),
    "qwen3_5": ("Qwen__Qwen3.5-0.8B", {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                                       "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}),
}
TOKENS["qwen3_5_moe"] = TOKENS["qwen3_5"]
#: Special tokens of Qwen's vocabulary that fill the ids above the image tokens, up to the config's vocabulary size.
UNUSED = ["<|box_start|>", "<|box_end|>"]
#: ``<|im_end|>`` in :func:`lollm.testing.tiny.write_tiny_tokenizer`'s vocabulary: the Qwen checkpoints' end of sequence.
QWEN_IM_END = 2
#: Gemma 4's text width here: gemma-4-E2B's, one of those whose image rule lollm_gemma's GGUF reader knows.
GEMMA4_GGUF_WIDTH = 1536
#: The text the Gemma SentencePiece tokenizers are trained on (its 120 most frequent characters kept).
TRAINING_TEXT = CORPUS * 10 + _syllable_words() * 3


def write_tiny_vision_checkpoint(family: str, folder: str | Path, *, seed: int = 0) -> Path:
    """A tiny random vision checkpoint of ``family`` in ``folder`` (created); returns ``folder``.

    family: "gemma3", "gemma4", "qwen3_5" or "qwen3_5_moe" (ValueError naming them otherwise).
    seed:   the same seed writes the same weights (the tokenizer is the same for every seed).
    Files: config.json, model.safetensors, generation_config.json, preprocessor_config.json,
    tokenizer.json, tokenizer_config.json (with ``chat_template``), and tokenizer.model for Gemma.
    """
    if family not in FIRST_PARTY_VISION:
        raise ValueError(f"family {family!r}: a tiny vision checkpoint is made for {', '.join(FIRST_PARTY_VISION)}")
    setup, names = FIRST_PARTY_VISION[family], TOKENS[family][1]
    folder = Path(folder)
    config = setup.config()
    ids = sorted((int(config[key]), text) for key, text in names.items())
    base = ids[0][0]
    if [i for i, _ in ids] != list(range(base, base + len(ids))):
        raise ValueError(f"{family}: the tiny config's image token ids {ids} are not consecutive")
    specials = [text for _, text in ids]
    vocab = int(config["text_config"]["vocab_size"])
    specials += UNUSED[:vocab - base - len(specials)]  # no id without a token
    if base + len(specials) != vocab:
        raise ValueError(f"{family}: ids {base + len(specials)}..{vocab - 1} of the tiny vocabulary would have no token")
    if family.startswith("gemma"):
        _gemma_convertible(family, config)
    else:  # a reply ends at the end of its turn, as Qwen3.5's generation config says (the kit's id 511 is no token)
        config["text_config"]["eos_token_id"] = QWEN_IM_END
    write_tiny_checkpoint(config, folder, seed=seed, init_std=SENSITIVE_INIT_STD, model_class=setup.reference_class)
    setup.processor().save_pretrained(folder)
    if family == "gemma3":  # as gemma-3-4b-it's file: the mmproj converter reads the tokens per image here
        _update_json(folder / "preprocessor_config.json", image_seq_length=int(config["mm_tokens_per_image"]),
                     processor_class="Gemma3Processor")
    _tokenizer(family, folder, base, specials)
    if family == "gemma3":
        published_spelling(folder)
    return folder


def _gemma_convertible(family: str, config: dict) -> None:
    """Edit the Gemma ``config`` in place as llama.cpp's converter needs: ``query_pre_attn_scalar`` =
    ``head_dim``, and the end-of-turn id of the SentencePiece tokenizer (:func:`_tokenizer`, id 5) as
    Gemma 3's second end-of-sequence id (the hub config's 106 is a plain piece in 512 ids); Gemma 4's text
    width :data:`GEMMA4_GGUF_WIDTH`, whose image attention rule lollm knows for a GGUF file (causal)."""
    from transformers import CONFIG_MAPPING

    text = config["text_config"]
    defaults = CONFIG_MAPPING[text["model_type"]]()
    head_dim = text.get("head_dim") or defaults.head_dim
    text["head_dim"] = head_dim
    text["query_pre_attn_scalar"] = head_dim
    if family == "gemma3":
        config["eos_token_id"] = text["eos_token_id"] = [1, 5]
    else:  # the width of gemma-4-E2B: llama.cpp's image attention rule goes by width (no GGUF key says it)
        text["hidden_size"] = GEMMA4_GGUF_WIDTH


def _tokenizer(family: str, folder: Path, base: int, specials: list[str]) -> None:
    """tokenizer.json (+ tokenizer.model for Gemma) of ``base`` ids, then ``specials`` at ids base.., and
    tokenizer_config.json with the family's chat template."""
    from tokenizers import AddedToken, Tokenizer

    from lollm.cli.hub_configs import hub_file
    from lollm.testing.converter import write_sentencepiece_tokenizer

    hub = TOKENS[family][0]
    if family.startswith("gemma"):
        write_sentencepiece_tokenizer(folder, TRAINING_TEXT, style="gemma", vocab_size=base, max_characters=120)
    else:
        write_tiny_tokenizer(folder, vocab_size=base, chat_template=False)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # Gemma's turn markers are pieces 4 and 5 of the SentencePiece model: special, so that the template's are one token
    turns = {4: "<start_of_turn>", 5: "<end_of_turn>"} if family.startswith("gemma") else {}
    wanted = {**turns, **{i: text for i, text in enumerate(specials, start=base)}}
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in wanted.values()])
    got = {tok.token_to_id(t): t for t in wanted.values()}
    if got != wanted:
        raise RuntimeError(f"{family}: the special tokens landed at ids {got}, not {wanted}")
    tok.save(str(folder / "tokenizer.json"))
    path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = hub_file(hub, "chat_template.jinja").read_text(encoding="utf-8")
    if family.startswith("qwen"):  # the ChatML end of turn ends a reply, as Qwen3.5's generation config says
        tokenizer_config["eos_token"] = "<|im_end|>"
    added = tokenizer_config.setdefault("added_tokens_decoder", {})  # Gemma 3's mmproj converter reads the ids here
    for i, text in wanted.items():
        added[str(i)] = {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                         "special": True}
    path.write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")


def _update_json(path: Path, **values: object) -> None:
    """The JSON object in ``path`` with ``values`` set."""
    data = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**data, **values}, indent=2), encoding="utf-8")


def published_spelling(folder: Path) -> None:
    """Gemma 3's tower ``vision_tower.*`` (what transformers 5 saves) renamed ``vision_tower.vision_model.*``, the
    published checkpoints' names: the only ones llama.cpp's converter maps; transformers and lollm read both."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    """``python -m lollm.testing.tiny_vision FAMILY FOLDER [--seed N] [--picture FILE.png]``."""
    parser = argparse.ArgumentParser(prog="python -m lollm.testing.tiny_vision",
                                     description="Write a tiny random vision checkpoint (docs/vision.md).")
    parser.add_argument("family", choices=sorted(FIRST_PARTY_VISION))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    parser.add_argument("--picture", type=Path, help="also draw a 96 x 64 PNG picture at this path")
    args = parser.parse_args(argv)
    folder = write_tiny_vision_checkpoint(args.family, args.folder, seed=args.seed)
    print(f"wrote a tiny {args.family} vision checkpoint in {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    if args.picture is not None:
        drawing(96, 64, args.seed).save(args.picture)
        print(f"drew {args.picture} (96 x 64)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
