"""Stage 01: which providers serve the model at its native precision, at what price, how much of
the token budget the money buys, and whether each endpoint really serves the same model.

    stage.py      `run(run, cfg)` with notebook 01's settings, then its steps in order: the planned
                  cost of the output budgets against the balance and the spend limit, the response
                  length (given, or measured by a paid pilot)
    probe.py      the paid fidelity probe, and excluding the endpoints it flags
    logprobs.py   the paid logprob probe: stage 04's independent reference
    outputs.py    the stage's files: the one module that writes and reads them
    figures.py    cost vs balance, price vs throughput

The endpoint table and the precision policy (the `provider` routing object), the stage's HTTP
client and every money question (prices, the balance) are `draftsmith.openrouter`'s.
Notebook 01 calls `stage.run`, then shows its tables and figures.
"""
