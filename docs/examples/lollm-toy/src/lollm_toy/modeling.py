"""The ``lollm_toy`` family: a tiny GPT-style decoder, its KV cache, and its loader, in one file.

The architecture (GPT-2's, shrunk to the essentials)::

    ids ─► embed_tokens + embed_positions ─► N × [x + attn(ln_1(x)); x + mlp(ln_2(x))] ─► norm ─► lm_head ─► logits

* learned absolute positions (no RoPE), so the context is ``max_position_embeddings``;
* multi-head causal self-attention with biases, every head its own K/V (no GQA);
* a GELU MLP of width ``4 × hidden_size``; LayerNorm with weight and bias.

Read in order: :class:`ToyConfig` (config.json, strictly) ─► :class:`ToyCache`
(preallocated K/V) ─► :class:`ToyAttention`, :class:`ToyBlock`,
:class:`ToyForCausalLM` (forward in numbered steps) ─► :func:`load` (the
entry point lollm-core calls: hands the model class and its weight layout to core's
:func:`lollm.load.build.build_model`, which builds on meta and streams the weights in).

Tensor names mirror Hugging Face style (``model.layers.N.self_attn.q_proj.weight``),
so the name map from the file to the model is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lollm.attention import attend
from lollm.batch import CacheLayer, keep_logit_rows, token_positions
from lollm.errors import ConfigError
from lollm.load.build import WeightLayout, build_model
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions

# -- config ---------------------------------------------------------------------------------

#: Keys that do not change the math; anything else we do not know is an error.
_METADATA_KEYS = {
    "model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id",
}


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: dict) -> "ToyConfig":
        """Read config.json strictly: a missing size or an unknown key raises ConfigError naming it."""
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")
        optional = ("layer_norm_eps", "tie_word_embeddings")
        for key in required:
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ConfigError(f"lollm_toy: config.json needs a positive integer {key!r}, got {raw.get(key)!r}")
        unknown = sorted(set(raw) - set(required) - set(optional) - _METADATA_KEYS)
        if unknown:
            raise ConfigError(f"lollm_toy: config.json has keys this family does not implement: {', '.join(unknown)}")
        if raw["hidden_size"] % raw["num_attention_heads"]:
            raise ConfigError("lollm_toy: hidden_size must be a multiple of num_attention_heads")
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            **{k: raw[k] for k in required},
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )


# -- the KV cache -----------------------------------------------------------------------------


class ToyCache:
    """Keys and values of every layer, preallocated once for ``max_tokens`` positions.

    k, v: (num_layers, 1, heads, max_tokens, head_dim). A forward writes its T new
    positions at ``[length, length + T)`` in place (no per-step concatenation),
    then the model advances ``length``.
    """

    def __init__(self, config: ToyConfig, max_tokens: int, device: torch.device, dtype: torch.dtype):
        shape = (config.num_hidden_layers, 1, config.num_attention_heads, max_tokens, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_tokens = max_tokens

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (1, heads, T, head_dim) k and v; return every position so far for the layer."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_tokens:
            raise RuntimeError(f"ToyCache holds {self.max_tokens} positions; writing up to {end}")
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int) -> None:
        """The forward's last move: the T new positions are now part of the cache."""
        self.length += T

    def rollback(self, length: int) -> None:
        """Forget positions from ``length`` on (the stale values are simply overwritten later)."""
        self.length = length


# -- the model --------------------------------------------------------------------------------


