"""The target model's one home: every stage that needs the target comes here.

  tiny.py          the embedded tiny target (built once into the cache), its chat template
  kimi_mini.py     the built-in Kimi-K2.5-shaped target (`kimi-mini` INT4 experts, `kimi-mini-bf16`), its tokenizer
  corpus.py        the built-in targets' offline training text
  checkpoint.py    `resolve_target`, config, tokenizer, single tensors, the transformers model, its fingerprint
  rebuild.py       text -> the exact ids the target read and wrote (stages 03 and 01's logprob probe)
  hf.py            stage 04's transformers capture; the hooks keeping chosen decoder layers' outputs
  vllm.py          stage 04's vLLM capture, an engine in a child process; `GpuOnly`
  vllm_capture.py  runs inside the vLLM engine's process: the one file touching vLLM internals
  vllm_fixes.py    workarounds for vLLM's CPU build, applied in every engine process before it starts
"""
