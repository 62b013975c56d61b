"""EAGLE-3 drafter: one Llama-style decoder layer on fused target hidden states.

The forward pass and the parameter names follow the EAGLE-3 checkpoint layout that vLLM and SGLang load exactly,
so the state dict *is* the vLLM / SGLang export (see tlt/drafter/eagle3.py):

    h0     = fc(cat(A_low, A_mid, A_high))                      # [B,T,H]
    x      = cat(input_layernorm(E[tok]), hidden_norm(h0))      # [B,T,2H]
    h      = h0 + o_proj(attn(q/k/v(x), RoPE at the position))
    h      = h + mlp(post_attention_layernorm(h))               # fed back as the next hidden
    logits = lm_head(norm(h))                                   # [B,T,Vd] over the draft vocab

Alignment (as vLLM's EAGLE): position t gets hidden = fuse(aux_t) and input token_{t+1};
its logits predict token_{t+2}. Later draft steps feed the returned h and the drafted token.
The target embedding E is shared and frozen: a non-persistent buffer, never trained or saved, so
`state_dict()` is exactly the trainable and exported weights (incl. the d2t / t2d maps).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tlt import arch
from tlt.arch import rope_parameters  # noqa: F401 - re-exported: the RoPE reading lives in tlt.arch
from tlt.versions import bump


def default_aux_ids(num_layers: int) -> list[int]:
    """HF hidden_states ids (low, mid, high): (2, N//2, N-3), or distinct valid ids when those collide."""
    if num_layers > 6:
        return [2, num_layers // 2, num_layers - 3]
    ids = {1, num_layers // 2, max(num_layers - 1, 0)}
    # Fill with 0 before N: vLLM reads id N as the final state *before* the norm, HF after it.
    for extra in (0, num_layers):
        if len(ids) < 3:
            ids.add(extra)
    return sorted(ids) + [num_layers] * (3 - len(ids))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Statistics in fp32 (as the target does) so bf16 drafters match the engines.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, dim: int) -> Tensor:
    """RoPE on the first `dim` channels of each head, the rest passed through (partial rotary)."""
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class Attention(nn.Module):
    """GQA attention over the 2H-wide input; the cache holds keys with RoPE applied."""

    def __init__(self, config, hidden: int):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = getattr(config, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.n_heads
        self.q_proj = nn.Linear(2 * hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.rotary_dim = self.head_dim  # fewer with a partial rotary factor (Phi-4-mini): set by the drafter

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, past, mask: Tensor):
        """x [B,T,2H]; cos/sin [B,T,hd]; mask [B,T,S_past+T] bool (True = attend).

        Returns (out [B,T,H], (k, v) each [B,n_kv,S_past+T,hd]).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
        q, k = rotary(q, cos, sin, self.rotary_dim), rotary(k, cos, sin, self.rotary_dim)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1),
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, config, hidden: int):
        super().__init__()
        inter = config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act = ACT2FN[getattr(config, "hidden_act", "silu")]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The one decoder layer; names match the export (`midlayer.*`)."""

    def __init__(self, config, hidden: int):
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Attention(config, hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(config, hidden)

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, past, mask: Tensor):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        attn, cache = self.self_attn(x, cos, sin, past, mask)
        h = hidden + attn  # residual is the fused hidden, taken before hidden_norm
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter built from the target's config (see module docstring for the forward)."""

    def __init__(self, target_config, embed_weight: Tensor, draft_vocab_size: int,
                 aux_layer_ids: list[int] | None = None):
        super().__init__()
        H = target_config.hidden_size
        V = target_config.vocab_size
        n = target_config.num_hidden_layers
        Vd = draft_vocab_size if 0 < draft_vocab_size <= V else V
        if embed_weight.shape != (V, H):
            raise ValueError(f"embed_weight is {tuple(embed_weight.shape)}, target config says [{V}, {H}]")
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_ids(n)
        if len(self.aux_layer_ids) != 3 or not all(0 <= i <= n for i in self.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {self.aux_layer_ids} must be 3 ids in [0, {n}] (HF hidden_states)")
        self.hidden_size, self.vocab_size, self.draft_vocab_size = H, V, Vd
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = MidLayer(target_config, H)
        self.norm = RMSNorm(H, getattr(target_config, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(H, Vd, bias=False)
        # Shared, frozen target embedding: non-persistent, so it's neither trained nor exported.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(V) < Vd)
        self._init_rope(target_config)
        self.logit_scale, self.logit_softcap = arch.logit_transform(target_config)
        self.max_position_embeddings = getattr(target_config, "max_position_embeddings", 4096)
        self.target_head: Tensor | None = None  # optional reference to the target lm_head, for set_vocab

    def _init_rope(self, config) -> None:
        """Frequencies of the drafter's one full-attention layer (tlt.arch.drafter_rope: Gemma 3's
        global-layer RoPE, a partial rotary factor), the same numbers the export writes."""
        with torch.device("cpu"):  # also when the drafter is built on the meta device (tlt.arch's preflight)
            inv_freq, scale = self._rope_frequencies(config)
        self.midlayer.self_attn.rotary_dim = 2 * inv_freq.numel()
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq = {torch.device("cpu"): inv_freq.float().cpu()}
        self.rope_scale = float(scale)

    def _rope_frequencies(self, config) -> tuple[Tensor, float]:
        params = arch.drafter_rope(config)
        kind = params.get("rope_type", "default")
        hd = self.midlayer.self_attn.head_dim
        dim = int(hd * params.get("partial_rotary_factor", 1.0))
        dim -= dim % 2
        if kind == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scale = 1.0
        else:
            # Scaled variants (llama3, yarn, linear, ...) use transformers' own formulas.
            inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config, None, layer_type=arch.rope_layer_type(config))
        return inv_freq, scale

    # ---- vocabulary maps -------------------------------------------------------------------
    @torch.no_grad()
    def set_vocab(self, token_counts: Tensor) -> None:
        """Keep the Vd most frequent target ids (sorted ascending) as the draft vocabulary.

        token_counts [V]. Rows of lm_head for ids that stay are moved to their new slots; new
        ids get the target's lm_head row when `target_head` is set, else zeros.
        """
        V, Vd = self.vocab_size, self.draft_vocab_size
        if token_counts.numel() != V:
            raise ValueError(f"token_counts has {token_counts.numel()} entries, target vocab is {V}")
        if Vd == V:
            keep = torch.arange(V, device=self.d2t.device)
        else:
            # Stable tie-break by id so equal counts give a deterministic vocabulary.
            order = torch.sort(token_counts.float().cpu(), descending=True, stable=True).indices
            keep = order[:Vd].sort().values.to(self.d2t.device)
        old_ids = self.draft_to_target_ids()
        old_rows = self.lm_head.weight.data.clone()
        slot = torch.full((V,), -1, dtype=torch.long, device=keep.device)
        slot[old_ids] = torch.arange(Vd, device=keep.device)
        new_rows = torch.zeros_like(old_rows)
        if self.target_head is not None:
            new_rows.copy_(self.target_head[keep.to(self.target_head.device)].to(new_rows))
        kept = slot[keep] >= 0
        new_rows[kept] = old_rows[slot[keep][kept]]
        self.lm_head.weight.data.copy_(new_rows)
        self.d2t.copy_(keep - torch.arange(Vd, device=keep.device))
        self.t2d.zero_()
        self.t2d[keep] = True
        bump(self)  # a new draft vocabulary: the engines' copies are stale

    def draft_to_target_ids(self) -> Tensor:
        """[Vd] target id of every draft slot."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocab ids (any shape) to target ids: draft_id + d2t[draft_id]."""
        return draft_ids + self.d2t[draft_ids]

    # ---- forward pieces ----------------------------------------------------------------------
    @staticmethod
    def gather_aux(hidden_states: tuple[Tensor, ...], ids: list[int]) -> Tensor:
        """HF hidden_states tuple -> [B,T,3H_t] = cat of hidden_states[i] for i in ids."""
        return torch.cat([hidden_states[i] for i in ids], dim=-1)

    def fuse(self, aux: Tensor) -> Tensor:
        """[B,T,3H_t] -> [B,T,H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def embed(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.embed_weight).to(self.fc.weight.dtype)

    def compute_logits(self, h: Tensor) -> Tensor:
        """[B,T,H] pre-norm hidden -> [B,T,Vd]."""
        return self.lm_head(self.norm(h))

    def target_logits(self, head_out: Tensor) -> Tensor:
        """The target's logits from its LM head's raw output (hidden_states[-1] @ lm_head.T): scaled
        and soft-capped as the target does (tlt.arch.logit_transform), for the teacher distribution."""
        x = head_out * self.logit_scale if self.logit_scale != 1.0 else head_out
        if self.logit_softcap:
            x = torch.tanh(x / self.logit_softcap) * self.logit_softcap
        return x

    def _rope(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        dev = position_ids.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = self._inv_freq[torch.device("cpu")].to(dev)
        freqs = position_ids.float().unsqueeze(-1) * self._inv_freq[dev]  # [B,T,hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    @staticmethod
    def build_mask(key_mask: Tensor | None, B: int, T: int, S_past: int, device) -> Tensor:
        """[B,T,S_past+T] bool: full over valid past slots, causal among the T new ones.

        key_mask: None, [B,S_past+T] valid key slots, or a full [B,T,S_past+T] mask used as is.
        Each query always sees its own slot, so no row is empty (padding rows stay finite).
        """
        S = S_past + T
        if key_mask is not None and key_mask.dim() == 3:
            mask = key_mask.to(device=device, dtype=torch.bool).clone()
        else:
            q_pos = torch.arange(T, device=device).unsqueeze(1) + S_past
            mask = (torch.arange(S, device=device).unsqueeze(0) <= q_pos).expand(B, T, S).clone()
            if key_mask is not None:
                mask &= key_mask.to(device=device, dtype=torch.bool).unsqueeze(1)
        idx = torch.arange(T, device=device)
        mask[:, idx, idx + S_past] = True
        return mask

    def forward(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor,
                past: tuple[Tensor, Tensor] | None = None, key_mask: Tensor | None = None):
        """One drafter pass over T new positions.

        input_ids [B,T]; hidden [B,T,H] (fuse(aux) or the previous step's h); position_ids [B,T];
        past: (k, v) each [B,n_kv,S_past,hd]; key_mask: [B,S_past+T] or [B,T,S_past+T] bool.
        Returns (h [B,T,H] pre-norm, logits [B,T,Vd], (k, v) each [B,n_kv,S_past+T,hd]).
        """
        B, T = input_ids.shape
        S_past = 0 if past is None else past[0].shape[2]
        mask = self.build_mask(key_mask, B, T, S_past, input_ids.device)
        cos, sin = self._rope(position_ids)
        h, cache = self.midlayer(self.embed(input_ids), hidden.to(self.fc.weight.dtype), cos, sin, past, mask)
        return h, self.compute_logits(h), cache


def build_drafter(target_model, cfg) -> Eagle3Drafter:
    """An EAGLE-3 drafter for `target_model` (HF causal LM) from a DrafterConfig.

    The embedding is shared with the target; norm and lm_head start from the target's final
    norm and LM-head rows (initial draft vocab = the first Vd ids until `set_vocab` is called).
    """
    config = target_model.config
    arch.arch_of(config)  # ArchError (exit 2) for an architecture outside the tested matrix
    embed = target_model.get_input_embeddings().weight
    drafter = Eagle3Drafter(config, embed, cfg.draft_vocab_size, cfg.aux_layer_ids)
    head = target_model.get_output_embeddings()
    drafter.target_head = head.weight.detach() if head is not None else embed.detach()
    with torch.no_grad():
        drafter.lm_head.weight.copy_(drafter.target_head[: drafter.draft_vocab_size])
        final_norm = arch.final_norm(target_model)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            drafter.norm.weight.copy_(arch.norm_scale(final_norm, config))
    if cfg.init_from_target:
        init_from_last_layer(drafter, target_model)
    # fp32 master weights whatever the target dtype; forward casts its inputs to match.
    return drafter.to(device=embed.device)


@torch.no_grad()
def init_from_last_layer(drafter: Eagle3Drafter, target_model) -> None:
    """Start the midlayer as the target's last decoder layer applied to the high aux feature.

    fc passes the last aux feature (layer N-3) through unchanged; attention reads the hidden half
    of its 2H input with the layer's q/k/v (the embedding half starts at zero); o_proj, the MLP and
    the norms are copied. With the final norm and LM head this already predicts the next token,
    which training then refines (same shapes, so the export format is unchanged). What the
    drafter's Llama layer has no slot for stays out: biases (Qwen2), q/k norms (Qwen3, Gemma 3,
    OLMo 2), post-norms (Gemma 3, OLMo 2), experts (MoE: the MLP keeps its random start).
    """
    config = target_model.config
    layer = arch.decoder_layers(target_model)[-1]
    H, mid = drafter.hidden_size, drafter.midlayer
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, 2 * H:] = torch.eye(H, device=drafter.fc.weight.device)
    for name, src in zip(("q_proj", "k_proj", "v_proj"), arch.attn_weights(layer, config)):
        dst = getattr(mid.self_attn, name).weight
        dst.zero_()
        dst[:, H:] = src.float()
    mid.self_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight.float())
    mlp = arch.mlp_weights(layer)
    if mlp is not None:
        for name, src in zip(("gate_proj", "up_proj", "down_proj"), mlp):
            getattr(mid.mlp, name).weight.copy_(src.float())
    pre_attn, pre_mlp = arch.layer_norms(layer, config)
    if pre_attn is not None:
        mid.input_layernorm.weight.copy_(pre_attn)
        mid.hidden_norm.weight.copy_(pre_attn)
    if pre_mlp is not None:
        mid.post_attention_layernorm.weight.copy_(pre_mlp)