class ToyAttention(nn.Module):
    def __init__(self, config: ToyConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, start, cache: ToyCache | None) -> torch.Tensor:
        B, T, C = x.shape  # (1, T, hidden)

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, heads, T, head_dim)
            return t.view(B, T, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # now every position 0 .. start+T-1
        # causal attention: the query at position start+i reads keys 0 .. start+i. lollm-core's
        # seam builds the mask and runs the kernel the user picked (--attn), and records the
        # probabilities for `lollm trace`; a family only says which keys it hands over.
        out = attend(q, k, v, start=start, layer=self.layer)  # (B, heads, T, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, C))


class ToyMLP(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.fc_out = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class ToyBlock(nn.Module):
    def __init__(self, config: ToyConfig, layer: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ToyAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ToyMLP(config)

    def forward(self, x: torch.Tensor, start, cache: ToyCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.ln_1(x), start, cache)  # pre-norm attention, residual
        return x + self.mlp(self.ln_2(x))  # pre-norm MLP, residual


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ToyBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class ToyForCausalLM(nn.Module):
    """Follows :class:`lollm.model.CausalLM`: the shared loop, the parity gate and the benchmark drive it."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.model = ToyModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the protocol's attributes
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids

    def new_cache(self, max_tokens: int) -> ToyCache:
        weight = self.lm_head.weight
        return ToyCache(self.config, max_tokens, weight.device, weight.dtype)

    def cache_layers(self) -> list[CacheLayer]:
        """What each cache layer holds, for core's batched engine (lollm.batch): every layer full attention."""
        c = self.config
        return [CacheLayer("full", c.num_attention_heads, c.head_dim)] * c.num_hidden_layers

    def forward(self, input_ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        """input_ids (1, T) -> logits (1, T or the rows kept, vocab).

        With a ToyCache the T tokens are one sequence's, at ``cache.length ..``. In an
        engine step (lollm.engine) the cache is core's PagedCache: the T tokens are several
        sequences' laid end to end, ``cache.length`` is a lollm.batch.Batch saying where
        each sits, and ``logits_to_keep`` a tensor of rows. token_positions, attend and
        keep_logit_rows take either form, so the steps below are the same for both.
        """
        start = cache.length if cache is not None else 0  # an int, or an engine step's Batch
        T = input_ids.shape[1]
        # 1. Embed the tokens and add the learned position of each.
        positions = token_positions(start, T, input_ids.device)  # (T,): start .. start+T-1, or each token's own
        if int(positions.max()) >= self.max_context:
            raise RuntimeError(f"lollm_toy: positions up to {int(positions.max()) + 1} exceed the context {self.max_context}")
        x = self.model.embed_tokens(input_ids) + self.model.embed_positions(positions)[None]  # (1, T, hidden)
        if hidden_states is not None:
            hidden_states.append(x)
        # 2. The decoder blocks; each writes its K/V into the cache at [start, start + T).
        for i, block in enumerate(self.model.layers):
            x = block(x, start, cache)
            if hidden_states is not None and i < self.num_layers - 1:
                hidden_states.append(x)
        # 3. Final norm (its output is the last hidden state, as in transformers).
        x = self.model.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        if cache is not None:
            cache.advance(T)
        # 4. Logits, only for the positions the caller needs (an engine step: each sequence's last).
        x = keep_logit_rows(x, logits_to_keep)
        return self.lm_head(x)  # (1, T or logits_to_keep, vocab)

    def logit_lens(self, hidden, *, normed=False):
        """``lollm trace``'s logit lens: a hidden state (1, T, hidden) read as steps 3-4 read the last -> (1, T, vocab)."""
        return self.lm_head(hidden if normed else self.model.norm(hidden))


# -- the loader lollm-core calls ------------------------------------------------------------


def name_map(file_name: str) -> str:
    """File tensor name -> model name: the identity (the file uses our module names).

    A name the model has no slot for is reported by load_weights as an
    unexpected tensor; nothing is skipped silently.
    """
    return file_name


#: What core's build_model needs to know about the weights: the name map per format and the
#: tied head. No tensor-parallel plan (``--tp`` is refused) and nothing may stay packed.
LAYOUT = WeightLayout(name_maps={"safetensors": name_map}, tied={"lm_head.weight": "model.embed_tokens.weight"})


def load(checkpoint: Checkpoint, options: LoadOptions) -> ToyForCausalLM:
    """Build the model on the meta device and stream the checkpoint's tensors into it (plugin contract 2).

    checkpoint: ``.config`` is config.json as a dict, ``.weights`` the tensors by file name,
    ``.fmt`` "safetensors" (anything else is a ConfigError). options: the resolved
    :class:`lollm.load.options.LoadOptions` (device, dtype, ...), handed to core's build_model.
    """
    if checkpoint.fmt != "safetensors":
        raise ConfigError(f"lollm_toy reads safetensors checkpoints only, not {checkpoint.fmt}")
    config = ToyConfig.from_dict(checkpoint.config)
    return build_model(ToyForCausalLM, config, checkpoint.weights, checkpoint.fmt, options, LAYOUT,
                       tie=config.tie_word_embeddings)
