"""Tiny random transformers MoE models (no downloads): ``tiny(model_type)`` -> (model, input ids).

A config of the family with its defaults (``use_cache`` included), shrunk: hidden 64, 2 layers, 4 heads (2 KV
heads), 4 experts, top-2, vocabulary 128; per-layer lists of the default config cut to 2 layers keeping their
distinct values; a few families need a setting more (``EXTRA``).
"""

from __future__ import annotations

import torch

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts=4,
             n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2,
             n_group=1, topk_group=1, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
             n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# (settings to drop, settings to add) per family
EXTRA = {
    "deepseek_v3": (("head_dim", "num_key_value_heads"), {"first_k_dense_replace": 1}),
    "glm4_moe": ((), {"first_k_dense_replace": 1}),
    "qwen3_next": ((), {"layer_types": ["linear_attention", "full_attention"]}),
    "gpt_oss": ((), {"layer_types": ["sliding_attention", "full_attention"]}),
}


def tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}) or {})
    settings = {k: v for k, v in SMALL.items() if k in fields}
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():
        if isinstance(value, list) and layers and len(value) == layers and key not in settings:
            distinct = list(dict.fromkeys(value))
            settings[key] = (distinct + [value[-1]] * 2)[:2] if len(distinct) <= 2 else value[:2]
    drop, add = EXTRA.get(model_type, ((), {}))
    for key in drop:
        settings.pop(key, None)
    settings.update(add)
    return config_class(**settings)


def tiny(model_type: str, *, seed: int = 0, batch: int = 2, seq: int = 16):
    """A tiny random ``model_type`` causal LM in FP32, training mode, and a batch of token ids."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().train()
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids
