"""Stage 03: rebuild the exact token ids the target read and wrote, then prove them against billing.

OpenRouter returns text; EAGLE-3 training needs the ids. For each sample of stage 02's responses
and of each import file (`draftsmith.imports`), `targets.rebuild` gives its prompt and output ids (loss_mask
0 on the prompt, 1 on the output) and `checks` holds them to what its provider billed; `stage.run`,
what notebook 03 calls, does it all, resumable per source file, and `outputs` owns the files. Where
the engine's sampled ids were saved they are the truth. Each sample keeps its `source`; a prompt
two sources answered is kept once (`checks`). `figures` has what the notebook shows, `outputs` the
stage's verdict."""

from .checks import Thresholds, check
from .figures import figures, provider_table, source_table, summary
from .outputs import Sample, read_checks, read_report, read_tokens, token_files
from ..targets.rebuild import BadLine, Reconstructor, Response, load_reconstructor

__all__ = ["BadLine", "Reconstructor", "Response", "Sample", "Thresholds", "check", "figures",
           "load_reconstructor", "provider_table", "read_checks", "read_report", "read_tokens", "source_table",
           "summary", "token_files"]
