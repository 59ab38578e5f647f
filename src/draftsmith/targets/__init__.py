"""The target model's one home: every stage that needs the target comes here.

  tiny.py          the embedded tiny target (built once into the cache), its chat template
  kimi_mini.py     the built-in Kimi-K2.5-shaped target (`kimi-mini` INT4 experts, `kimi-mini-bf16`)
  corpus.py        the built-in targets' offline training text
  checkpoint.py    `resolve_target`, config, tokenizer, single tensors, the transformers model
  identity.py      the one fingerprint of a checkpoint (the target's, an exported drafter's)
  hooks.py         forward hooks keeping the outputs of chosen decoder layers
  vllm_capture.py  runs inside the vLLM engine's process: the one file touching vLLM internals
"""
