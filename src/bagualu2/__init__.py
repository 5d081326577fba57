"""bagualu2: flexible per-micro-batch activation-memory provisioning for MoE training (BaGuaLu-2)."""

__version__ = "0.1.0"
