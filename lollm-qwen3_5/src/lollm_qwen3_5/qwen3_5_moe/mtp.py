"""The MTP head: Qwen3.5's built-in draft model for self-speculative decoding.

Qwen3.5 MoE checkpoints carry one extra decoder layer trained for *multi-token
prediction* (MTP, as in DeepSeek-V3): given the main model's final hidden
state at position p and the embedding of the token at p+1, it predicts the
token at p+2. It is small (one attention layer and one MoE block; the embedding and
the output head are shared with the main model), so it can guess a few tokens
ahead cheaply; the main model then checks all the guesses in one forward
(see lollm/generate/loop.py, ``_speculative_steps``)::

    main model ──► h_p (final-normed hidden of position p)
                          │
    embed(x_{p+1}) ─► pre_fc_norm_embedding ─┐
    h_p ────────────► pre_fc_norm_hidden ────┤ concat (2C) ─► fc (C) ─► decoder layer ─► norm ─► lm_head ─► x_{p+2}
                                             │                         (full attention, own K/V)   │
                                             └────────────── next step uses this output as "h" ◄───┘

Tensor names (a published Qwen3.5 MoE checkpoint)::

    mtp.fc.weight (C, 2C)             mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
    mtp.norm.weight                   mtp.layers.0.{input_layernorm,post_attention_layernorm}.weight
    mtp.layers.0.self_attn.{q,k,v,o}_proj.weight (q_proj carries the output gate: 2*H*D rows)
    mtp.layers.0.self_attn.{q,k}_norm.weight
    mtp.layers.0.mlp.gate.weight (E, C)           the router
    mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight (or fused experts.gate_up_proj / down_proj)
    mtp.layers.0.mlp.shared_expert.{gate,up,down}_proj.weight, mtp.layers.0.mlp.shared_expert_gate.weight

Which hidden state, and in which order (public sources, checked for this file):

* vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` (``Qwen3_5MoeMultiTokenPredictor.forward``):
  ``cat([pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)])`` -> ``fc`` -> layer ->
  ``norm``; the embedding half comes first. The ``hidden`` it receives is what the
  target model's forward returns, and ``Qwen3NextModel.forward``
  (``vllm/model_executor/models/qwen3_next.py``, which Qwen3.5's model inherits)
  returns ``self.norm(hidden_states, residual)``: the hidden state *after* the
  main model's final norm. Its drafts chain the MTP output (after ``mtp.norm``).
* SGLang ``python/sglang/srt/models/qwen3_5_mtp.py`` does the same with the hidden
  states captured for the output head (also post-norm).
* Public sources disagree on this point: vllm-mlx PR #660 switched its Qwen MTP
  input to the *pre*-norm hidden, while llama.cpp PR #24025 ("qwen35: use
  post-norm hidden state for MTP") and LightLLM PR #1402 switched to the
  post-norm hidden and report higher acceptance for it (LightLLM: mean accepted
  length 1.80 -> 2.74 on Qwen3.5-0.8B). transformers has no MTP head (it drops
  ``mtp.*`` on load). lollm follows vLLM and SGLang: the **post-final-norm** hidden.

The head never changes the output: every drafted token is checked by the main
model, so a wrong choice here only lowers the acceptance rate.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.errors import GenerationError

from .blocks import Qwen3_5MoeAttention, Qwen3_5MoeSparseMoeBlock, RMSNorm
from .config import Qwen3_5MoeConfig
from .kv import MAX_ROLLBACK_TOKENS


class Qwen3_5MoeMTPLayer(nn.Module):
    """The MTP head's decoder layer: always full (gated) attention, then the MoE block.

    x: (1, T, C) -> (1, T, C); its keys/values live in the cache's MTP slot.
    """

    def __init__(self, config: Qwen3_5MoeConfig, slot: int, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3_5MoeAttention(config, slot, f"mtp.{index}")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3_5MoeSparseMoeBlock(config)

    def forward(self, x, cos, sin, cache, start: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5MoeMTP(nn.Module):
    """The multi-token-prediction head, named ``mtp`` so its parameters match the checkpoint's ``mtp.*``."""

    def __init__(self, config: Qwen3_5MoeConfig, slot: int):
        super().__init__()
        C, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(C, eps)
        self.pre_fc_norm_hidden = RMSNorm(C, eps)
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.layers = nn.ModuleList(Qwen3_5MoeMTPLayer(config, slot, i) for i in range(config.mtp_num_hidden_layers))
        self.norm = RMSNorm(C, eps)

    def forward(self, embeds, hidden, cos, sin, cache, start: int) -> torch.Tensor:
        """embeds (1, T, C): embeddings of the tokens x_{p+1}; hidden (1, T, C): h_p -> (1, T, C), after ``mtp.norm``."""
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)  # (1, T, 2C)
        x = self.fc(x)  # (1, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, start)
        return self.norm(x)

    @torch.inference_mode()
    def draft(self, cache, pending: int, num_tokens: int, *, embed_tokens, rope, lm_head) -> list[int]:
        """Propose ``num_tokens`` greedy tokens after ``pending`` (see :meth:`Qwen3_5MoeForCausalLM.draft`).

        1. Catch up: the MTP layer's K/V holds confirmed values for positions
           ``0 .. cache.mtp_length-1``. The main model's last forward confirmed the
           tokens up to ``cache.length-1``, so run the pairs (h_p, x_{p+1}) for
           ``p = mtp_length .. length-1`` in one forward (the last pair is
           (h_{length-1}, pending)). Its last output predicts the first draft.
        2. Chain: each further draft feeds the previous MTP output as ``h`` and
           the previous draft as the token, one position further on. These K/V
           rows are provisional: the next catch-up overwrites them with values
           from the main model's own hidden states.
        """
        L = cache.length
        if num_tokens <= 0:
            return []
        if L == 0:
            raise GenerationError("the MTP head drafts after a forward with the cache: run the prompt first")
        if num_tokens >= MAX_ROLLBACK_TOKENS:
            raise GenerationError(
                f"at most {MAX_ROLLBACK_TOKENS - 1} draft tokens per step: the verify forward of 1 + {num_tokens} "
                f"tokens could not be rolled back (see kv.py)"
            )
        if L - 1 + num_tokens > cache.max_tokens:
            raise GenerationError(f"no room in the cache for {num_tokens} draft tokens after position {L - 1}")
        first = min(cache.mtp_length, L - 1)  # redo position L-1 at least: it pairs with `pending`
        device = cache.hidden.device

        # 1. Catch up positions first .. L-1 with the main model's hidden states.
        hidden = cache.hidden[first:L]  # (T1, C): h_first .. h_{L-1}
        next_ids = torch.cat((cache.ids[first + 1 : L], torch.tensor([pending], device=device)))
        cos, sin = rope(first, L - first, hidden.dtype)  # (T1, R): the main model's RoPE of positions first .. L-1
        h = self(embed_tokens(next_ids)[None], hidden[None], cos, sin, cache, first)  # (1, T1, C)
        cache.mtp_length = L
        h = h[:, -1:]
        token = int(lm_head(h)[0, -1].argmax())
        drafts = [token]

        # 2. Chain further drafts on the head's own output.
        for i in range(1, num_tokens):
            position = L - 1 + i
            cos, sin = rope(position, 1, h.dtype)
            h = self(embed_tokens(torch.tensor([[token]], device=device)), h, cos, sin, cache, position)
            token = int(lm_head(h)[0, -1].argmax())
            drafts.append(token)
        return drafts
