"""Stage 02: sample responses for every prompt through the API, within token and dollar budgets.

Notebook 02 calls `stage.run(run, cfg)`, which returns a `GenerationResult` (session.py).
Every answer paid for is saved at once and never asked for again (outputs.py: what is saved, and
how a re-run resumes). session.py is one start or resume, attempts.py one sample's attempts; each
module's docstring says what it owns. Against a bare vLLM or SGLang server (bare_server.py) the
balance, catalogue, routing and cost are switched off, with a line saying so."""
