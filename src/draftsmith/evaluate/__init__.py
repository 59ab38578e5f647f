"""Stage 06: acceptance length, measured by drafting and verifying against the target.

The stage entry is `stage.run`. Around it, one idea a module:
    prompts        the held-out prompts (stage 05's held-out ids, their tokens from stage 04)
    target_cache   the target with a KV cache, one sequence at a time (our decoder's verifier)
    proposers      what drafts: prompt lookup (n-gram copying) and an exported EAGLE-3 drafter
    decode         one speculative decode: draft, verify, accept, the rounds it took
    metrics        acceptance from the rounds, novel vs repeating text, speed-up estimate, verdict
    methods        the methods compared: no drafter, prompt lookup, every export of the drafter
    measure        our decoder over every method, prompt and temperature, resumable
    outputs        the stage's files under `<run>/eval/` (rounds measured, the report) and their names
    engine         the same methods measured inside vLLM (a child process: `engine_child`, many requests
                   in flight: `engine_batch`, its time estimated first: `estimate`), summed up by
                   `engine_summary`
    results        every result in the field's one definition of acceptance length: the tables per
                   temperature and prompt set, the headline rows, the README's table
    figures, serving   what notebook 06 shows (tables, text, figures), saves and prints
"""
