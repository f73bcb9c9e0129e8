"""The small pieces of a qwen3_5_moe decoder: norms, partial RoPE, gated attention, Gated DeltaNet, the MoE block.

Shapes use these letters (batch is always 1 in lollm):

    T   tokens in this forward call (the prompt in a prefill, 1 in a decode step; in an
        engine step, the new tokens of several sequences end to end, lollm.batch)
    S   positions an attention layer can see: the cached ones plus the T new ones
    C   hidden_size
    H   num_attention_heads (query heads)   K  num_key_value_heads   D  head_dim
    R   rotary channels per head (head_dim * partial_rotary_factor)
    Hk  DeltaNet query/key heads   Hv  DeltaNet value heads   Dk, Dv  their widths
    W   linear_conv_kernel_dim (the convolution's window)
    E   num_experts   k  num_experts_per_tok   I  moe_intermediate_size

A qwen3_5_moe layer mixes tokens in one of two ways:

* **gated full attention** (every 4th layer): softmax attention with GQA, QK-norm,
  RoPE on a quarter of each head, and a sigmoid *output gate* computed from the
  same input (its weights sit beside the query weights in ``q_proj``);
* **Gated DeltaNet** (the other layers): linear attention whose memory is a
  fixed-size matrix per head, written with the *delta rule* and faded by a
  learned decay (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks").
  Its two forms, :func:`delta_rule_recurrent` (one token at a time, for decode)
  and :func:`delta_rule_chunked` (64 tokens at a time with matrix products, for
  prefill), compute the same thing; their docstrings derive the chunked one.

and then transforms each token with a sparse **mixture of experts**
(:class:`Qwen3_5MoeSparseMoeBlock`): a router picks k of E small SwiGLU
experts per token, and a shared expert, scaled by a sigmoid gate, is added.

References: transformers' modeling_qwen3_5_moe.py and modeling_qwen3_next.py (the
tests compare against them); DeltaNet (Schlag et al. 2021; Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length"),
RoPE (Su et al. 2021), GQA (Ainslie et al. 2023), SwiGLU (Shazeer 2020),
gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models"),
sparse MoE (Shazeer et al. 2017; the shared expert of DeepSeekMoE, Dai et al. 2024).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lollm.attention import attend
from lollm.trace import record_choice, record_series, tracing

from .config import Qwen3_5MoeConfig
from .kv import Qwen3_5MoeEngineCache


# ---------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Root-mean-square norm with the (1 + w) scale this family uses: ``x / rms(x) * (1 + weight)``.

    The checkpoint stores ``weight`` *centred on zero* (a freshly initialised
    norm has weight 0, i.e. scale 1). Everything is computed in float32 and
    cast back at the end, as transformers does for Qwen3.5.

    x: (..., dim) -> (..., dim)
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """DeltaNet's output norm: ``x / rms(x) * weight * silu(gate)``, over the last dim.

    Unlike :class:`RMSNorm` the weight here is a plain scale (initialised to 1),
    and a second input, the gate ``z``, multiplies the result through SiLU.

    x, gate: (..., dim) -> (..., dim)
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)  # normalise in float32, scale in the model dtype
        return (out * F.silu(gate.float())).to(dtype)


