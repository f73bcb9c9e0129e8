"""Write a tiny lollm-toy checkpoint with random weights, so that lesson 2 (docs/toy.md) can be run.

    python docs/examples/lollm-toy/make_checkpoint.py toy-checkpoint
    lollm run -m toy-checkpoint -p "hello" --no-chat --temperature 0 -n 20

The folder gets what the toy family reads (docs/examples/lollm-toy/README.md, "A checkpoint is a folder"):

* ``config.json``: ``model_type`` ``"lollm_toy"`` and the sizes below;
* ``model.safetensors``: every tensor the model has, named as its modules are, drawn at random
  (a fixed seed: the same folder every time);
* ``tokenizer.json`` and ``tokenizer_config.json``: a tiny byte-level BPE trained on a few
  sentences (``lollm.testing.tiny.write_tiny_tokenizer``; it needs the ``tokenizers`` library:
  ``pip install tokenizers``, or the editable checkout's ``lollm-core[test]``), with a ChatML
  chat template, so ``lollm run`` works with and without ``--no-chat``.

The weights are random, so the text is gibberish: the point is to run, trace and break the
forward pass of docs/toy.md, not to read what it says. Refuses a folder that already exists.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lollm.testing.tiny import write_tiny_tokenizer

# Small enough to load in a second; big enough for several heads and a few hundred positions.
CONFIG = {
    "model_type": "lollm_toy",
    "architectures": ["ToyForCausalLM"],
    "vocab_size": 320,  # the tiny tokenizer has exactly this many ids
    "hidden_size": 64,  # C, the width of the residual stream
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim = 64 / 4 = 16
    "max_position_embeddings": 256,  # rows of the learned position table: the longest prompt + answer
    "eos_token_id": 0,  # <|endoftext|>, the tiny tokenizer's first id
}


def random_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the toy model by its file name, float32, drawn from N(0, scale²).

    Shapes: embed_tokens (vocab, C), embed_positions (positions, C), each Linear's weight
    (out, in) and bias (out,), each LayerNorm's weight and bias (C,), lm_head (vocab, C).
    """
    g = torch.Generator().manual_seed(seed)
    C, V, P = config["hidden_size"], config["vocab_size"], config["max_position_embeddings"]

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def layer_norm(prefix: str) -> dict[str, torch.Tensor]:  # near the identity: weight ~1, bias ~0
        return {prefix + ".weight": 1 + rnd(C, scale=0.1), prefix + ".bias": rnd(C, scale=0.1)}

    tensors = {"model.embed_tokens.weight": rnd(V, C, scale=1.0), "model.embed_positions.weight": rnd(P, C),
               **layer_norm("model.norm"), "lm_head.weight": rnd(V, C)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= layer_norm(p + "ln_1") | layer_norm(p + "ln_2")
        for proj in "qkvo":  # q_proj, k_proj, v_proj and o_proj all have biases
            tensors[p + f"self_attn.{proj}_proj.weight"] = rnd(C, C)
            tensors[p + f"self_attn.{proj}_proj.bias"] = rnd(C, scale=0.1)
        tensors[p + "mlp.fc_in.weight"], tensors[p + "mlp.fc_in.bias"] = rnd(4 * C, C), rnd(4 * C, scale=0.1)
        tensors[p + "mlp.fc_out.weight"], tensors[p + "mlp.fc_out.bias"] = rnd(C, 4 * C), rnd(C, scale=0.1)
    return tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the checkpoint folder to create (must not exist)")
    parser.add_argument("--seed", type=int, default=0, help="the random seed of the weights (default 0)")
    args = parser.parse_args(argv)
    if args.folder.exists():
        print(f"error: {args.folder} already exists; give a new folder name", file=sys.stderr)
        return 2
    args.folder.mkdir(parents=True)
    (args.folder / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    save_file(random_tensors(CONFIG, args.seed), str(args.folder / "model.safetensors"))
    write_tiny_tokenizer(args.folder, vocab_size=CONFIG["vocab_size"], chat_template=True)
    print(f"wrote {args.folder}: config.json, model.safetensors, tokenizer.json, tokenizer_config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
