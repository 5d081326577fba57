"""The torch side of bagualu2 (the only package that imports torch). So far: the activation tracker that measures
what a micro-batch keeps for backward and enforces a memory cap on CPU. Plan application (offload, FP8, recompute
hooks) and the dual-batch executor are the open part of issue #5."""

from .tracker import ActivationOutOfMemoryError, ActivationTracker, storage_bytes

__all__ = ["ActivationOutOfMemoryError", "ActivationTracker", "storage_bytes"]