# ---------------------------------------------------------------------------
# Partial rotary position embedding
# ---------------------------------------------------------------------------
def rope_inverse_frequencies(theta: float, rotary_dim: int) -> torch.Tensor:
    """The rotation speed of each channel pair: ``inv_freq[i] = theta ** (-2i / R)``, (R/2,) float32.

    Only the first R = head_dim * partial_rotary_factor channels of a head are
    rotated (64 of 256 for Qwen3.5), so the exponent is over R, not head_dim.
    Computed on the CPU in float32, exactly as transformers does.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
    return 1.0 / (theta**exponents)


class RotaryEmbedding(nn.Module):
    """cos and sin of the rotation angles for the given positions.

    ``inv_freq`` is a non-persistent buffer: not in the checkpoint, computed
    (:func:`lollm.load.build.build_model` calls :meth:`materialize` after building on the meta device).

    positions: (T,) int64 -> cos, sin: (T, R) in ``dtype``; the R/2 angles are
    repeated twice, ``[a0 .. a_{R/2-1}, a0 .. a_{R/2-1}]``, to match rotate_half.

    Text positions only: Qwen3.5's multimodal RoPE (``mrope_section``) gives an
    image patch three positions (time, height, width), but a text token has the
    same number in all three, and then each section turns by ``position *
    inv_freq`` like ordinary RoPE (see config.py).
    """

    def __init__(self, config: Qwen3_5MoeConfig):
        super().__init__()
        self.theta = config.rope_theta
        self.rotary_dim = config.rotary_dim
        inv_freq = rope_inverse_frequencies(self.theta, self.rotary_dim)
        # on the default device: "meta" (no data) while build_model builds the model
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)compute ``inv_freq`` on the CPU in float32 and place it on ``device`` (it stays float32, whatever ``dtype``).

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device.
        """
        self.inv_freq = rope_inverse_frequencies(self.theta, self.rotary_dim).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[:, None].float() * self.inv_freq[None, :]  # (T, R/2), float32
        angles = torch.cat((angles, angles), dim=-1)  # (T, R)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim: (..., R) -> (..., R)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R channels of every head by their angles; leave the other D - R channels as they are.

    x: (1, heads, T, D); cos, sin: (T, R) -> (1, heads, T, D)
    """
    R = cos.shape[-1]
    rotated, passed = x[..., :R], x[..., R:]
    rotated = rotated * cos + rotate_half(rotated) * sin
    return torch.cat((rotated, passed), dim=-1)


# ---------------------------------------------------------------------------
# Gated full attention
# ---------------------------------------------------------------------------
class Qwen3_5MoeAttention(nn.Module):
    """Softmax attention with GQA, QK-norm, partial RoPE and a sigmoid output gate.

    ``q_proj`` is twice as wide as the query heads need: for each head it
    yields D query channels followed by D *gate* channels. After attention,
    each head's output is multiplied by ``sigmoid(gate)``, which lets a head
    say "nothing useful here" without having to attend somewhere harmless.

    x: (1, T, C) -> (1, T, C). The new keys/values go into the cache's slot
    ``slot`` at positions ``start ..``; attention reads every stored position.
    """

    def __init__(self, config: Qwen3_5MoeConfig, slot: int, layer: int | str):
        super().__init__()
        self.slot = slot  # which K/V slot of the hybrid cache this layer owns
        self.layer = layer  # the decoder layer's index ("mtp.N" in the MTP head), for attention records
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        C, H, K, D = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(C, H * D * 2, bias=bias)  # queries and output gates, per head
        self.k_proj = nn.Linear(C, K * D, bias=bias)
        self.v_proj = nn.Linear(C, K * D, bias=bias)
        self.o_proj = nn.Linear(H * D, C, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)  # QK-norm: over each head's D channels
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start: int) -> torch.Tensor:
        _, T, _ = x.shape
        H, K, D = self.num_heads, self.num_kv_heads, self.head_dim
        # 1. Project. q_proj's output per head is [query (D) | gate (D)].
        q, gate = self.q_proj(x).view(1, T, H, 2 * D).split(D, dim=-1)  # (1, T, H, D) each
        gate = gate.reshape(1, T, H * D)
        k = self.k_proj(x).view(1, T, K, D)
        v = self.v_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)
        # 2. QK-norm (per head), then rotate the first R channels of q and k by position.
        q = self.q_norm(q).transpose(1, 2)  # (1, H, T, D)
        k = self.k_norm(k).transpose(1, 2)  # (1, K, T, D)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        # 3. Store this step's keys/values; read back every position so far.
        if cache is not None:
            k, v = cache.update_kv(self.slot, start, k, v)  # (1, K, S, D)
        # 4. Causal attention (the query at position p reads the keys of positions 0 .. p;
        #    query head h reads K/V head h // (H/K), GQA), then the output gate, then the
        #    output projection. lollm.attention runs the kernel (--attn picks it).
        out = attend(q, k, v, start=start, layer=self.layer)  # (1, H, T, D)
        out = out.transpose(1, 2).reshape(1, T, H * D)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out)  # (1, T, C)


# ---------------------------------------------------------------------------
# The delta rule, two ways
# ---------------------------------------------------------------------------
def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    states_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule, one token at a time (decode; the verify step of speculative decoding).

    Each head keeps a memory matrix ``S`` (Dk, Dv) that maps keys to values:
    reading it with a key k gives ``S^T k``. For every token t::

        S      <- exp(g_t) * S                        # 1. decay: fade the old memory (g_t <= 0)
        v_old   = S^T k_t                             # 2. what the memory recalls for k_t now
        delta   = beta_t * (v_t - v_old)              # 3. the correction, with learning rate beta_t in (0, 1)
        S      <- S + k_t delta^T                     # 4. write it: afterwards S^T k_t moves toward v_t
        o_t     = S^T q_t                             # 5. read the memory with the query

    In one line: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.
    Plain linear attention would only add ``k_t v_t^T``; the delta rule first
    removes what the memory held for k_t, so a key can be *overwritten*.

    q, k: (T, Hv, Dk), already L2-normalised (and q scaled by 1/sqrt(Dk));
    v: (T, Hv, Dv); g, beta: (T, Hv); all float32.
    state: (Hv, Dk, Dv) float32, updated in place (S before the first token on entry).
    states_out: optional (>= T, Hv, Dk, Dv) buffer receiving S after each token
                (what the cache keeps to roll a verify step back).
    Returns o: (T, Hv, Dv) float32.
    """
    T = q.shape[0]
    out = q.new_empty(T, v.shape[1], v.shape[2])
    decay = g.exp()  # (T, Hv)
    for t in range(T):
        S = state if states_out is None else states_out[t]
        if states_out is not None:
            S.copy_(state if t == 0 else states_out[t - 1])
        S.mul_(decay[t, :, None, None])  # 1.
        v_old = torch.bmm(k[t, :, None, :], S)  # 2. (Hv, 1, Dk) @ (Hv, Dk, Dv) -> (Hv, 1, Dv)
        delta = (v[t, :, None, :] - v_old) * beta[t, :, None, None]  # 3. (Hv, 1, Dv)
        S.baddbmm_(k[t, :, :, None], delta)  # 4. S += k_t delta^T, (Hv, Dk, 1) @ (Hv, 1, Dv)
        out[t] = torch.bmm(q[t, :, None, :], S)[:, 0]  # 5. (Hv, Dv)
    if states_out is not None:
        state.copy_(states_out[T - 1])
    return out


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The same gated delta rule as :func:`delta_rule_recurrent`, a chunk of tokens at a time (prefill).

    The recurrence is sequential, but within a chunk of C tokens it can be
    solved with matrix products. Take one head and one chunk; S_0 is the state
    before the chunk, ``a_t = exp(g_t)`` and ``G_t = g_1 + ... + g_t`` (so the
    decay from the chunk start to t is ``exp(G_t)``, and from s to t is
    ``exp(G_t - G_s)``). Unrolling the recurrence with ``delta_t = S_t - a_t S_{t-1}``
    written as ``k_t u_t^T``::

        S_t = exp(G_t) S_0 + sum_{s<=t} exp(G_t - G_s) k_s u_s^T                  (a)
        u_t = beta_t (v_t - exp(G_t) S_0^T k_t - sum_{s<t} exp(G_t - G_s) (k_t.k_s) u_s)

    The second line is a lower-triangular linear system for the C corrections
    u_t. With ``L = I + A``, ``A[t,s] = beta_t exp(G_t - G_s) (k_t.k_s)`` for s < t::

        L U = beta*V - (beta*exp(G)*K) S_0   ->   U = L^-1 (beta*V)  -  L^-1 (beta*exp(G)*K) S_0
                                                 \\___ u_plain ___/      \\____ w ____/

    u_plain and w depend only on the chunk's own tokens, so they are computed
    for every chunk at once (two triangular solves). Then a short loop over
    chunks carries the state: ``U = u_plain - w S_0``, and from (a)::

        O     = (exp(G) * Q) S_0  +  [(Q K^T) * exp(G_t - G_s), s <= t] U      (read the old state + this chunk)
        S_C   = exp(G_C) S_0  +  (exp(G_C - G) * K)^T U                         (state after the chunk)

    The sequence is padded with zeros to a multiple of C: a padded token has
    k = v = 0, beta = 0 and g = 0, so it changes neither outputs nor state.

    Arguments and result as in :func:`delta_rule_recurrent` (no ``states_out``).
    """
    T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    n = (T + pad) // C
    # (T, H, .) -> (H, n, C, .): heads first, then chunks, then the tokens of a chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).reshape(H, n, C, -1) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)).reshape(H, n, C) for x in (g, beta))

    G = g.cumsum(-1)  # (H, n, C): log of the decay from the chunk start to each token
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # s <= t
    # decay[t, s] = exp(G_t - G_s) where s <= t, 0 elsewhere (masked before exp: no overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, n, C, C)

    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay  # A[t, s] = beta_t exp(G_t - G_s) k_t.k_s
    L = torch.eye(C, dtype=q.dtype, device=q.device) + A.tril(-1)  # unit lower-triangular
    u_plain = torch.linalg.solve_triangular(L, v * beta[..., None], upper=False, unitriangular=True)  # (H, n, C, Dv)
    w = torch.linalg.solve_triangular(L, k_beta * G.exp()[..., None], upper=False, unitriangular=True)  # (H, n, C, Dk)

    scores = (q @ k.transpose(-1, -2)) * decay  # (H, n, C, C): causal, decayed q_t.k_s
    q_decayed = q * G.exp()[..., None]  # exp(G_t) q_t: reads S_0 as it has faded by t
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]  # exp(G_C - G_s) k_s: how much of u_s survives the chunk
    chunk_decay = G[..., -1].exp()  # (H, n): exp(G_C)

    out = q.new_empty(H, n, C, Dv)
    S = state.clone()
    for i in range(n):
        U = u_plain[:, i] - w[:, i] @ S  # (H, C, Dv): the corrections u_t
        out[:, i] = q_decayed[:, i] @ S + scores[:, i] @ U
        S = S * chunk_decay[:, i, None, None] + k_decayed[:, i].transpose(-1, -2) @ U
    state.copy_(S)
    return out.reshape(H, n * C, Dv)[:, :T].transpose(0, 1)  # (T, H, Dv)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (the FLA kernels' form, which transformers follows)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------
class Qwen3_5MoeGatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer: linear attention with a delta-rule memory per head.

    Step by step (x: (1, T, C)):
      1. project: ``in_proj_qkv`` gives q, k, v side by side; ``in_proj_z`` the output
         gate z; ``in_proj_a`` and ``in_proj_b`` one number per value head each;
      2. causal depthwise convolution (window W) over q|k|v along time, then SiLU:
         each channel mixes its own last W values (the conv keeps the last W-1
         inputs in the cache: the "conv state");
      3. split into heads; L2-normalise q and k; scale q by 1/sqrt(Dk); repeat
         the Hk query/key heads so that each of the Hv value heads has one;
      4. gates: ``beta = sigmoid(b)`` (write strength), ``g = -exp(A_log) * softplus(a + dt_bias)``
         (log decay, <= 0: the memory is multiplied by exp(g) per token);
      5. the delta rule (recurrent for T == 1 and for a verify step, chunked otherwise),
         which reads and updates the recurrent state of the cache;
      6. gated RMSNorm of each head's output with z, then ``out_proj``.

    Steps 1 and 6 treat every token alone; steps 2-5 (:meth:`mix_sequence`) run along
    one sequence's time axis, so in an engine step they run once per sequence, on its
    own states (kv.py).

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Qwen3_5MoeConfig, slot: int):
        super().__init__()
        self.slot = slot  # which (conv, recurrent) state of the hybrid cache this layer owns
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # q | k | v
        self.kernel = config.linear_conv_kernel_dim
        C = config.hidden_size
        self.in_proj_qkv = nn.Linear(C, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(C, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(C, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(C, self.num_v_heads, bias=False)
        # depthwise: one length-W filter per channel (weight (conv_dim, 1, W), no bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))  # decay rate per head: A = exp(A_log)
        self.dt_bias = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, C, bias=False)

    def causal_conv(self, x: torch.Tensor, cache) -> torch.Tensor:
        """Causal depthwise convolution + SiLU over time; updates the cache's conv state.

        x: (T, conv_dim) -> (T, conv_dim). Output t sees inputs t-W+1 .. t; before
        the first position the window holds the cached last W-1 inputs (zeros
        without a cache or at the start). The engine keeps those inputs in float32
        (kv.py); they are read back in x's dtype, exactly as they were.
        """
        T = x.shape[0]
        weight = self.conv1d.weight  # (conv_dim, 1, W)
        prev = cache.conv_state(self.slot) if cache is not None else None  # (W-1, conv_dim)
        if T == 1 and prev is not None:
            # Decode: the window is the W-1 cached inputs plus this one.
            window = torch.cat((prev.to(x.dtype), x), dim=0)  # (W, conv_dim)
            prev.copy_(window[1:])  # roll: drop the oldest input
            return F.silu((window * weight[:, 0, :].t()).sum(0, keepdim=True))  # (1, conv_dim)
        if prev is None:
            prev = x.new_zeros(self.kernel - 1, x.shape[1])
        window = torch.cat((prev.to(x.dtype), x), dim=0)  # (W-1+T, conv_dim)
        if cache is not None:
            cache.remember_conv_window(self.slot, window)  # for rollback (verify steps only)
            prev.copy_(window[T:])  # the last W-1 inputs
        out = F.conv1d(window.t()[None], weight, groups=self.conv_dim)  # (1, conv_dim, T)
        return F.silu(out[0].t())

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        _, T, _ = x.shape
        Hv, Dv = self.num_v_heads, self.head_v_dim
        # 1. Projections, of all T tokens at once (in an engine step, every sequence's tokens).
        qkv = self.in_proj_qkv(x)[0]  # (T, conv_dim)
        z = self.in_proj_z(x).view(T, Hv, Dv)
        b = self.in_proj_b(x)[0]  # (T, Hv)
        a = self.in_proj_a(x)[0]  # (T, Hv)
        # 2.-5. Convolution, heads, gates and the delta rule run along one sequence's time
        #       axis, over its own states. In an engine step the T tokens are several sequences
        #       end to end: each one's rows lo:hi run on that sequence's states (kv.py).
        if isinstance(cache, Qwen3_5MoeEngineCache):
            o = torch.cat([self.mix_sequence(qkv[lo:hi], b[lo:hi], a[lo:hi], states)
                           for lo, hi, states in cache.sequences()])  # (T, Hv, Dv) float32
        else:
            o = self.mix_sequence(qkv, b, a, cache)  # (T, Hv, Dv) float32
        # 6. Gated norm per head, heads side by side, output projection.
        o = self.norm(o.to(x.dtype), z)  # (T, Hv, Dv)
        return self.out_proj(o.reshape(1, T, Hv * Dv))

    def mix_sequence(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, cache) -> torch.Tensor:
        """Steps 2-5 of forward on the T tokens of one sequence, reading and updating its states in ``cache``.

        qkv: (T, conv_dim), b, a: (T, Hv) in the model dtype; cache: a
        :class:`~.kv.Qwen3_5MoeHybridCache`, one sequence's :class:`~.kv.Qwen3_5MoeSequenceStates`
        in an engine step, or None -> o: (T, Hv, Dv) float32.
        """
        T = qkv.shape[0]
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        # 2. Short causal convolution over time.
        qkv = self.causal_conv(qkv, cache)
        # 3. Heads; normalised queries and keys (float32 from here to the output norm).
        q, k, v = qkv.float().split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = l2_normalize(q.view(T, Hk, Dk)) * Dk**-0.5
        k = l2_normalize(k.view(T, Hk, Dk))
        v = v.view(T, Hv, Dv)
        if Hv != Hk:  # value head j uses query/key head j // (Hv/Hk)
            q = q.repeat_interleave(Hv // Hk, dim=1)
            k = k.repeat_interleave(Hv // Hk, dim=1)
        # 4. Write strength and decay, per token and value head.
        # beta's sigmoid runs in the model dtype, then float32, as transformers' (b.sigmoid()): in bfloat16
        # beta is rounded to 8 bits there, and a float32 sigmoid here moved the logits by 0.7 x transformers'
        # own bfloat16 error (docs/qwen3_5.md, "bfloat16"). In float32 both are the same numbers.
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # (T, Hv), <= 0
        if tracing():  # only inside `lollm trace`: the gates and the memory's size per token
            self.record_gates(q, k, v, g, beta, cache)
        # 5. The delta rule over the recurrent state.
        if cache is None:
            state = q.new_zeros(Hv, Dk, Dv)
            return delta_rule_chunked(q, k, v, g, beta, state) if T > 1 else delta_rule_recurrent(q, k, v, g, beta, state)
        state = cache.recurrent_state(self.slot)  # (Hv, Dk, Dv) float32, updated in place
        if T == 1:
            return delta_rule_recurrent(q, k, v, g, beta, state)
        if cache.recording:  # a verify step: keep the state after every token for rollback
            return delta_rule_recurrent(q, k, v, g, beta, state, states_out=cache.state_history(self.slot))
        return delta_rule_chunked(q, k, v, g, beta, state)

    def record_gates(self, q, k, v, g, beta, cache) -> None:
        """For ``lollm trace``: decay exp(g), write strength beta and the state's size ||S|| after each token, (T, Hv) each.

        Arguments as in step 5 of forward. The norms come from a second, token-by-token run
        of the recurrence on a copy of the starting state (the chunked form keeps no
        per-token state); forward's own state is not touched.
        """
        Hv, Dk, Dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
        state = q.new_zeros(Hv, Dk, Dv) if cache is None else cache.recurrent_state(self.slot).clone()
        norms = []
        for t in range(q.shape[0]):
            delta_rule_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
            norms.append(state.norm(dim=(-2, -1)))  # (Hv,): Frobenius norm of each head's memory
        record_series(self, "decay exp(g)", g.exp(), note=(
            "How much of its memory each head keeps at this token: the state S is multiplied by exp(g), "
            "in (0, 1], before the token is written. Near 1 the head remembers far back; near 0 it forgets."))
        record_series(self, "write strength beta", beta, note=(
            "How hard each head writes this token: the delta rule moves what the memory returns for the "
            "token's key a fraction beta (0..1) of the way toward the token's value."))
        record_series(self, "state norm ||S||", torch.stack(norms), note=(
            "The size (Frobenius norm) of each head's memory matrix after the token: it grows as tokens "
            "are written and shrinks where the decay fades it. Its shape never changes: a fixed-size memory."))


# ---------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------
class Qwen3_5MoeMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases (the shared expert).

    x: (..., C) -> (..., C)
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3_5MoeRouter(nn.Module):
    """Chooses k experts per token and how much each one counts.

    ``probs = softmax(x W^T)`` over the E experts (in float32); the k largest
    are picked and, with ``norm_topk_prob``, renormalised to sum to 1.

    x: (N, C) -> indices (N, k) int64 (most likely first), weights (N, k) in x's dtype
    """

    def __init__(self, config: Qwen3_5MoeConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))  # (E, C)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)  # (N, E)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return indices, weights.to(x.dtype)


class Qwen3_5MoeExperts(nn.Module):
    """E SwiGLU experts, stored fused as two 3-D tensors (transformers' layout).

    gate_up_proj: (E, 2I, C): rows 0..I-1 of expert e are its gate projection, rows I..2I-1 its up projection.
    down_proj:    (E, C, I).

    Only the experts some token picked are computed. For each of them: gather
    its tokens, run its SwiGLU, scale by the router weight, add into the output.
    In a decode step (one token) that is k small matrix-vector products, reading
    k of the E experts' weights: the point of a sparse MoE.

    x: (N, C); indices, weights: (N, k) -> (N, C)
    """

    def __init__(self, config: Qwen3_5MoeConfig):
        super().__init__()
        E, C, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, C))
        self.down_proj = nn.Parameter(torch.zeros(E, C, I))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode: one token, its k experts one after the other
            for e, w in zip(indices[0].tolist(), weights[0]):
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # (1, I) each
                out += w * F.linear(F.silu(gate) * up, self.down_proj[e])
            return out
        for e in indices.unique().tolist():  # every expert some token picked
            token, slot = torch.where(indices == e)  # which tokens, and where e is in their top-k
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, I) each
            y = F.linear(F.silu(gate) * up, self.down_proj[e])  # (n, C)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


class Qwen3_5MoeSparseMoeBlock(nn.Module):
    """The feed-forward of every qwen3_5_moe layer: routed experts plus a gated shared expert.

    ``out = sum_k weight_k * expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Qwen3_5MoeConfig):
        super().__init__()
        self.gate = Qwen3_5MoeRouter(config)  # named "gate" as in the checkpoint (mlp.gate.weight)
        self.experts = Qwen3_5MoeExperts(config)
        self.shared_expert = Qwen3_5MoeMLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, T, C = x.shape
        x = x.view(T, C)
        indices, weights = self.gate(x)  # (T, k) each
        record_choice(self, "routed experts", indices, weights, options=self.gate.weight.shape[0], note=(  # lollm trace only
            "The router scores every expert for each token and keeps the k best; their outputs are added "
            "with these weights (the shared expert is always added too). Table: the selected token's experts "
            "in each layer. Grid: how often each expert was picked over the whole prompt; outlined: the selected token's."))
        routed = self.experts(x, indices, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared).view(1, T, C)
