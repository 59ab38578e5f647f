"""Stage 04: run the target over the token ids and store the features the drafter learns from.

For every token of every sample: the outputs of the auxiliary decoder layers (`aux`, side by side)
and the final hidden state after the final norm (`last`, what the lm_head reads), layer ids in the
OUTPUT convention (`draftsmith.layers`). Notebook 04 calls `stage.run`, which extracts here or as
torchrun ranks (`python -m draftsmith.hidden CONFIG.json`; several nodes need an output folder
they all see). The shards and their index are `outputs`'; `check` proves them before any is written."""
