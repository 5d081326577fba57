"""Reference GLM-style MoE trainer built on bagualu2: the model (architecture only) and measurement tools."""
