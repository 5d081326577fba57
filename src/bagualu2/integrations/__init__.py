"""bagualu2 on other people's models: ``integrations.hf`` for Hugging Face transformers MoE models.

Each integration is importable without the library it integrates; it fails only when called without it.
"""
