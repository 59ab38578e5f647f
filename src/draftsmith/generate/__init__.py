"""Stage 02: sample responses for every prompt through the API, within token and dollar budgets.

Notebook 02 calls `stage.run(run, cfg)`, which returns a `GenerationResult` (session.py).
Every answer paid for is saved at once and never asked for again (outputs.py: what is saved, and
how a re-run resumes). stage.py is the entry and the settings a run's answers are made under,
session.py one start or resume (also against a bare vLLM or SGLang server, without balance,
catalogue, routing or cost), prompt_queue.py the prompts still to do, attempts.py one sample's
attempts, prompt_edits.py the answers to prompts since edited; each module's docstring says what it owns."""
