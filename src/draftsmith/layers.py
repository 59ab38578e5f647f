"""Which target layers feed the drafter, and how each engine names them.

draftsmith stores layer ids in the "output" convention: id k is the output of decoder layer k,
input id k+1, Hugging Face `output_hidden_states[k + 1]` (docs/eagle3.md; both conventions at
`CONVENTIONS`). `engine_layer_ids` gives the ids a draft config must name for vLLM or SGLang so that
the engine captures those tensors; `engine_capture_indices` reads them back the engine's way."""

from __future__ import annotations

# Two conventions name the same tensors:
#   "output": id k = the OUTPUT of decoder layer k (SpecForge, ModelOpt forward hooks);
#             EAGLE-3 default {1, N/2-1, N-4}.
#   "input":  id k = the INPUT of decoder layer k, `hidden_states + residual` before it runs
#             (EAGLE, SGLang and vLLM model code); EAGLE-3 default {2, N/2, N-3}.
# Output id k == input id k+1. In Hugging Face `output_hidden_states`, element 0 is the embedding
# output and element j (1..N) the output of layer j-1: output id k is `hidden_states[k + 1]`, input
# id k is `hidden_states[k]`. (HF applies the final norm to its last element; layer ids never reach
# it since input ids stop at N-1.)
CONVENTIONS = ("output", "input")
ENGINES = ("sglang", "vllm")


def default_layer_ids(num_layers: int) -> list[int]:
    """The EAGLE-3 default, output convention: {1, N/2-1, N-4}."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 8 or len(set(ids)) != 3:
        raise ValueError(f"a target with {num_layers} layers is too shallow for three distinct "
                         f"auxiliary layers; give layer ids explicitly")
    return ids


def dflash_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """DFlash's spread of `n` target layers, output convention (as its draft configs write them):
    layer 1 to layer N-3, evenly; Qwen3-8B (36 layers): [1, 9, 17, 25, 33]."""
    if n == 1:
        return [num_layers // 2]
    ids = [int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n)]
    if n < 1 or len(set(ids)) != n or ids[-1] >= num_layers:
        raise ValueError(f"a target with {num_layers} layers has no {n} distinct DFlash layers; give layer ids explicitly")
    return ids


LAYER_SETS = ("eagle3", "dflash", "both")


def capture_layer_ids(num_layers: int, layer_set: str) -> list[int]:
    """The layers stage 04 captures for `layer_set`: EAGLE-3's three, DFlash's spread, or both
    (their union, so one capture trains either drafter with its own layers exactly)."""
    if layer_set not in LAYER_SETS:
        raise ValueError(f"layer_set must be one of {LAYER_SETS}, got {layer_set!r}")
    ids = set()
    if layer_set in ("eagle3", "both"):
        ids |= set(default_layer_ids(num_layers))
    if layer_set in ("dflash", "both"):
        ids |= set(dflash_layer_ids(num_layers))
    return sorted(ids)


def training_layer_ids(stored: list[int], kind: str, num_layers: int, chosen: list[int] | None = None) -> list[int]:
    """The stored layers a drafter of `kind` trains on (output convention): `chosen` when given
    (each must be stored), else the kind's own set where the capture holds it, else for EAGLE-3 the
    stored layer nearest to each of its three (a DFlash capture serves EAGLE-3) and for DFlash every
    stored layer."""
    stored = sorted(int(k) for k in stored)
    if chosen:
        missing = [k for k in chosen if k not in stored]
        if missing:
            raise ValueError(f"train_layer_ids {list(chosen)}: layers {missing} were not captured by stage 04 "
                             f"(it stored {stored})")
        return sorted(int(k) for k in chosen)
    if kind == "eagle3":
        if len(stored) == 3:
            return stored
        want = default_layer_ids(num_layers)
        ids = [min(stored, key=lambda k: (abs(k - w), k)) for w in want]
        if len(set(ids)) != 3:
            raise ValueError(f"stage 04 stored layers {stored}: no three distinct ones near EAGLE-3's {want}; "
                             f"set train_layer_ids")
        return ids
    if kind == "dflash":
        own = dflash_layer_ids(num_layers)
        return own if set(own) <= set(stored) else stored
    raise ValueError(f"drafter kind must be eagle3 or dflash, got {kind!r}")


def in_output_convention(ids: list[int], convention: str) -> list[int]:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    return list(ids) if convention == "output" else [k - 1 for k in ids]


def hf_hidden_state_indices(layer_ids: list[int]) -> list[int]:
    """Indices into HF `output_hidden_states` that hold the outputs of these layers."""
    return [k + 1 for k in layer_ids]


def engine_layer_ids(layer_ids: list[int], engine: str) -> list[int]:
    """The ids to write into a draft config for `engine` so that it captures these tensors. vLLM
    reads `eagle_aux_hidden_state_layer_ids` as written, as INPUT ids; SGLang adds 1 to them
    (treats them as OUTPUT ids) when the first id is 1, and otherwise reads them as INPUT ids."""
    if engine == "vllm":
        return [k + 1 for k in layer_ids]
    if engine == "sglang":
        # SGLang shifts by one only when the first id is 1; otherwise it reads input ids.
        return list(layer_ids) if layer_ids[0] == 1 else [k + 1 for k in layer_ids]
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")


def engine_capture_indices(config_ids: list[int], engine: str) -> list[int]:
    """What an engine captures from a draft config's ids, as HF hidden_states indices: the
    engine-side reading, written independently of `engine_layer_ids` so tests can check one
    against the other."""
    if engine == "sglang" and config_ids[0] == 1:
        input_ids = [k + 1 for k in config_ids]
    elif engine in ENGINES:
        input_ids = list(config_ids)
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return input_ids  # input id k is hidden_states[k]


def numbering_table(layer_ids: list[int]):
    """The same tensors under each numbering (a table, one row per layer): stored (output)
    ids, input ids, HF `output_hidden_states` indices and the ids a draft config gives each engine."""
    import pandas as pd

    return pd.DataFrame({"stored (output convention)": list(layer_ids),
                         "input convention": [k + 1 for k in layer_ids],
                         "HF output_hidden_states index": hf_hidden_state_indices(layer_ids),
                         "SGLang draft-config id": engine_layer_ids(layer_ids, "sglang"),
                         "vLLM draft-config id": engine_layer_ids(layer_ids, "vllm")},
                        index=["low", "mid", "high"] if len(layer_ids) == 3 else [f"#{i}" for i in range(len(layer_ids))])
