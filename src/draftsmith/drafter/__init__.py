"""Stage 05, the drafters: draft vocabulary (`vocab`), the EAGLE-3 model (`model`), its training data
(`data`), the settings (`config`), preparation (`prepare`), the TTT objective (`objective`), held-out
scores (`scoring`), checkpoints (`checkpoints`), the two drafter kinds behind one protocol (`kinds`),
the training loop (`train`), the SGLang/vLLM export (`export`), the DFlash block drafter and its
objective (`dflash`) and vLLM export (`dflash_export`), tables and figures (`figures`), and
`outputs`, the one owner of the files under `<run>/drafter/` (and `<run>/drafter-dflash/`);
`stage.run(run, cfg)` is notebook 05's one call. Stage 06 loads
a drafter with `load_exported(export_dir, target_path)` (`dflash_export.load_exported`) and reads
the held-out samples with `outputs.read_heldout`."""

from .export import load_exported
from .model import DrafterShape, Eagle3Drafter, KVCache

__all__ = ["load_exported", "DrafterShape", "Eagle3Drafter", "KVCache"]
