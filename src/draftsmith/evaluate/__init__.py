"""Stage 06: acceptance length, measured by drafting and verifying against the target.

Notebook 06 calls `stage.run`. Every method (no drafter, prompt lookup, every export of the
drafter: `methods`) decodes the held-out prompts at every temperature twice: in our decoder over
the target (`decode`) and inside vLLM (`engine`), both resumable; `metrics` counts acceptance from
either, `benchmarks` brings the field's prompt sets and serving commands. `results` states every
result in the field's one definition of acceptance length; `outputs` owns the files under
`<run>/eval/`. Each module's docstring says what it owns."""
