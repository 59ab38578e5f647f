"""Stage 04: run the target over the token ids and store the features the drafter learns from.

For every token of every sample: the outputs of the three auxiliary decoder layers (`aux`, side by
side) and the final hidden state after the final norm (`last`: the decoder's `last_hidden_state`,
what the lm_head reads). Layer ids are kept in the OUTPUT convention (`draftsmith.layers`): id k is
the output of decoder layer k, Hugging Face `output_hidden_states[k + 1]`. The shards and their
index are `draftsmith.hidden.outputs`'; the target and its engines are `draftsmith.targets`'s.

  stage.py    the entry notebook 04 calls (`run`): here, or as torchrun ranks (`launch`)
  extract.py  the extraction itself (`extract`, `Settings`): one rank's shards, the index at the end
  plan.py     batches by length, shards of batches, the disk check
  resume.py   what the shards on disk already hold; leftovers of a killed run; one writer a folder
  check.py    stage 04's own check, in the engine, before any shard; every shard's health
  verify.py   the stored features against the target run alone in transformers (targets it can hold)
  figures.py  activation norms by layer, every shard's health

Several nodes need the output folder on a filesystem they all see. Command line (what `launch`
runs under torchrun; CONFIG.json as `stage.write_config` writes it):
  torchrun --nproc-per-node 8 -m draftsmith.hidden CONFIG.json
"""
