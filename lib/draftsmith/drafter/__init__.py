"""The EAGLE-3 drafter: draft vocabulary (`vocab`), model (`model`), training-time-test training
(`data`, `train`) and the SGLang/vLLM export (`export`). Stage 06 loads a drafter with
`load_exported(export_dir, target_path)`."""

from .export import load_exported
from .model import DrafterConfig, Eagle3Drafter, KVCache

__all__ = ["load_exported", "DrafterConfig", "Eagle3Drafter", "KVCache"]
