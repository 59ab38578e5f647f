"""Stage 04's `hf` backend: the target in transformers in this process, features read by hooks.

The reference: exact on tiny targets and for cross-checks, one process per GPU under torchrun.
Samples are right-padded into one batch and run without an attention mask: under a causal mask a
real token never sees the padding after it, and the padded rows are dropped before returning.
`LayerOutputs`, the hooks, is also how stage 06's decoder (`evaluate.Target`) reads the drafter's
features: layer id k (output convention, `draftsmith.layers`) is the output of decoder layer k,
Hugging Face `output_hidden_states[k + 1]`.
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


def pad_batch(batch, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [n, L] (int64) and the mask of real tokens [n, L]."""
    n, width = len(batch), max(len(s) for s in batch)
    ids = torch.full((n, width), pad_id, dtype=torch.int64)
    keep = torch.zeros((n, width), dtype=torch.bool)
    for r, s in enumerate(batch):
        ids[r, :len(s)] = s.input_ids
        keep[r, :len(s)] = True
    return ids, keep


class Capture:
    """Calling it runs the decoder (not the lm_head) on a batch and returns aux [T, nH] (the outputs
    of decoder layers `layer_ids`, side by side) and last [T, H] (the final hidden state after the
    final norm) of the real tokens, sample after sample, on the CPU."""

    backend = "hf"
    scratch_dir = None  # unused: features come back in memory

    def __init__(self, model, layer_ids: list[int]):
        self.model = model
        self.base = model.get_decoder()
        self.dtype = model.get_input_embeddings().weight.dtype
        self.ids = list(layer_ids)
        self.device = model.get_input_embeddings().weight.device
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self._layers = LayerOutputs(model, self.ids)

    @torch.inference_mode()
    def __call__(self, batch, reference: bool = False):
        """(aux, last); `reference`: the whole model runs (lm_head included) and its own logprob of
        each next token and top-1 come back too, one {"chosen": [L-1], "top1": [L-1]} a sample."""
        ids, keep = pad_batch(batch, self.pad_id)
        if reference:
            out = self.model(input_ids=ids.to(self.device), use_cache=False, output_hidden_states=True)
            last, logits = out.hidden_states[-1], out.logits.float()
        else:
            last = self.base(input_ids=ids.to(self.device), use_cache=False).last_hidden_state
        keep = keep.to(last.device)
        aux = torch.cat([h[keep.to(h.device)].to(last.device) for h in self._layers.take()], dim=-1)
        if not reference:
            return aux.cpu(), last[keep].cpu()
        refs = []
        for r, s in enumerate(batch):
            n, nxt = len(s), s.input_ids[1:].long().to(logits.device)
            z = logits[r, :n - 1]
            chosen = z.gather(1, nxt[:, None])[:, 0] - torch.logsumexp(z, dim=-1)
            refs.append({"chosen": chosen.cpu(), "top1": z.argmax(-1).cpu()})
        return aux.cpu(), last[keep].cpu(), refs

    def close(self) -> None:
        self._layers.close()
