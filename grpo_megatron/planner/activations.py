"""The planner's activation memory: bytes per token of one micro-batch, per stored tensor.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(section 4: 34*s*b*h + 5*a*s^2*b bytes per layer, divided by t with sequence parallelism),
re-derived per stored tensor for GQA/MLA attention, SwiGLU MLPs and routed experts; plus the MoE
dispatcher's buffers and the output layer's logits. Pure arithmetic, no torch.
"""

from __future__ import annotations

from grpo_megatron.planner.model_states import Layout, ModelDims


def layer_activation_bytes(
    d: ModelDims,
    layer: int,
    layout: Layout,
    act_bytes: int,
    *,
    seq_len: int,
    flash: bool,
    moe_imbalance: float,
) -> float:
    """Bytes one rank stores for backward, per token of the micro-batch, in one layer (no recompute).

    With sequence parallelism the tensors outside attention/MLP are split over TP (Korthikanti's
    34/t); inside, every projection's input and output is split over TP by heads or columns. No
    dropout masks (RL runs without dropout). Without flash attention the softmax probabilities
    (heads x seq_len per token) are kept too.
    """
    t = layout.tp
    sp = t if layout.sequence_parallel else 1
    h = d.hidden
    b = act_bytes
    total = 2 * h * b / sp  # inputs of the two RMSNorms
    if d.mla:
        q_rows = d.heads * (d.qk_nope + d.qk_rope)
        total += h * b / sp  # input of the down projections (re-gathered in backward under SP)
        total += ((d.q_lora or 0) * 2 + (d.kv_lora + d.qk_rope) + d.kv_lora) * b  # latents, normed latents
        total += (2 * q_rows + 2 * d.heads * d.v_head) * b / t  # Q, K, V, attention output
        heads_kv = d.heads
    else:
        qkv = (d.heads + 2 * d.kv_groups) * d.head_dim
        total += h * b / sp + (qkv + d.heads * d.head_dim) * b / t  # QKV input, Q/K/V, attention output
        heads_kv = d.heads
    if not flash:
        total += 2 * heads_kv * seq_len * b / t  # attention scores and softmax probabilities
    if d.moe_layers[layer]:
        total += h * b / sp + 8 * d.num_experts / sp  # router input; fp32 logits and probabilities
        routed = d.topk * moe_imbalance / sp  # token copies reaching this rank's experts, per token
        # each copy: fc1 input (all-gathered over ETP) and gate/up/GLU outputs of an expert shard
        total += routed * (h * layout.etp + 3 * d.moe_ffn) * b
        if d.shared_ffn:
            total += h * b / sp + 3 * d.shared_ffn * b / t
    else:
        total += h * b / sp + 3 * d.ffn * b / t  # fc1 input; gate/up output; GLU output (fc2 input)
    return total


def dispatch_buffer_bytes(
    d: ModelDims, layout: Layout, act_bytes: int, tokens: float, moe_imbalance: float
) -> float:
    """All-to-all send and receive buffers of one MoE layer (transient, one layer at a time)."""
    if not any(d.moe_layers):
        return 0.0
    sp = layout.tp if layout.sequence_parallel else 1
    return 2 * tokens * d.topk * moe_imbalance * d.hidden * act_bytes * layout.etp / sp


def output_activation_bytes(padded_vocab: int, layout: Layout, act_bytes: int) -> float:
    """Last stage, per token: logits (model dtype), their fp32 copy kept by the logprob function, and
    the fp32 gradient made in backward (vocabulary split over TP)."""
    return (act_bytes + 4 + 4) * padded_vocab / layout.tp
