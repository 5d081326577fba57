"""Tiny random transformers MoE models (no downloads): ``tiny(model_type)`` -> (model, input ids).

A config of the family with its defaults (``use_cache`` included), shrunk: hidden 64, 2 layers, 4 heads (2 KV
heads), 4 experts, top-2, vocabulary 128; per-layer lists of the default config cut to 2 layers keeping their
distinct values; a few families need a setting more (``EXTRA``).
"""

from __future__ import annotations

import torch

from bagualu2.integrations import hf

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts=4,
             n_routed_experts=4, num_local_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_k=2, moe_topk=2,
             n_group=1, topk_group=1, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
             n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# (settings to drop, settings to add) per family
MLA = ("head_dim", "num_key_value_heads")  # multi-head latent attention: its own head sizes
INDEXER = {"index_topk": 8, "index_head_dim": 16, "index_n_heads": 2}
EXTRA = {
    "deepseek_v3": (MLA, {"first_k_dense_replace": 1}),
    "axk1": (MLA, {"first_k_dense_replace": 1}),
    "glm4_moe_lite": (MLA, {"first_k_dense_replace": 1}),
    "axk2": (MLA, {"first_k_dense_replace": 1, **INDEXER}),
    "deepseek_v32": (MLA, {"first_k_dense_replace": 1, **INDEXER}),
    "glm_moe_dsa": (MLA, {"first_k_dense_replace": 1, **INDEXER}),
    "glm4_moe": ((), {"first_k_dense_replace": 1}),
    "qwen3_next": ((), {"layer_types": ["linear_attention", "full_attention"]}),
    "gpt_oss": ((), {"layer_types": ["sliding_attention", "full_attention"]}),
    "granitemoehybrid": ((), {"layer_types": ["mamba", "attention"], "mamba_n_heads": 8, "mamba_d_state": 16,
                              "mamba_chunk_size": 16}),
    "jamba": ((), {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                   "expert_layer_offset": 1, "use_mamba_kernels": False}),
    "nemotron_h": ((), {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "moe"],
                        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16,
                        "chunk_size": 16, "use_mamba_kernels": False}),
    "lfm2_moe": ((), {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1}),
    "zaya": ((), {"num_experts_per_tok": 1}),
    "flint": ((), {"mlp_only_layers": [0]}),
    "kimi_linear": ((), {"linear_head_dim": 16, "linear_num_heads": 4}),
    "dots3_note_text": ((), {"num_key_value_heads": 4}),
    "sarvam_mla": (MLA, {"first_k_dense_replace": 1}),
    "sarvam_moe": ((), {"first_k_dense_replace": 1}),
    "qwen4_exp_text": ((), {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2,
                            "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                            "indexer_compress_ratio": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                            "linear_num_key_heads": 2, "linear_num_value_heads": 2, "hc_lowrank": 8}),
    "gemma4_text": ((), {"enable_moe_block": True, "top_k_experts": 2, "hidden_size_per_layer_input": 0}),
}
FAMILIES = hf.SUPPORTED_FAMILIES


def tiny_config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    fields = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}) or {})
    settings = {k: v for k, v in SMALL.items() if k in fields}
    drop, add = EXTRA.get(model_type, ((), {}))
    num_layers = add.get("num_hidden_layers", 2)
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():
        if isinstance(value, list) and layers and len(value) == layers and key not in settings:
            distinct = list(dict.fromkeys(value))
            settings[key] = ((distinct + [value[-1]] * num_layers)[:num_layers] if len(distinct) <= num_layers
                             else value[:num_layers])
    for key in drop:
        settings.pop(key, None)
    settings.update(add)
    return config_class(**settings)


def tiny(model_type: str, *, seed: int = 0, batch: int = 2, seq: int = 16):
    """A tiny random ``model_type`` causal LM in FP32, training mode, and a batch of token ids."""
    import importlib

    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # a family the auto class does not map (mistral4): its module's causal LM
        module = importlib.import_module(f"transformers.models.{model_type}")
        causal = next(getattr(module, name) for name in dir(module) if name.endswith("ForCausalLM"))
        model = causal(config)
    model = model.float().train()
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids


def run_plan(model, ids, instrumented, plan):
    """One training step of ``model`` under ``plan`` (every re-run verified): ``(loss, gradients, device bytes,
    host bytes)``, a missing gradient as zeros. The RNG is seeded first, so a family that draws random numbers in
    training (phimoe's router) draws the same ones in every run."""
    from bagualu2.exec import apply_plan

    torch.manual_seed(0)
    executor = apply_plan(instrumented, plan, verify=True)
    model.zero_grad(set_to_none=True)
    with executor.micro_batch("mb") as record:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    executor.release("mb")
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out.loss.detach(), grads, record.device_bytes, record.host_bytes
