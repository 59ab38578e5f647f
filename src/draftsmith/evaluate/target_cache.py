"""Our decoder's target: one sequence through it with a KV cache, its logits and the drafter's features.

The features are the outputs of the auxiliary decoder layers, captured by forward hooks exactly as
stage 04 captured them for training, so the drafter reads at inference what it learned from.
"""

from __future__ import annotations

import torch

from ..targets.hf import LayerOutputs


class Target:
    """One sequence through the target with a KV cache. `forward(ids)` runs the new tokens and
    returns their logits [T, V] (float32, on the CPU) and, when `layer_ids` (output convention) are
    given, the drafter's features aux [T, nH]: the outputs of those decoder layers
    (`targets.hf.LayerOutputs`)."""

    def __init__(self, model, layer_ids: list[int] | None = None):
        from transformers import DynamicCache

        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.cache = self._new_cache()
        self.layer_ids = list(layer_ids or [])
        self._layers = LayerOutputs(model, self.layer_ids)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None \
            else model.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    def reset(self) -> None:
        self.cache = self._new_cache()

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_to_keep)
        self.cache = out.past_key_values
        outputs = self._layers.take()
        aux = torch.cat([o[0] for o in outputs], dim=-1).float() if outputs else None
        return out.logits[0].float().cpu(), aux   # logits on the CPU: sampling uses a CPU generator

    def truncate(self, n: int) -> None:
        """Keep the first n positions of the cache."""
        drop = len(self) - n
        if drop < 0:
            raise ValueError(f"cannot truncate a cache of {len(self)} positions to {n}")
        if drop:
            self.cache.crop(-drop)

    def close(self) -> None:
        self._layers.close()
