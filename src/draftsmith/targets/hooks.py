"""Forward hooks that keep the outputs of chosen decoder layers of a transformers model.

Stage 04 (`draftsmith.targets.hf.Capture`) and stage 06's decoder (`evaluate.Target`) read the
drafter's features the same way through this: layer id k (output convention, `draftsmith.layers`)
is the output of decoder layer k, i.e. Hugging Face `output_hidden_states[k + 1]`.
"""

from __future__ import annotations

import torch


class LayerOutputs:
    """Hooks on `model`'s decoder layers `ids`; after a forward pass `take()` returns their outputs
    in the order of `ids` and forgets them. `close()` removes the hooks."""

    def __init__(self, model, ids: list[int]):
        self.ids = list(ids)
        self._out: dict[int, torch.Tensor] = {}
        decoder_layers = model.get_decoder().layers
        self._hooks = [decoder_layers[k].register_forward_hook(self._keeper(k)) for k in self.ids]

    def _keeper(self, k: int):
        def hook(module, args, output):
            self._out[k] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> list[torch.Tensor]:
        out = [self._out[k] for k in self.ids]
        self._out.clear()
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
