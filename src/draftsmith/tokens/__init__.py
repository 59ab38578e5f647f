"""Stage 03: rebuild the exact token ids the target read and wrote, then prove them against billing.

OpenRouter returns text; EAGLE-3 training needs the ids. For each sample of stage 02's responses
and of each import file (`draftsmith.imports`), the package
  responses  parses a line into the fields it needs (a bad line is reported as file:line);
  rebuild    rebuilds prompt ids (chat template with the generation prompt) and output ids
             (reasoning, think_end, content, end_of_turn); loss_mask is 0 on every prompt token,
             1 on every output token;
  layouts    names the layout each response took (reasoning closed, or run into a tool call, ...);
  checks     checks each sample against what its provider billed and for structural faults;
  analysis   compares every provider with the others: which disagree, and why;
  outputs    owns the stage's files (tokens/<dataset>.jsonl for stage 04, tokens/checks/,
             tokens/report.json) and reads them back;
  stage      runs it all (`run`, what notebook 03 calls), resumable per source file;
  summary, figures  what notebook 03 prints and shows.
Where the engine's sampled ids were saved (a local engine in stage 02, or an import file), they are
the truth and the text's rebuild only measures how often the two agree. Each sample keeps its
`source`; a prompt two sources answered is kept once (`sources`).
"""

from .checks import Thresholds, check
from .figures import figures
from .outputs import Sample, read_checks, read_report, read_tokens, token_files
from .rebuild import Reconstructor, load_reconstructor
from .responses import BadLine, Response
from .summary import provider_table, summary

__all__ = ["BadLine", "Reconstructor", "Response", "Sample", "Thresholds", "check", "figures",
           "load_reconstructor", "provider_table", "read_checks", "read_report", "read_tokens", "summary",
           "token_files"]
