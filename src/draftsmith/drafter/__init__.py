"""Stage 05, the drafters. `stage` is the recipe, read top to bottom: `stage.run(run, cfg)` is
notebook 05's one call, training each kind on stage 04's hidden states from stage 05's config
(`config.DrafterConfig`). Its units: the draft vocabulary (`vocab`), the EAGLE-3 model (`model`,
its shape `DrafterShape`) and its TTT objective (`objective`), the training data and its preparation
(`data`), the two drafter kinds behind one protocol (`kinds`), the EAGLE-3 SGLang/vLLM export
(`export`), the DFlash block drafter, its objective and vLLM export (`dflash`), tables and figures
(`figures`), and `outputs`, the one owner of the files under `<run>/drafter/` (and
`<run>/drafter-dflash/`). Stage 06 loads a drafter with `load_exported(export_dir, target_path)`
(`dflash.load_exported`) and reads the held-out samples with `outputs.read_heldout`."""

from .export import load_exported
from .model import DrafterShape, Eagle3Drafter, KVCache

__all__ = ["load_exported", "DrafterShape", "Eagle3Drafter", "KVCache"]
