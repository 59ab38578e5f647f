"""Stage 02: sample responses for every prompt through the API, within token and dollar budgets.

stage.py        `run(run, **params)`, what notebook 02 calls (`run_at`: against an API already open); it returns a `GenerationResult`
The parts:
  options.py      what the stage is told (Options) and what it answers (GenerationResult)
  run_settings.py the settings that shape a run's answers, kept in its manifest; a re-run under others is refused
  session.py      one start or resume: slots shared by the datasets, starts, stops, the bare-server case
  attempts.py     one sample's attempts (a Sampler given what they use), what its failures and lost answers cost
  counts.py       the session's counters, named as the manifest names them
  money.py        what a money stop says, and when the money-bound tail stops for a top-up
  bookkeeping.py  progress, the timeline, the manifest, the closing message
  prompt_queue.py the prompts still to do, per dataset, read lazily from the files
  prompt_edits.py the prompt files as they are now against the saved answers: reworded and removed set aside
  bare_server.py  the user's own vLLM or SGLang server in place of OpenRouter
  figures.py      tables and figures of what the stage wrote (notebook 02)
What is saved, and how a re-run resumes without paying twice: outputs.py.

Routing: stage 01's routing (providers.outputs.read_routing) merged with the `provider`
parameter; without it, the same precision policy (providers.endpoints.policy_routing) is applied
here over the live endpoint list.

A bare OpenAI-compatible server (`api_base` of the user's own vLLM or SGLang, bare_server.py) has
no balance, catalogue, routing or cost: those parts are switched off, with a line saying so, and
each response line records the engine as its `source` and, from vLLM, the sampled `output_ids` and
`prompt_ids`. OpenRouter's lines say `"source": "openrouter"`.
"""
