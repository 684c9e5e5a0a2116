"""Checkpoint key-map parts: the HF names of the pieces families share. No torch here.

A family's key map is a table HF tensor name -> Slot (where it lives in moegraph's state dict);
these functions add one piece's rows through `put(hf_suffix, moegraph_suffix, shape, index)`,
relative to `model.layers.{i}.` and `layers.{i}.`. Experts are stacked in memory and stored
one tensor per expert on disk:

    {experts}.{e}.{gate}.weight [F, H] -> moe.w_gate_up[e, :F]
    {experts}.{e}.{up}.weight   [F, H] -> moe.w_gate_up[e, F:]
    {experts}.{e}.{down}.weight [H, F] -> moe.w_down[e]

or, in a fused layer, `{experts}.gate_up_proj` [E, 2F, H] and `{experts}.down_proj` [E, H, F].

A slot may store its tensor in another layout on disk (`Slot.layout`, steps applied in order
on load and undone in reverse on save, by io/hf_names.py): `"transpose"` swaps the last two
dims, `"deinterleave"` turns a last dim of interleaved pairs (g0, u0, g1, u1, ...) into halves
(g0, g1, ... | u0, u1, ...). Steps never touch dim 0, so a slice of experts or of an FSDP
chunk commutes with them. GPT-OSS's `gate_up_proj` [E, H, 2F] (gate/up interleaved) is
("deinterleave", "transpose") -> [E, 2F, H].
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Slot(NamedTuple):
    """Where one HF tensor lives in the moegraph state dict."""

    name: str                   # moegraph state-dict name
    index: tuple                # () the whole tensor; (e,) expert e; (e, slice) rows of expert e
    shape: tuple[int, ...]      # the HF tensor's shape on disk
    layout: tuple[str, ...] = ()  # disk -> moegraph steps (module docstring); () the same

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The shape in moegraph's layout (of the indexed part)."""
        shape = self.shape
        if "transpose" in self.layout:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return shape


Put = Callable[..., None]


def model_keys(cfg, layer_keys: Callable[[Put, int], None]) -> dict[str, Slot]:
    """The whole table: embedding, `layer_keys(put, i)` per layer, final norm, lm head."""
    H, V = cfg.hidden_size, cfg.vocab_size
    table = {"model.embed_tokens.weight": Slot("embed_tokens.weight", (), (V, H))}
    for i in range(cfg.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"layers.{i}."

        def put(hf_suffix, mg_suffix, shape, index=(), layout=()):
            table[hf + hf_suffix] = Slot(mg + mg_suffix, index, tuple(shape), tuple(layout))

        layer_keys(put, i)
    table["model.norm.weight"] = Slot("norm.weight", (), (H,))
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = Slot("lm_head.weight", (), (V, H))
    return table


def attention_keys(put: Put, cfg, qk_norm: str | None, qkv_bias: bool = False,
                   o_bias: bool = False) -> None:
    """Input norm and self_attn: q/k/v/o projections, optional q/k/v and o biases, and q/k
    RMSNorm weights per head (`"head"`, [head_dim]) or over the whole projection (`"proj"`)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    put("input_layernorm.weight", "attn.input_norm.weight", (H,))
    put("self_attn.q_proj.weight", "attn.q_proj.weight", (q_rows, H))
    if qkv_bias:
        put("self_attn.q_proj.bias", "attn.q_proj.bias", (q_rows,))
    put("self_attn.k_proj.weight", "attn.k_proj.weight", (kv_rows, H))
    if qkv_bias:
        put("self_attn.k_proj.bias", "attn.k_proj.bias", (kv_rows,))
    put("self_attn.v_proj.weight", "attn.v_proj.weight", (kv_rows, H))
    if qkv_bias:
        put("self_attn.v_proj.bias", "attn.v_proj.bias", (kv_rows,))
    put("self_attn.o_proj.weight", "attn.o_proj.weight", (H, q_rows))
    if o_bias:
        put("self_attn.o_proj.bias", "attn.o_proj.bias", (H,))
    if qk_norm == "head":
        put("self_attn.q_norm.weight", "attn.q_norm.weight", (hd,))
        put("self_attn.k_norm.weight", "attn.k_norm.weight", (hd,))
    elif qk_norm == "proj":
        put("self_attn.q_norm.weight", "attn.q_norm.weight", (q_rows,))
        put("self_attn.k_norm.weight", "attn.k_norm.weight", (kv_rows,))


def expert_keys(put: Put, cfg, experts: str, fused: bool,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """The stacked experts of a MoE layer under HF prefix `experts` ("mlp.experts")."""
    E, F, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    gate, up, down = names
    if fused:
        put(f"{experts}.gate_up_proj", "moe.w_gate_up", (E, 2 * F, H))
        put(f"{experts}.down_proj", "moe.w_down", (E, H, F))
        return
    for e in range(E):
        x = f"{experts}.{e}."
        put(x + f"{gate}.weight", "moe.w_gate_up", (F, H), (e, slice(0, F)))
        put(x + f"{up}.weight", "moe.w_gate_up", (F, H), (e, slice(F, 2 * F)))
        put(x + f"{down}.weight", "moe.w_down", (H, F), (e,))


def dense_mlp_keys(put: Put, cfg, hf_prefix: str, mg_prefix: str, width: int) -> None:
    """A SwiGLU MLP (gate/up/down) of `width` under `hf_prefix` ("mlp.")."""
    H = cfg.hidden_size
    put(hf_prefix + "gate_proj.weight", mg_prefix + "gate_proj.weight", (width, H))
    put(hf_prefix + "up_proj.weight", mg_prefix + "up_proj.weight", (width, H))
    put(hf_prefix + "down_proj.weight", mg_prefix + "down_proj.weight", (H, width))
